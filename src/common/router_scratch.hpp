// The router ops' workspace buffers (docs/design.md section 13): src/ops/router.cpp carves them
// out of the caller's workspace (its size functions count the same buffers), the CUDA backend
// uses them.
#pragma once

#include "moe_engine/tensor.hpp"

namespace moe::detail {

// router_forward: one row of partial sums per kRouterChunkTokens tokens, added in order at the end.
struct RouterForwardScratch {
  TensorView scores;        // [chunks, E] float32: the load-balancing loss's scores, summed
  TensorView counts;        // [chunks, E] int32: the routing's counts
  TensorView aux_counts;    // [chunks, E] int32: the load-balancing loss's own top-k counts
  TensorView z_terms;       // [chunks] float32: sum of logsumexp^2
  TensorView gemm_offsets;  // [2] int64: {0, T}, the logits GEMM's one group (written there)
};

// router_backward: dL/dlogits, then the two products dx = d_logits W and dW = d_logits^T x.
// On Hopper they run on the bf16 grouped GEMM over d_logits split exactly into three bf16 parts;
// elsewhere on SIMT kernels, whose weight gradient sums token slices into partial sums. The SIMT
// partial sums share their memory with the GEMM's buffers: a call uses one of them at a time, in
// stream order.
struct RouterBackwardScratch {
  TensorView d_logits;        // [T, E] float32 (float64 for float64 x on the CPU)
  TensorView wgrad_partials;  // [S, E, H] float32: the SIMT weight gradient's S > 1 token slices
  // The grouped GEMM's (bfloat16 x and H a multiple of 8; undefined otherwise):
  TensorView d_split;         // [T, 3E] bfloat16, rows 16-byte aligned: [hi | mid | lo], whose sum
                              // is d_logits exactly
  TensorView weight_stack;    // [3E, H] bfloat16: [W; W; W]
  TensorView gemm_partials;   // [S', 3E, H] float32: the weight gradient's S' token slices
  TensorView gemm_offsets;    // [S' + 3] int64: {0, T} (dx's one group), then the slices' offsets
};

}  // namespace moe::detail
