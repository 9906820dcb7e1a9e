// The CUDA backend. Inputs arrive validated by src/ops (device, shapes, dtypes); these functions
// check what their kernels additionally need (alignment, packed weights, ...) and raise
// kNotImplemented, saying why, for what no kernel covers yet. Everything is enqueued on `stream`:
// no host sync, no allocation, fixed launch shapes (CUDA-graph safe).
#pragma once

#include "moe_engine/expert_mlp.hpp"
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

// dprobs[r] = sum over t < tiles of partial[r, t] (row stride `stride`), for rows < offsets[G].
void glu_dprobs_reduce(const float* partial, int64_t stride, int64_t tiles, const GroupLayout& groups,
                       const TensorView& dprobs, Stream stream);

// The fused expert MLP's two GLU GEMMs (Hopper kernel, sm90/glu_epilogue.cuh). Each returns false
// without doing anything where the kernel cannot run the problem; the caller then composes the
// unfused path. Inputs arrive validated (ops/expert_mlp.cpp).
//   FC1: act = GLU(x W1^T + b1) * p; h (optional) receives the pre-activation.
bool expert_mlp_fc1_glu(const TensorView& x, const ExpertMlpWeights& weights, const GroupLayout& groups,
                        const TensorView& probs, const GluSpec& spec, const TensorView& h,
                        const TensorView& act, Stream stream);
//   FC2 dgrad: from dy and the pre-activation h, dh = dL/dh; act (optional) = act * p recomputed;
//   dprobs (optional) = <act, dy W2> per row, reduced from `scratch` (>= T * ceil(F / 256) floats).
bool expert_mlp_fc2_dgrad_glu(const TensorView& dy, const ExpertMlpWeights& weights,
                              const GroupLayout& groups, const TensorView& h, const TensorView& probs,
                              const GluSpec& spec, const TensorView& dh, const TensorView& act,
                              const TensorView& dprobs, const TensorView& scratch, Stream stream);

}  // namespace moe::cuda
