// The CUDA backend. Inputs arrive validated by src/ops (device, shapes, dtypes); these functions
// check what their kernels additionally need (alignment, packed weights, ...) and raise
// kNotImplemented, saying why, for what no kernel covers yet. Everything is enqueued on `stream`:
// no host sync, no allocation, fixed launch shapes (CUDA-graph safe).
#pragma once

#include "moe_engine/glu.hpp"
#include "moe_engine/grouped_linear.hpp"

namespace moe::cuda {

void grouped_linear_forward(const TensorView& x, const GroupedParam& weight,
                            const GroupLayout& groups, const TensorView& y,
                            const BiasEpilogue& bias, Stream stream);
void grouped_linear_dgrad(const TensorView& dy, const GroupedParam& weight,
                          const GroupLayout& groups, const TensorView& dx, Stream stream);
void grouped_linear_wgrad(const TensorView& dy, const TensorView& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode, Stream stream);
void grouped_linear_dbias(const TensorView& dy, const GroupLayout& groups,
                          const GroupedParam& dbias, GradMode mode, const TensorView& row_scale,
                          Stream stream);
void grouped_linear_dscales(const TensorView& dy, const GroupedParam& bias,
                            const GroupLayout& groups, const TensorView& dscales, bool accumulate,
                            Stream stream);


void glu_forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
                 const TensorView& out, const GluSpec& spec, Stream stream);
void glu_backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
                  const GroupLayout& groups, const GluBackwardOutputs& outputs, const GluSpec& spec,
                  Stream stream);

}  // namespace moe::cuda
