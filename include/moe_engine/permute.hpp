// Permute and unpermute (docs/design.md section 14): a router's choice of k experts for each of T
// tokens ([T, k] indices) turns the token matrix [T, H] into the expert-sorted buffer [R, H] that
// the expert ops take, and the experts' outputs back into [T, H], weighted by the router probs. The
// routing stays on the device: no host sync, fixed launch shapes (CUDA-graph safe), deterministic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "moe_engine/export.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

namespace moe {

// The assignments each expert keeps with a capacity factor (Megatron's get_capacity over the T k
// assignments): C = ceil(T k / E * capacity_factor), computed in double as Megatron does.
// capacity_factor must be finite and > 0.
MOE_API int64_t expert_capacity(int64_t tokens, int64_t topk, int64_t num_experts,
                                double capacity_factor);

// The rows R of the expert-sorted buffer: T k, or min(T k, E C) with a capacity factor.
MOE_API int64_t permuted_rows(int64_t tokens, int64_t topk, int64_t num_experts,
                              std::optional<double> capacity_factor = std::nullopt);

// The scratch permute_plan needs on CUDA (per-chunk counts of each expert), from static shapes;
// the CPU backend needs none.
MOE_API size_t permute_plan_workspace_size(int64_t tokens, int64_t topk, int64_t num_experts);

struct PermutePlanOutputs {
  TensorView row_of;   // [T, k] int32, required: the row of assignment (t, j) in the sorted buffer,
                       // -1 if dropped
  TensorView splits;   // [E] int64, required: the assignments each expert keeps
  TensorView offsets;  // [E + 1] int64, required: the experts' group layout over the sorted buffer
  TensorView dropped;  // [E] int64, optional: the assignments each expert dropped for its capacity
};

// The routing of indices [T, k] (int32 or int64, expert ids in [0, E), E = splits' size): token t's
// j-th choice e goes to row offsets[e] + (its rank among e's assignments in token order, then j
// order), so each expert's rows keep the tokens' order. With a capacity factor each expert keeps
// its first C = expert_capacity(T, k, E, factor) assignments; the rest get row -1 and count in
// `dropped`. Returns the experts' group layout (capacity R = permuted_rows(T, k, E, factor)),
// computed by GroupLayout::compute from the splits.
// - CPU: synchronously; an index outside [0, E) throws kInvalidArgument.
// - CUDA: four kernels of fixed shape on ctx.stream, scratch from ctx.workspace
//   (permute_plan_workspace_size). An index outside [0, E) is dropped (row -1) and reported through
//   `errors` (required on CUDA), which the host checks outside capture.
MOE_API GroupLayout permute_plan(const TensorView& indices, const PermutePlanOutputs& outputs,
                                 std::optional<double> capacity_factor, DeviceErrorFlag* errors,
                                 const ExecContext& ctx = {});

// Expert parallelism with a fixed capacity (docs/design.md section 16): the send buffer of one rank,
// [P C, H] with destination rank d's rows at [d C, (d + 1) C) (rank d holds the experts
// [d L, (d + 1) L), E = P L).
struct SendPlanOutputs {
  TensorView row_send;  // [T, k] int32, required: the send row of assignment (t, j), -1 if not sent
  TensorView ids;       // [P C, 1] int32, required: each send row's local expert at its destination,
                        // L for a row nothing is sent in (the receiver plans on them as indices)
  TensorView splits;    // [P] int64, required: C each (the send buffer's groups)
  TensorView offsets;   // [P + 1] int64, required: their group layout, d C
  TensorView dropped;   // [P] int64, optional: the assignments past the C rows of each destination
};

// The rows a source may send one destination: min(T k, ceil(T k / P * factor)) (factor > 0, finite).
MOE_API int64_t pair_capacity(int64_t tokens, int64_t topk, int64_t ranks, double factor);

// The send plan of indices [T, k] (int32 or int64, expert ids in [0, P L)): destination d = e / L
// gets its first C assignments in token order (then j order) at rows d C + 0, 1, ...; the rest
// are not sent (row -1) and count in `dropped`. With row_of_expert ([T, k] int32, the layer's own
// capacity plan from permute_plan) an assignment whose row there is -1 is not sent either, nor
// counted. Deterministic (integer work); no workspace. Returns the send buffer's group layout
// (capacity P C). CPU: an index outside [0, P L) throws kInvalidArgument. CUDA: one kernel of P
// blocks on ctx.stream; an index outside [0, P L) is not sent and reported through `errors`
// (required on CUDA).
MOE_API GroupLayout send_plan(const TensorView& indices, const TensorView& row_of_expert, int64_t local_experts,
                              int64_t capacity, const SendPlanOutputs& outputs, DeviceErrorFlag* errors,
                              const ExecContext& ctx = {});

// The four ops take row_of from permute_plan and its group layout `groups` (capacity R); x and y
// are [T, H], the sorted buffers [R, H] of the same dtype; probs [T, k] and the sorted probs [R]
// float32 (float64 too on the CPU). Only the routed rows [0, offsets[E]) of a sorted buffer are
// read or written. A row_of entry neither -1 nor a routed row throws on the CPU; on CUDA it is
// skipped and reported through the group layout's error flag.

// x_sorted[row(t, j)] = x[t]: a copy, bit for bit. With probs (then probs_sorted too):
// probs_sorted[row(t, j)] = probs[t, j], the experts' p.
MOE_API void permute(const TensorView& x, const TensorView& probs, const TensorView& row_of,
                     const GroupLayout& groups, const TensorView& x_sorted,
                     const TensorView& probs_sorted, const ExecContext& ctx = {});

// y[t] = sum_j p[t, j] out[row(t, j)] (p = 1 without probs), products and sums in float32 with j in
// order, rounded once; a dropped assignment adds nothing (a token with all k dropped gets zeros).
MOE_API void unpermute(const TensorView& out, const TensorView& probs, const TensorView& row_of,
                       const GroupLayout& groups, const TensorView& y, const ExecContext& ctx = {});

// permute's backward: dx[t] = sum_j d_sorted[row(t, j)] (unpermute without probs), and with
// d_probs_sorted (then d_probs too) d_probs[t, j] = d_probs_sorted[row(t, j)] (0 if dropped).
MOE_API void permute_backward(const TensorView& d_sorted, const TensorView& d_probs_sorted,
                              const TensorView& row_of, const GroupLayout& groups,
                              const TensorView& dx, const TensorView& d_probs,
                              const ExecContext& ctx = {});

// unpermute's backward: d_out[row(t, j)] = p[t, j] dy[t] (p = 1 without probs; rounded once), and
// with d_probs (needs probs and out) d_probs[t, j] = <dy[t], out[row(t, j)]> in float32, in a fixed
// order (0 if dropped).
MOE_API void unpermute_backward(const TensorView& dy, const TensorView& out,
                                const TensorView& probs, const TensorView& row_of,
                                const GroupLayout& groups, const TensorView& d_out,
                                const TensorView& d_probs, const ExecContext& ctx = {});

}  // namespace moe
