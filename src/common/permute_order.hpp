// The fixed orders of the permute ops, shared by the CPU backend and the CUDA kernels so that both
// give the same bits (docs/design.md section 14), and the chunking of the CUDA plan, which sizes
// its workspace.
#pragma once

#include <cstdint>

namespace moe::detail {

// permute_plan on CUDA cuts the T k assignments, in token order, into chunks of this many: one
// block counts each chunk's assignments per expert, and later ranks them.
inline constexpr int64_t kPlanChunk = 1024;
inline constexpr int64_t plan_chunks(int64_t assignments) {
  return (assignments + kPlanChunk - 1) / kPlanChunk;
}

// The order of unpermute_backward's row dot product d_probs[t, j] = <dy[t], out[row]>, over n
// elements of e bytes each (float32 products, each rounded, then added):
//   1. lane l of kDotLanes takes the 16-byte vectors v = l, l + kDotLanes, l + 2 kDotLanes, ...
//   (the
//      elements [v V, v V + V), V = 16 / e, the last one cut at n) and sums their products in
//      element order, from +0;
//   2. within each warp of kDotWarpLanes lanes, s_l = s_l + s_(l xor m) for m = 16, 8, 4, 2, 1
//   (every
//      lane of a warp ends with the same sum);
//   3. the warps' sums are added in warp order, from +0.
// The CUDA kernel's threads are the lanes; the CPU backend replays the same additions.
inline constexpr int kDotLanes = 256;
inline constexpr int kDotWarpLanes = 32;

}  // namespace moe::detail
