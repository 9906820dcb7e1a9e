// The producer of the Hopper grouped GEMM: one thread of warpgroup 0 fills the ring's stages with
// TMA loads, one stage per k step of every tile its block works on (ring.cuh). Per form:
//   forward: A = X rows (K-major), B = W_g [N, K] rows (K-major);
//   dgrad:   A = dY rows (K-major), B = W_g [N, K] read MN-major (64-wide panels);
//   wgrad:   A = dY^T and B = X, both MN-major panels over the group's rows (the contraction).
// Token-indexed operands use ragged maps (tensor_maps.hpp): TMA zero-fills rows past the group.
#pragma once

#include <cstdint>

#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/sync.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/sm90/config.hpp"
#include "cuda/sm90/params.hpp"
#include "cuda/sm90/ring.cuh"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

template <Form kForm, class Pipe>
struct Producer {
  using Cfg = typename Pipe::Cfg;
  static constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kBK = Cfg::kBlockK;
  static constexpr bool kScaleWarp = false;  // no operand scales

  const CUtensorMap& map_a;
  const CUtensorMap& map_b;
  const GemmParams& p;
  const SharedStorage<Pipe>& smem;

  // Every k step of tile t: wait for the stage to be free in both blocks, announce its bytes,
  // load it. (t by value: by reference the compiler laid out the multicast branch differently.)
  __device__ __forceinline__ void load(const Tile t, RingState<Pipe::kStages>& ring) const {
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      ptx::mbarrier_wait(&smem.empty[ring.stage], ring.phase ^ 1u);
      // A ghost expects nothing: its arrival alone completes the phase.
      ptx::mbarrier_arrive_expect_tx(&smem.full[ring.stage], t.live ? Cfg::kStageBytes : 0u);
      if (t.live) load_step(t, kb, ring.stage);
      ring.advance();
    }
  }

  // The loads of k step kb into stage `stage`: A, then B, multicast when the pair shares it.
  __device__ __forceinline__ void load_step(const Tile& t, int kb, int stage) const {
    const int32_t k0 = kb * kBK;
    uint64_t* bar = &smem.full[stage];
    // Forward/dgrad weights: the packed map at group t.group, or expert t.group's own map.
    const CUtensorMap* mb = p.b_maps ? p.b_maps + t.group : &map_b;
    const int32_t gb = p.b_maps ? 0 : t.group;
    // B comes in two halves of kBN / 2 columns: with multicast this block loads half `half` into
    // both blocks (the peer loads the other), otherwise both halves locally.
    auto load_b_half = [&](int half, bool multicast) {
      uint8_t* dst = smem.stage_b(stage) + half * (Cfg::kBBytes / 2);
      const int32_t n = t.n0 + half * (kBN / 2);
      const uint16_t mask = (1u << Config::kClusterSize) - 1u;
      if constexpr (kForm == Form::kForward) {
        if (multicast) ptx::tma_load_3d_multicast(dst, mb, bar, mask, k0, n, gb);
        else ptx::tma_load_3d(dst, mb, bar, k0, n, gb);
      } else {
#pragma unroll
        for (int panel = 0; panel < kBN / 2 / 64; ++panel) {
          uint8_t* pdst = dst + panel * Config::kPanelBytes;
          const int32_t pn = n + 64 * panel;
          if constexpr (kForm == Form::kWgrad) {
            if (multicast)
              ptx::tma_load_4d_multicast(pdst, &map_b, bar, mask, pn, ragged_row(t, k0), ragged_end(t),
                                         int32_t(Config::kRaggedRows));
            else
              ptx::tma_load_4d(pdst, &map_b, bar, pn, ragged_row(t, k0), ragged_end(t),
                               int32_t(Config::kRaggedRows));
          } else {
            if (multicast) ptx::tma_load_3d_multicast(pdst, mb, bar, mask, pn, k0, gb);
            else ptx::tma_load_3d(pdst, mb, bar, pn, k0, gb);
          }
        }
      }
    };
    if constexpr (kForm == Form::kWgrad) {
      // A = dY rows [k0, k0 + 64) of the group, columns m0..m0+127 as two 64-wide panels.
      for (int panel = 0; panel < kBM / 64; ++panel)
        ptx::tma_load_4d(smem.stage_a(stage) + panel * Config::kPanelBytes, &map_a, bar, t.m0 + 64 * panel,
                         ragged_row(t, k0), ragged_end(t), int32_t(Config::kRaggedRows));
    } else {
      // A = rows m0..m0+127 of the group (K-major), zero past the group's end.
      ptx::tma_load_4d(smem.stage_a(stage), &map_a, bar, k0, ragged_row(t, t.m0), ragged_end(t),
                       int32_t(Config::kRaggedRows));
    }
    // Most pairs share B. (The hint also keeps the branch's layout as it was in the kernel.)
    if (__builtin_expect(t.multicast && p.multicast, 1)) {
      load_b_half(int(ptx::cluster_rank()), true);
    } else {
      load_b_half(0, false);
      load_b_half(1, false);
    }
  }
};

}  // namespace moe::cuda::sm90
