// The CPU reference backend. Inputs arrive validated by src/ops; every function computes rows
// [0, offsets[G]) only and accumulates in float32 (float64 for float64 inputs). Each output element
// is produced by one thread in a fixed order, so results are deterministic and independent of the
// thread count and of the weight layout.
#pragma once

#include "moe_engine/bias_epilogue.hpp"
#include "moe_engine/glu_spec.hpp"
#include "moe_engine/grad_mode.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/tensor.hpp"

namespace moe::cpu {

void grouped_linear_forward(const TensorView& x, const GroupedParam& weight,
                            const GroupLayout& groups, const TensorView& y,
                            const BiasEpilogue& bias);
void grouped_linear_dgrad(const TensorView& dy, const GroupedParam& weight,
                          const GroupLayout& groups, const TensorView& dx);
void grouped_linear_wgrad(const TensorView& dy, const TensorView& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode);
void grouped_linear_dbias(const TensorView& dy, const GroupLayout& groups,
                          const GroupedParam& dbias, GradMode mode, const TensorView& row_scale);
void grouped_linear_dscales(const TensorView& dy, const GroupedParam& bias,
                            const GroupLayout& groups, const TensorView& dscales, bool accumulate);

void glu_forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
                 const TensorView& out, const GluSpec& spec);
void glu_backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
                  const GroupLayout& groups, const GluBackwardOutputs& outputs,
                  const GluSpec& spec);

}  // namespace moe::cpu
