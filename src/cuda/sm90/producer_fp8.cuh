// The producer of the Hopper FP8 grouped GEMM (block scaling): one thread of warpgroup 0 fills the
// ring's stages with TMA loads, one stage per 128-wide k step. Both operands are K-major E4M3
// (FP8 wgmma has no transposed operands), so the three GEMMs take two shapes:
//   M-grouped (forward, and dgrad with the weight's transposed copy):
//     A = the group's token rows [T, K] through a ragged map (zero past the group's end),
//     B = W_g rows [N, K] (3-D map over [G, N, K]);
//   K-grouped (wgrad): A = dY^T [N, C], B = X^T [K, C], the columns copies in which every group's
//     tokens start at a multiple of 128 (offsets = the copies' column offsets) and end in zeros, so
//     plain maps load whole steps.
// A second warp of the producer warpgroup (load_scales) copies each step's scales into the stage
// with cp.async; each lane's arrival on the stage's full barrier goes out once its copies have
// landed: the math threads then read them from shared memory (mainloop_fp8.cuh).
#pragma once

#include <cstdint>

#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/ptx/sync.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/sm90/config.hpp"
#include "cuda/sm90/params.hpp"
#include "cuda/sm90/ring.cuh"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

template <Form kForm, class Pipe>
struct ProducerFp8 {
  using Cfg = typename Pipe::Cfg;
  static constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kBK = Cfg::kBlockK;
  static constexpr bool kKGrouped = kForm == Form::kWgrad;
  // What lands in each block per live step: A and all of B (its half and the peer's, or both).
  static constexpr uint32_t kStepBytes = Cfg::kABytes + Cfg::kBBytes;
  static constexpr bool kScaleWarp = true;

  const CUtensorMap& map_a;
  const CUtensorMap& map_b;
  const GemmParams& p;
  const SharedStorage<Pipe>& smem;

  __device__ __forceinline__ void load(const Tile t, RingState<Pipe::kStages>& ring) const {
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      ptx::mbarrier_wait(&smem.empty[ring.stage], ring.phase ^ 1u);
      ptx::mbarrier_arrive_expect_tx(&smem.full[ring.stage], t.live ? kStepBytes : 0u);
      if (t.live) load_step(t, kb, ring.stage);
      ring.advance();
    }
  }

  // The scale warp's steps of tile t (the producer's steps, in the same ring): per step the lanes
  // copy A's kBM row scales and, for wgrad, B's kBN column scales, or (M-grouped) the scales of the
  // one or two 128-row weight blocks the tile's columns fall in; rows and columns past the operands
  // get scale 0 (their data are zeros). The copies are cp.async; each lane arrives on the stage's
  // full barrier once its copies have landed. K-grouped (wgrad): the arrival goes out by itself
  // (cp.async.mbarrier.arrive), so the warp never waits for its loads and runs as far ahead as the
  // ring lets it: waiting for each step's copies held it to one tile in flight, a load's latency a
  // tile, which the small batch's one-step tiles do not hide. M-grouped: one commit group per step,
  // waited for after issuing the next step's copies (two steps in flight), measured ~2% faster on
  // the forward-form GEMMs than arriving by itself (docs/performance-log.md, 2026-12-01).
  __device__ __forceinline__ void load_scales(const Tile t, RingState<Pipe::kStages>& ring, uint32_t lane) const {
    constexpr int kScaleBlock = Cfg::kScaleBlock;
    int landing = -1;  // M-grouped: the stage whose copies are in flight, not yet arrived for
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      ptx::mbarrier_wait(&smem.empty[ring.stage], ring.phase ^ 1u);
      if (t.live) {
        const uint32_t dst = smem.stage_scales(ring.stage);
        const int64_t a_block = kKGrouped ? (t.row_begin / kScaleBlock) + kb : kb;
#pragma unroll
        for (int i = 0; i < kBM / 32; ++i) {
          const int32_t m = t.m0 + int32_t(lane) + 32 * i;
          const bool ok = m < (kKGrouped ? p.m_out : t.rows);
          const int64_t row = kKGrouped ? m : t.row_begin + m;
          ptx::cp_async_4(dst + 4 * (lane + 32 * i), ok ? p.a_scales + a_block * p.a_scale_stride + row : p.a_scales,
                          ok);
        }
        if constexpr (kKGrouped) {
#pragma unroll
          for (int i = 0; i < kBN / 32; ++i) {
            const int32_t n = t.n0 + int32_t(lane) + 32 * i;
            const bool ok = n < p.n_out;
            ptx::cp_async_4(dst + 4 * (kBM + lane + 32 * i), ok ? p.b_scales + a_block * p.n_out + n : p.b_scales,
                            ok);
          }
        } else if (lane < 2) {
          // Blocks n0 / 128 and the next one (a tile of 192 columns may straddle two); a block
          // past the weight's rows holds only columns past N.
          const int32_t block = t.n0 / kScaleBlock + int32_t(lane);
          const bool ok = block < p.b_scale_rows;
          ptx::cp_async_4(dst + 4 * (kBM + lane),
                          ok ? p.b_scales + (int64_t(t.group) * p.b_scale_rows + block) * p.b_scale_cols + kb
                             : p.b_scales,
                          ok);
        }
      }
      if constexpr (kKGrouped) {
        ptx::cp_async_mbarrier_arrive(ptx::smem_address(&smem.full[ring.stage]));
      } else {
        ptx::cp_async_commit_group();
        if (landing >= 0) {
          ptx::cp_async_wait_group<1>();
          ptx::mbarrier_arrive(&smem.full[landing]);
        }
        landing = ring.stage;
      }
      ring.advance();
    }
    if (landing >= 0) {
      ptx::cp_async_wait_group<0>();
      ptx::mbarrier_arrive(&smem.full[landing]);
    }
  }

  __device__ __forceinline__ void load_step(const Tile& t, int kb, int stage) const {
    uint64_t* bar = &smem.full[stage];
    const uint16_t mask = (1u << Cfg::kClusterSize) - 1u;
    // B in two halves of kBN / 2 rows: with multicast this block loads half `half` into both blocks.
    auto load_b_half = [&](int half, bool multicast) {
      uint8_t* dst = smem.stage_b(stage) + half * (Cfg::kBBytes / 2);
      const int32_t n = t.n0 + half * (kBN / 2);
      if constexpr (kKGrouped) {
        const int32_t col = int32_t(t.row_begin) + kb * kBK;
        if (multicast) ptx::tma_load_3d_multicast(dst, &map_b, bar, mask, col, n, 0);
        else ptx::tma_load_3d(dst, &map_b, bar, col, n, 0);
      } else {
        if (multicast) ptx::tma_load_3d_multicast(dst, &map_b, bar, mask, kb * kBK, n, t.group);
        else ptx::tma_load_3d(dst, &map_b, bar, kb * kBK, n, t.group);
      }
    };
    if constexpr (kKGrouped) {
      // This step's 128 tokens in the columns copies.
      ptx::tma_load_3d(smem.stage_a(stage), &map_a, bar, int32_t(t.row_begin) + kb * kBK, t.m0, 0);
    } else {
      ptx::tma_load_4d(smem.stage_a(stage), &map_a, bar, kb * kBK, ragged_row(t, t.m0), ragged_end(t),
                       int32_t(Cfg::kRaggedRows));
    }
    if (__builtin_expect(t.multicast && p.multicast, 1)) {
      load_b_half(int(ptx::cluster_rank()), true);
    } else {
      load_b_half(0, false);
      load_b_half(1, false);
    }
  }
};

}  // namespace moe::cuda::sm90
