// Kernel parameters of the Hopper grouped GEMM besides its tensor maps, filled by the host launcher
// (grouped_gemm.cu's prepare) and passed by value to every kernel instance.
#pragma once

#include <cuda.h>  // CUtensorMap (the type only)

#include <cstdint>

#include "cuda/sm90/glu_params.hpp"

namespace moe::cuda::sm90 {

struct GemmParams {
  const int64_t* offsets;  // [G + 1] group offsets, sanitized on the device by GroupLayout
  int32_t num_groups;
  int32_t m_out;           // wgrad: rows of each D_g
  int32_t n_out;           // columns of D
  int32_t k;               // forward/dgrad: contraction length
  const void* bias;        // forward: [G, n_out] in the input dtype, or null
  const float* row_scale;  // forward: [T] scales of the bias ("scale_bias"), or null
  int32_t reduce_add;      // wgrad: add into D (fp32 main_grad); dgrad: into dx (rounded to its dtype first)
  int32_t multicast;       // 0: pairs never share B loads (an A/B switch for measurements)
  GluEpilogueParams glu;   // Epilogue::kGluForward / kGluBackward only
  // Per-expert tensors: one tensor map per group in device memory (group coordinate 0) replaces
  // the packed map (forward/dgrad: the weights; wgrad: D), and the bias comes from a device
  // pointer table (bias then points at the table too, so "has a bias" stays one test). Null: packed.
  const CUtensorMap* b_maps;
  const CUtensorMap* d_maps;
  const int64_t* bias_table;
  // FP8 (fp32 scales): M-grouped, A's row scales [k blocks, a_scale_stride] (M-major) and the
  // weight's block scales [G, b_scale_rows, b_scale_cols]; K-grouped (wgrad), A's and B's scales
  // [C / 128, a_scale_stride = m_out] and [C / 128, n_out].
  const float* a_scales;
  const float* b_scales;
  int32_t a_scale_stride, b_scale_rows, b_scale_cols;
};

}  // namespace moe::cuda::sm90
