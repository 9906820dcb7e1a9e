// The CPU reference backend. Inputs arrive validated by src/ops; every function computes rows
// [0, offsets[G]) only and accumulates in float32 (float64 for float64 inputs). Each output element
// is produced by one thread in a fixed order, so results are deterministic and independent of the
// thread count and of the weight layout.
#pragma once

#include "moe_engine/bias_epilogue.hpp"
#include "moe_engine/fp8.hpp"
#include "moe_engine/glu_spec.hpp"
#include "moe_engine/grad_mode.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/router_spec.hpp"
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

// Permute and unpermute (permute.cpp; docs/design.md section 14). The routing values arrive
// checked too (indices in [0, E); row_of entries -1 or below offsets[G]).
//   row_of[t, j] = the row of assignment (t, j) in expert order, or -1 past the first
//   `expert_capacity` assignments of its expert; splits = kept counts, dropped (optional) = the rest.
void permute_plan(const TensorView& indices, int64_t expert_capacity, const TensorView& row_of,
                  const TensorView& splits, const TensorView& dropped);
//   The expert-parallel send plan (moe_engine/permute.hpp send_plan); splits = C each, dropped optional.
void send_plan(const TensorView& indices, const TensorView& row_of_expert, int64_t local_experts, int64_t capacity,
               const TensorView& row_send, const TensorView& ids, const TensorView& splits, const TensorView& dropped);
//   x_sorted[row(t, j)] = x[t]; probs_sorted[row(t, j)] = probs[t, j] (both or neither defined).
void permute(const TensorView& x, const TensorView& probs, const TensorView& row_of, const GroupLayout& groups,
             const TensorView& x_sorted, const TensorView& probs_sorted);
//   y[t] = sum_j p[t, j] out[row(t, j)] (p = 1 undefined; dropped: no term), float32 additions in j
//   order; with sorted_probs defined also gathered[t, j] = sorted_probs[row(t, j)] (0 dropped).
void unpermute(const TensorView& out, const TensorView& probs, const TensorView& row_of, const GroupLayout& groups,
               const TensorView& y, const TensorView& sorted_probs, const TensorView& gathered);
//   d_out[row(t, j)] = p[t, j] dy[t] (p = 1 undefined); d_probs (optional) [t, j] = <dy[t], out[row(t, j)]>
//   in the order of common/permute_order.hpp (0 dropped).
void unpermute_backward(const TensorView& dy, const TensorView& out, const TensorView& probs,
                        const TensorView& row_of, const GroupLayout& groups, const TensorView& d_out,
                        const TensorView& d_probs);

// FP8 block scaling (moe_engine/fp8.hpp; fp8.cpp): the quantizers and the dequantizer give the
// bytes and scales the CUDA kernels give (common/fp8_math.hpp); the GEMMs sum each 128-long block
// of the contraction in float32 and add it, times the two blocks' scales, into a float32
// accumulator.
void quantize_fp8(const TensorView& x, const GroupLayout& groups, const Fp8Rows& rows, const Fp8Columns& columns,
                  const Fp8Recipe& recipe);
void quantize_fp8_weight(const GroupedParam& weight, const Fp8Weight& out, const Fp8Recipe& recipe);
void dequantize_fp8(const Fp8Rows& rows, const GroupLayout& groups, const TensorView& out);
void grouped_linear_forward(const Fp8Rows& x, const Fp8Weight& weight, const GroupLayout& groups,
                            const TensorView& y, const BiasEpilogue& bias);
void grouped_linear_dgrad(const Fp8Rows& dy, const Fp8Weight& weight, const GroupLayout& groups,
                          const TensorView& dx);
void grouped_linear_wgrad(const Fp8Columns& dy, const Fp8Columns& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode);

// The router (router.cpp; docs/design.md section 13). The choice and the probabilities are the CUDA
// backend's bits for the same logits (common/router_math.hpp); sums over tokens run in token order.
// router_backward writes dL/dlogits into d_logits (the workspace, [T, E] in the accumulator type).
void router_forward(const TensorView& x, const TensorView& weight, const TensorView& expert_bias,
                    const RouterOutputs& out, const RouterSpec& spec);
void router_backward(const RouterOutputGrads& d_out, const TensorView& x, const TensorView& weight,
                     const TensorView& logits, const TensorView& indices, const TensorView& aux_loss_counts,
                     const RouterGrads& grads, const RouterSpec& spec, const TensorView& d_logits);
void router_update_expert_bias(const TensorView& expert_bias, const TensorView& counts, float rate);

}  // namespace moe::cpu
