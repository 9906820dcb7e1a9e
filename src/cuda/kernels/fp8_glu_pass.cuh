// What the FP8 MLP's GLU passes (fp8_glu_forward.cu, fp8_glu_backward.cu) share: their warp-per-item
// launch, the alignment rule of their vector accesses, where a lane finds a feature's gate and
// linear values among the 8 columns of h it holds, and their parameters' common fields.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/glu_math.hpp"
#include "cuda/backend.hpp"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/resident_blocks.cuh"

namespace moe::cuda::glu_pass {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kFeatures = 4 * 32;  // act's scale block: 128 features
static_assert(kFeatures == kFp8Block);

// Where a lane's gate and linear values lie in the two 128-column blocks of h it loads.
enum class GluLanes {
  kFour,     // pairs, or blocks of 4: 4 features a block, their gate and linear columns in the lane
  kPartner,  // blocks of s, 8 <= s <= 64: 8 gate or 8 linear columns, the other 8 in lane m ^ (s / 8)
  kRuns,     // blocks of s, s % 8 == 0: block 0 the gate run of 8 features, block 1 their linear run
  kNone,     // none of these: the pass declines
};

// The lanes' case of a GLU layout whose runs are s columns long (1: pairs).
inline GluLanes glu_lanes(int64_t s) {
  if (s == 1 || s == 4) return GluLanes::kFour;
  if (s % 8 == 0 && 64 % s == 0) return GluLanes::kPartner;
  if (s % 8 == 0) return GluLanes::kRuns;
  return GluLanes::kNone;
}

// A kernel that takes one item per warp: blocks at most as many as are resident at once (from the
// device only, never the routing), so that no block waits for a second wave.
template <auto kKernel, class Params>
inline void launch_warp_items(const Params& p, int64_t items, int device, Stream stream, const char* name) {
  const int resident = resident_blocks<kKernel>(device, kThreads, 0, name);
  const int64_t wanted = (items + kWarps - 1) / kWarps;
  const unsigned blocks = unsigned(std::max<int64_t>(1, std::min<int64_t>(wanted, resident)));
  kKernel<<<blocks, kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH(name);
}

// Vector access to rows of t: its data `bytes`-aligned and its row pitch a multiple of `bytes`.
inline bool rows_aligned(const TensorView& t, size_t bytes) {
  return is_aligned(t.data(), bytes) && (t.stride(0) * int64_t(dtype_size(t.dtype()))) % int64_t(bytes) == 0;
}

// The fields every pass's parameters carry: the routing, F, the layout's run length s (1: pairs),
// the GLU.
template <class Params>
void set_glu_fields(Params& p, const GroupLayout& groups, int64_t F, int64_t s, const GluSpec& spec) {
  p.offsets = groups.offsets().data_as<int64_t>();
  p.num_groups = groups.num_groups();
  p.ffn = int32_t(F);
  p.block = int32_t(s);
  p.math = detail::GluMath<float>::from(spec);
}

// The kept h's FP8 rows and their scales, as the passes read or write them.
template <class Params>
void set_h_rows(Params& p, const Fp8Rows& h) {
  p.h_data = static_cast<decltype(p.h_data)>(h.data.data());
  p.h_data_ld = h.data.stride(0);
  p.h_scales = h.scales.data_as<float>();
  p.h_scales_ld = h.scales.stride(0);
}

}  // namespace moe::cuda::glu_pass
