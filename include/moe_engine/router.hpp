// The MoE router (docs/design.md section 13): logits = x W^T in float32, scores (softmax or
// sigmoid), the top-k choice per token (optional expert bias and group-limited routing), the
// probabilities, per-expert token counts, the load-balancing loss and the z-loss; its backward; and
// the update of the expert bias (auxiliary-loss-free balancing).
//   x [T, H] (bfloat16, float16, float32; float64 on the CPU), weight [E, H] in x's dtype.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moe_engine/dtype.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/router_spec.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

namespace moe {

// Scratch router_forward needs for T tokens and E experts (per-64-token partial sums of the counts
// and losses on CUDA; checked on every device, so one program runs on both).
MOE_API size_t router_forward_workspace_size(int64_t tokens, int64_t num_experts);
// Scratch router_backward needs for T tokens, E experts and H hidden: dL/dlogits, [T, E] in acc
// (float32; float64 for float64 x), and on CUDA the weight gradient's partial sums over token
// slices ([S, E, H] float32, S = clamp(T / 1024, 1, 8); none for S = 1). Checked on every device.
MOE_API size_t router_backward_workspace_size(int64_t tokens, int64_t num_experts, int64_t hidden, DType dtype);

// Routes every one of the T tokens of x. expert_bias [E] acc (optional) is added to the scores for
// the choice only (it never enters probs). Writes `out` (RouterOutputs lists what is required).
MOE_API void router_forward(const TensorView& x, const TensorView& weight,
                            const TensorView& expert_bias, const RouterOutputs& out,
                            const RouterSpec& spec, const ExecContext& ctx = {});

// From the gradients of router_forward's outputs: dx = dL/dlogits W, dweight (per its mode) =
// dL/dlogits^T x. Reads forward's x, weight, logits, indices and, when d_aux_loss is given,
// aux_loss_counts. Indices must be router_forward's: an entry outside [0, E) throws on the CPU and
// is skipped on CUDA.
MOE_API void router_backward(const RouterOutputGrads& d_out, const TensorView& x,
                             const TensorView& weight, const TensorView& logits,
                             const TensorView& indices, const TensorView& aux_loss_counts,
                             const RouterGrads& grads, const RouterSpec& spec,
                             const ExecContext& ctx = {});

// Auxiliary-loss-free balancing (DeepSeek-V3): expert_bias[e] += rate * sign(mean(counts) -
// counts[e]), in place, on the device (no host sync). expert_bias [E] acc; counts [E] int64 (e.g.
// forward's counts, summed over the micro-batches of a step). The sign is exact (integer
// arithmetic).
MOE_API void router_update_expert_bias(const TensorView& expert_bias, const TensorView& counts,
                                       float rate, const ExecContext& ctx = {});

}  // namespace moe
