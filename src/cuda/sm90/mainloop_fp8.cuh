// The mainloop (consumer) of the Hopper FP8 grouped GEMM with block scaling: each math warpgroup
// multiplies its 64 rows of the 128 x kBN tile, one 128-wide k step (one scale block) per ring
// stage. The tensor core sums a step into a partial tile (4 wgmma of k32, the first overwriting);
// the step's scales then promote it into the fp32 running sum, acc += partial * scale: FP8 wgmma
// keeps only about 14 bits of its sum, so no sum runs longer than 128 elements inside it.
//   M-grouped: scale = sa[row] * sb, sa the row's scale (M-major: the tile's rows are adjacent),
//              sb the scale of the weight's 128 x 128 block holding the column;
//   K-grouped: scale = sa[row] * sb[col], the step's row scales of dY^T and column scales of X^T.
// The two math warpgroups take turns on the tensor core: each issues its step only after the
// other has issued its own previous one (two named barriers pass the turn). Their wgmma then run
// one after the other, and each promotes while the other's runs; issued together, they finished
// together and both promoted while the tensor core idled. Ping-pong (64-row tiles, one warpgroup
// each: config.hpp's kStageConsumers == 1) takes turns a tile at a time instead (the kernel's
// PingPongTurns), and hands the turn on once its last step is issued, so that the other's first
// wgmma runs under this one's last promotion.
// The producer warpgroup's scale warp has put each step's scales into its stage.
// Same interface as Mainloop16Bit (mainloop_16bit.cuh).
#pragma once

#include <cstdint>

#include "cuda/ptx/sync.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/sm90/config.hpp"
#include "cuda/sm90/params.hpp"
#include "cuda/sm90/ring.cuh"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

template <Form kForm, class Pipe>
struct MainloopFp8 {
  using Cfg = typename Pipe::Cfg;
  static constexpr int kBN = Cfg::kBlockN, kBK = Cfg::kBlockK;
  static constexpr int kAccRegs = kBN / 2;  // 64 x kBN f32 over 128 threads
  static constexpr bool kKGrouped = kForm == Form::kWgrad;
  using Accumulators = float[kAccRegs];
  using Wgmma = ptx::WgmmaFp8SS<kBN>;
  static constexpr int kK32Steps = kBK / 32;
  // Ping-pong: the warpgroup owns the tile; the kernel passes the turns (no per-step turns here).
  static constexpr bool kOwnTiles = Cfg::kStageConsumers == 1;

  const SharedStorage<Pipe>& smem;
  const GemmParams& p;
  const uint32_t lane;
  const uint32_t math;      // which math warpgroup: 64 rows of the tile, and the turn it waits on
  const uint32_t stages;    // shared address of the ring's first stage, computed once
  // The wgmma descriptors of stage 0's A (this warpgroup's 64 rows) and B: a step's are these
  // advanced by the stage's offset, one add each instead of building them per k32 step.
  const uint64_t desc_a, desc_b;
  const uint32_t row;  // this thread's first accumulator row within the tile (and row + 8)

  __device__ __forceinline__ MainloopFp8(const SharedStorage<Pipe>& smem, const GemmParams& p, uint32_t math,
                                         uint32_t lane)
      : smem(smem),
        p(p),
        lane(lane),
        math(math),
        stages(ptx::smem_address(smem.stage_a(0))),
        desc_a(ptx::smem_descriptor(stages + tile_slab<Cfg>(math) * 64 * 128, 0, 1024)),
        desc_b(ptx::smem_descriptor(stages + Cfg::kABytes, 0, 1024)),
        row(64 * tile_slab<Cfg>(math) + 16 * ((threadIdx.x / 32) % 4) + lane / 4) {}

  __device__ __forceinline__ uint32_t stage_address(int stage) const { return stages + stage * Cfg::kStageBytes; }

  // Issues step kb's four k32 wgmma of the stage into `partial` (the first one overwrites it).
  __device__ __forceinline__ void issue(float (&partial)[kAccRegs], int stage) const {
    const uint64_t da = ptx::descriptor_advance(desc_a, stage * Cfg::kStageBytes);
    const uint64_t db = ptx::descriptor_advance(desc_b, stage * Cfg::kStageBytes);
    ptx::fence_accumulators(partial);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kK32Steps; ++kk)
      Wgmma::mma(partial, ptx::descriptor_advance(da, kk * 32), ptx::descriptor_advance(db, kk * 32), kk > 0 ? 1u : 0u);
    ptx::wgmma_commit_group();
    ptx::fence_accumulators(partial);
  }

  // The turns: warpgroup `math` waits on barrier kTurnBarrier + math and passes the turn on the
  // other's. Warpgroup 1 hands warpgroup 0 its first turn (begin) and warpgroup 0 takes the last
  // hand-over after its last step (finish), so that every barrier use completes.
  static constexpr uint32_t kTurnBarrier = 3;  // 0: __syncthreads, 1 and 2: the epilogues
  __device__ __forceinline__ void pass_turn() const {
    if constexpr (!kOwnTiles) ptx::named_barrier_arrive(kTurnBarrier + (math ^ 1u), 256);
  }
  __device__ __forceinline__ void take_turn() const {
    if constexpr (!kOwnTiles) ptx::named_barrier_sync(kTurnBarrier + math, 256);
  }
  __device__ __forceinline__ void begin() const {
    if (math == 1) pass_turn();
  }
  __device__ __forceinline__ void finish() const {
    if (math == 0) take_turn();
  }

  // Waits for step kb's wgmma, promotes it with the stage's scales and releases the stage.
  // acc[4j + 2h + c] is row (row + 8h), column 8j + 2 (lane % 4) + c. M-grouped: the column groups
  // j < kFirstGroups take the first weight block's scale, the others the next block's.
  template <int kFirstGroups>
  __device__ __forceinline__ void promote(float (&partial)[kAccRegs], Accumulators& acc, int stage) const {
    const uint32_t scales = stage_address(stage) + Cfg::kABytes + Cfg::kBBytes;
    float sa[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) sa[h] = __uint_as_float(ptx::ld_shared_b32(scales + 4 * (row + 8 * h)));
    float sb[2] = {0.f, 0.f};
    if constexpr (!kKGrouped) ptx::ld_shared_v2_f32(scales + 4 * Cfg::kBlockM, sb[0], sb[1]);
    ptx::wgmma_wait_group<0>();
    ptx::fence_accumulators(partial);
    if constexpr (kKGrouped) {
      // Column scales pair by pair (8-byte loads), read as they are used: holding them all would
      // not fit beside the accumulators.
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
        float sc[2];
        ptx::ld_shared_v2_f32(scales + 4 * (Cfg::kBlockM + 8 * j + 2 * (lane % 4)), sc[0], sc[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int c = 0; c < 2; ++c)
            acc[4 * j + 2 * h + c] = __fmaf_rn(partial[4 * j + 2 * h + c], sa[h] * sc[c], acc[4 * j + 2 * h + c]);
        }
      }
    } else {
      const float s0[2] = {sa[0] * sb[0], sa[1] * sb[0]};
      const float s1[2] = {sa[0] * sb[1], sa[1] * sb[1]};
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float s = j < kFirstGroups ? s0[h] : s1[h];
#pragma unroll
          for (int c = 0; c < 2; ++c)
            acc[4 * j + 2 * h + c] = __fmaf_rn(partial[4 * j + 2 * h + c], s, acc[4 * j + 2 * h + c]);
        }
      }
    }
    smem.release(stage, lane);
  }

  // The k-loop of tile t into acc. after_step(kb) runs once step kb has been promoted;
  // after_loop() once the last stage has been released, or (ping-pong) once the last step's
  // wgmma have been issued: the other warpgroup then waits on no stage this one has yet to wait
  // on, and its mainloop may start. A tile with no k step (an empty wgrad group) leaves acc zero.
  template <class Probe, class AfterStep, class AfterLoop>
  __device__ __forceinline__ void run(const Tile& t, Accumulators& acc, RingState<Pipe::kStages>& ring,
                                      Probe& probe, AfterStep&& after_step, AfterLoop&& after_loop) const {
#pragma unroll
    for (int r = 0; r < kAccRegs; ++r) acc[r] = 0.f;
    float partial[kAccRegs];
    // Where the tile's columns cross into the next 128-row weight block (M-grouped): 64 or 128
    // columns in, or not within the tile.
    const int split = Cfg::kScaleBlock - t.n0 % Cfg::kScaleBlock;
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      const int stage = ring.stage;
      ptx::mbarrier_wait(&smem.full[stage], ring.phase);
      probe.full_stage(kb);
      take_turn();
      issue(partial, stage);
      pass_turn();
      ring.advance();
      if (kOwnTiles && kb + 1 == t.k_blocks) after_loop();
      if (kKGrouped || kBN <= Cfg::kScaleBlock || split >= kBN) promote<kBN / 8>(partial, acc, stage);
      else if (split == 64) promote<8>(partial, acc, stage);
      else promote<16>(partial, acc, stage);
      after_step(kb);
    }
    probe.end_mainloop(t);
    if (!kOwnTiles || t.k_blocks == 0) after_loop();
  }
};

}  // namespace moe::cuda::sm90
