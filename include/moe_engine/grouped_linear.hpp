// Grouped linear (docs/design.md, "Grouped linear"): one GEMM per expert over the packed token matrix, all
// experts in one call. Rows past offsets[G] are never written.
//   x [T, K], y [T, N], weight G x [N, K], bias G x [N], T = groups.capacity().
#pragma once

#include "moe_engine/bias_epilogue.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/grad_mode.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

namespace moe {

// y[r] = x[r] W_g^T (+ b_g, or + row_scale[r] b_g). y may have any float dtype.
MOE_API void grouped_linear_forward(const TensorView& x, const GroupedParam& weight,
                                    const GroupLayout& groups, const TensorView& y,
                                    const BiasEpilogue& bias = {}, const ExecContext& ctx = {});

// dx[r] = dy[r] W_g.   dy [T, N], dx [T, K].
MOE_API void grouped_linear_dgrad(const TensorView& dy, const GroupedParam& weight,
                                  const GroupLayout& groups, const TensorView& dx,
                                  const ExecContext& ctx = {});

// dW_g = dy_g^T x_g  (contraction over the expert's rows), into dweight G x [N, K] per `mode`.
MOE_API void grouped_linear_wgrad(const TensorView& dy, const TensorView& x,
                                  const GroupLayout& groups, const GroupedParam& dweight,
                                  GradMode mode, const ExecContext& ctx = {});

// db_g = sum_r dy[r], or sum_r row_scale[r] dy[r] when row_scale is defined; dbias G x [N].
MOE_API void grouped_linear_dbias(const TensorView& dy, const GroupLayout& groups,
                                  const GroupedParam& dbias, GradMode mode,
                                  const TensorView& row_scale = {}, const ExecContext& ctx = {});

// dscales[r] = <dy[r], b_g> (+= with accumulate): the gradient of the row scale of a scale_bias
// forward. dscales [T] float32.
MOE_API void grouped_linear_dscales(const TensorView& dy, const GroupedParam& bias,
                                    const GroupLayout& groups, const TensorView& dscales,
                                    bool accumulate = false, const ExecContext& ctx = {});

}  // namespace moe
