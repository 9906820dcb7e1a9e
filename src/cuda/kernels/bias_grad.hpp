// Bias kernels on CUDA: the gradients db_g = sum_r s[r] dy[r] and dscales[r] = <dy[r], b_g>, and
// the bias added after a GEMM, y[r] += s[r] b_g.
#pragma once

#include "cuda/gemm/expert_address.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/tensor.hpp"

namespace moe::cuda {

// db_g [N] per expert: written (zeros for empty groups) or, with accumulate, added to (empty
// groups untouched).
void launch_dbias(const TensorView& dy, const GroupLayout& groups, const ExpertAddress& db,
                  DType db_dtype, bool accumulate, const TensorView& row_scale, Stream stream);
// dscales [T] float32 for rows < offsets[G]; bias_g [N] per expert.
void launch_dscales(const TensorView& dy, const ExpertAddress& bias, DType bias_dtype,
                    const GroupLayout& groups, const TensorView& dscales, bool accumulate,
                    Stream stream);
// y[r] += s[r] * b_g in float32 (s = row_scale[r], 1 without it; one fused multiply-add a value)
// for rows r < offsets[G] of a float32 y, bias_g [N] per expert: a GEMM's bias epilogue run after
// the GEMM.
void launch_add_bias(const TensorView& y, const ExpertAddress& bias, DType bias_dtype, const GroupLayout& groups,
                     const TensorView& row_scale, Stream stream);

}  // namespace moe::cuda
