// The producer of the Hopper FP8 grouped GEMM (block scaling): one thread of warpgroup 0 fills the
// ring's stages with TMA loads, one stage per 128-wide k step. Both operands are K-major E4M3
// (FP8 wgmma has no transposed operands), so the three GEMMs take two shapes:
//   M-grouped (forward, and dgrad with the weight's transposed copy):
//     A = the group's token rows [T, K] through a ragged map (zero past the group's end),
//     B = W_g rows [N, K] (3-D map over [G, N, K]);
//   K-grouped (wgrad): A = dY^T [N, C], B = X^T [K, C], the columns copies in which every group's
//     tokens start at a multiple of 128 (offsets = the copies' column offsets) and end in zeros, so
//     plain maps load whole steps.
// A second warp of the producer warpgroup (load_scales) stores each step's scales into the stage,
// from global memory, and arrives on the stage's full barrier as its second arrival: the math
// threads then read them from shared memory (mainloop_fp8.cuh). Its loads for a step are issued
// before it waits for the stage to be free, and one step ahead within a tile.
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
struct ProducerFp8 {
  using Cfg = typename Pipe::Cfg;
  static constexpr int kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kBK = Cfg::kBlockK;
  static constexpr bool kKGrouped = kForm == Form::kWgrad;
  // What lands in each block per live step: A and all of B (its half and the peer's, or both).
  static constexpr uint32_t kStepBytes = Cfg::kABytes + Cfg::kBBytes;
  static constexpr bool kScaleWarp = true;
  static constexpr int kPerLane = kBM / 32;  // row (and column) scales per lane

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

  // One lane's scales of step kb of tile t: rows lane + 32 i of A, and for wgrad columns
  // lane + 32 i of B, or (M-grouped, lane 0) the weight's block scale in b[0]. Rows and columns
  // past the operands take scale 0 (their data are zeros).
  struct StepScales {
    float a[kPerLane], b[kPerLane];
  };
  __device__ __forceinline__ StepScales fetch_scales(const Tile& t, int kb, uint32_t lane) const {
    StepScales s;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int32_t m = t.m0 + int32_t(lane) + 32 * i, n = t.n0 + int32_t(lane) + 32 * i;
      if constexpr (kKGrouped) {
        const int64_t block = (t.row_begin >> 7) + kb;
        s.a[i] = m < p.m_out ? __ldg(p.a_scales + block * p.a_scale_stride + m) : 0.f;
        s.b[i] = n < p.n_out ? __ldg(p.b_scales + block * p.n_out + n) : 0.f;
      } else {
        s.a[i] = m < t.rows ? __ldg(p.a_scales + int64_t(kb) * p.a_scale_stride + t.row_begin + m) : 0.f;
        s.b[i] = 0.f;
      }
    }
    if constexpr (!kKGrouped) {
      if (lane == 0)
        s.b[0] = __ldg(p.b_scales + (int64_t(t.group) * p.b_scale_rows + t.n0 / kBN) * p.b_scale_cols + kb);
    }
    return s;
  }

  // The scale warp's steps of tile t (the producer's steps, in the same ring).
  __device__ __forceinline__ void load_scales(const Tile t, RingState<Pipe::kStages>& ring, uint32_t lane) const {
    StepScales next = t.live && t.k_blocks > 0 ? fetch_scales(t, 0, lane) : StepScales{};
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      const StepScales now = next;
      if (t.live && kb + 1 < t.k_blocks) next = fetch_scales(t, kb + 1, lane);
      ptx::mbarrier_wait(&smem.empty[ring.stage], ring.phase ^ 1u);
      if (t.live) {
        const uint32_t dst = smem.stage_scales(ring.stage);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          ptx::st_shared_b32(dst + 4 * (lane + 32 * i), __float_as_uint(now.a[i]));
          if (kKGrouped || (i == 0 && lane == 0))
            ptx::st_shared_b32(dst + 4 * (kBM + lane + 32 * i), __float_as_uint(now.b[i]));
        }
      }
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&smem.full[ring.stage]);
      ring.advance();
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
