// One grouped GEMM of a grouped linear layer with N output and K input features over T rows, as
// both kernel families (sm90/, portable/) take it:
//   forward: a = x [T, K],  b = W per expert [N, K], d = y [T, N]
//   dgrad:   a = dy [T, N], b = W per expert [N, K], d = dx [T, K]
//   wgrad:   a = dy [T, N], b = x [T, K],            d = dW per expert [N, K]
// Row strides are in elements. Only the device offsets decide which rows belong to which group.
#pragma once

#include <cstdint>

#include "cuda/gemm/expert_address.hpp"
#include "cuda/gemm/gemm_form.hpp"
#include "moe_engine/dtype.hpp"
#include "moe_engine/group_layout.hpp"

namespace moe::cuda {

struct GroupedGemmProblem {
  Form form = Form::kForward;
  DType in_dtype = DType::kBFloat16;
  DType out_dtype = DType::kBFloat16;
  const void* a = nullptr;
  int64_t a_row_stride = 0;
  ExpertAddress b;  // forward/dgrad: the weights; wgrad: x (base only)
  int64_t b_row_stride = 0;
  ExpertAddress d;  // forward/dgrad: y / dx (base only); wgrad: dW
  int64_t d_row_stride = 0;
  int64_t num_groups = 0, capacity = 0, n = 0, k = 0;
  const int64_t* offsets = nullptr;
  ExpertAddress bias;                   // forward: per-expert [N]; undefined = no bias
  DType bias_dtype = DType::kBFloat16;  // the kernels read it in in_dtype
  const float* row_scale = nullptr;     // forward: [T] scales of the bias
  bool accumulate = false;              // wgrad: d += result (fp32), empty groups untouched; dgrad
                                        // (sm90): d += result rounded to d's dtype (TMA reductions)
  int device = 0;
  // FP8 block scaling (in_dtype float8_e4m3; moe_engine/fp8.hpp). The dgrad runs as the forward
  // form over the weight's transposed copy; the wgrad's a and b are the columns copies [N, C] and
  // [K, C], its offsets their column offsets and capacity C.
  //   forward: a_scales [ceil(K/128), S] (row stride S), b_scales [G, ceil(N/128), ceil(K/128)];
  //   wgrad:   a_scales [C/128, N], b_scales [C/128, K] (row strides N and K).
  const float* a_scales = nullptr;
  int64_t a_scales_stride = 0;
  const float* b_scales = nullptr;
};

// A problem of `form` over the routing `groups` (operands and sizes still to fill in).
inline GroupedGemmProblem problem_for(Form form, const GroupLayout& groups, DType in, DType out) {
  GroupedGemmProblem p;
  p.form = form;
  p.in_dtype = in;
  p.out_dtype = out;
  p.num_groups = groups.num_groups();
  p.capacity = groups.capacity();
  p.offsets = groups.offsets().data_as<int64_t>();
  p.device = groups.device().index;
  return p;
}

}  // namespace moe::cuda
