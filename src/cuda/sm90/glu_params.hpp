// Parameters of the Hopper grouped GEMM's activation epilogues (epilogue_glu.cuh): the GLU ones and
// the non-gated ones (srelu, gelu_tanh), host-visible.
#pragma once

#include <cstdint>

#include "common/glu_math.hpp"

namespace moe::cuda::sm90 {

struct GluEpilogueParams {
  detail::GluMath<float> math;   // a GLU's
  const float* probs = nullptr;  // [T] router probs, or null (p = 1)
  void* act = nullptr;           // forward: act * p [T, F]; backward: act * p recomputed, or null
  int64_t act_stride = 0;
  const void* h = nullptr;       // backward: the pre-activation [T, W] (W = 2F for a GLU, F non-gated)
  int64_t h_stride = 0;
  void* dh = nullptr;            // backward: dL/dh [T, W]
  int64_t dh_stride = 0;
  float* dprobs_partial = nullptr;  // backward: [T, partial_stride] per 256-feature tile, or null
  int32_t partial_stride = 0;
  int32_t block = 1;    // a GLU's s of the column layout (1: pairs); a power of two (forward: 1 or 8..128)
  int32_t block_shift = 0;  // log2(s)
  int32_t store_h = 0;  // forward: the plain epilogue also stores h (the GEMM's output)
  Activation activation = Activation::kSwiGLU;  // which: the non-gated epilogues take srelu or gelu_tanh
};

}  // namespace moe::cuda::sm90
