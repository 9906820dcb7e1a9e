// The portable grouped GEMM (any NVIDIA GPU of compute capability 8.0+): plain CUDA, fp32
// accumulation, any alignment and strides, packed or per-expert tensors. Correct and graph safe;
// speed is secondary (the Hopper kernel is the fast path).
#pragma once

#include <cstdint>
#include <string>

#include "cuda/expert_address.hpp"
#include "cuda/gemm_form.hpp"
#include "moe_engine/device.hpp"
#include "moe_engine/dtype.hpp"

namespace moe::cuda::portable {

// Same operands as sm90::GroupedGemmProblem; b (forward, dgrad) and d (wgrad) are per expert.
struct GroupedGemmProblem {
  Form form = Form::kForward;
  DType in_dtype = DType::kBFloat16, out_dtype = DType::kBFloat16;
  const void* a = nullptr;
  int64_t a_row_stride = 0;
  ExpertAddress b;
  int64_t b_row_stride = 0;
  ExpertAddress d;
  int64_t d_row_stride = 0;
  int64_t num_groups = 0, capacity = 0, n = 0, k = 0;
  const int64_t* offsets = nullptr;
  ExpertAddress bias;  // forward: per-expert [N] in the input dtype; base null = no bias
  const float* row_scale = nullptr;
  bool accumulate = false;  // wgrad: d += result; empty groups untouched
  int device = 0;
};

bool can_run(const GroupedGemmProblem& problem, std::string* why);
void run(const GroupedGemmProblem& problem, Stream stream);

}  // namespace moe::cuda::portable
