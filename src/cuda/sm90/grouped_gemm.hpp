// Host interface of the Hopper grouped GEMM kernel (sm_90a).
#pragma once

#include <cstdint>
#include <string>

#include "cuda/sm90/config.hpp"
#include "moe_engine/device.hpp"
#include "moe_engine/dtype.hpp"

namespace moe::cuda::sm90 {

// One grouped GEMM of a grouped linear layer with N output and K input features over T rows:
//   forward: a = x [T, K],  b = W packed [G, N, K], d = y [T, N]
//   dgrad:   a = dy [T, N], b = W packed [G, N, K], d = dx [T, K]
//   wgrad:   a = dy [T, N], b = x [T, K],           d = dW packed [G, N, K]
// Row strides are in elements. Only the device offsets decide which rows belong to which group.
struct GroupedGemmProblem {
  Form form = Form::kForward;
  DType in_dtype = DType::kBFloat16;
  DType out_dtype = DType::kBFloat16;
  const void* a = nullptr;
  int64_t a_row_stride = 0;
  const void* b = nullptr;
  int64_t b_row_stride = 0;
  void* d = nullptr;
  int64_t d_row_stride = 0;
  int64_t num_groups = 0, capacity = 0, n = 0, k = 0;
  const int64_t* offsets = nullptr;
  const void* bias = nullptr;        // forward: [G, N] in the input dtype
  const float* row_scale = nullptr;  // forward: [T]
  bool reduce_add = false;           // wgrad: d += result (fp32)
  int device = 0;
};

// Whether the kernel runs this problem on its device; if not, *why says what is missing.
bool can_run(const GroupedGemmProblem& problem, std::string* why);
void run(const GroupedGemmProblem& problem, Stream stream);

}  // namespace moe::cuda::sm90
