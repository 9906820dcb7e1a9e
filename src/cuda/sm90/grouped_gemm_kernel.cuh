// The Hopper grouped GEMM: one persistent, warp-specialized kernel for the forward, dgrad and wgrad
// forms. Warpgroup 0 is the producer (one thread issues TMA loads into a kStages-deep ring of
// shared-memory stages guarded by full/empty mbarriers: producer.cuh, ring.cuh); warpgroups 1 and
// 2 each multiply 64 rows of the 128 x 256 tile with wgmma (the mainloop: mainloop_16bit.cuh), or,
// ping-pong, each a 64 x 256 tile of its own, taking turns (PingPongTurns below), and store their
// results through swizzled shared memory with TMA (the epilogue: epilogue_store.cuh,
// epilogue_glu.cuh for the fused MLP's activations). Blocks run in clusters of two that work on
// pairs of tiles (scheduler.cuh).
//
// Group boundaries need no padding: token-indexed operands use "ragged" tensor maps (see
// tensor_maps.hpp) whose bounds end at the group's last row, so TMA zero-fills loads and clips
// stores there. Rows past offsets[G] belong to no group and are never written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/sync.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/sm90/config.hpp"
#include "cuda/sm90/epilogue_glu.cuh"
#include "cuda/sm90/epilogue_store.cuh"
#include "cuda/sm90/mainloop_16bit.cuh"
#include "cuda/sm90/mainloop_fp8.cuh"
#include "cuda/sm90/params.hpp"
#include "cuda/sm90/probe.cuh"
#include "cuda/sm90/producer.cuh"
#include "cuda/sm90/producer_fp8.cuh"
#include "cuda/sm90/ring.cuh"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

// The mainloop and producer for the operand type: 16-bit operands (bf16, fp16), or E4M3 with
// per-block scales.
template <class In, Form kForm, class Pipe>
struct MainloopFor {
  using type = Mainloop16Bit<In, kForm, Pipe>;
};
template <Form kForm, class Pipe>
struct MainloopFor<__nv_fp8_e4m3, kForm, Pipe> {
  using type = MainloopFp8<kForm, Pipe>;
};

template <class In, Form kForm, class Pipe>
struct ProducerFor {
  using type = Producer<kForm, Pipe>;
};
template <Form kForm, class Pipe>
struct ProducerFor<__nv_fp8_e4m3, kForm, Pipe> {
  using type = ProducerFp8<kForm, Pipe>;
};

template <Epilogue kEpi, Form kForm, class In, class Out, class Pipe>
using EpilogueFor = std::conditional_t<
    kEpi == Epilogue::kStore, StoreEpilogue<kForm, In, Out, Pipe>,
    std::conditional_t<kEpi == Epilogue::kGluForward || kEpi == Epilogue::kActForward,
                       ForwardActivationEpilogue<In, Pipe, kEpi == Epilogue::kGluForward>,
                       BackwardActivationEpilogue<In, Pipe, kEpi == Epilogue::kGluBackward>>>;

// The activation epilogues run on FC1's forward (kGluForward, kActForward) or FC2's dgrad.
constexpr bool epilogue_fits(Epilogue epi, Form form) {
  if (epi == Epilogue::kGluForward || epi == Epilogue::kActForward) return form == Form::kForward;
  if (epi == Epilogue::kGluBackward || epi == Epilogue::kActBackward) return form == Form::kDgrad;
  return true;
}

// Ping-pong (config.hpp's kStageConsumers == 1): the tiles that reach the math warpgroups
// alternate between them, and a warpgroup starts a tile's mainloop only once the other has
// finished the previous tile's (a turn passed on named barriers kTurnBarrier + warpgroup). So one's
// epilogue runs under the other's mainloop, and a warpgroup never waits on a stage's full barrier
// while the other still has an earlier phase of it to consume (a parity wait cannot tell the two
// phases apart). Each steps its ring over the other's tiles. PingPongTurns<false>: both
// warpgroups share every tile; nothing to do.
template <bool kPingPong>
struct PingPongTurns {
  static constexpr uint32_t kTurnBarrier = 3;  // 0: __syncthreads, 1 and 2: the epilogues
  const uint32_t math;
  uint32_t tiles = 0;  // tiles that reached the math warpgroups so far

  // The next tile: true if it is this warpgroup's (once its turn has come), false if the other's.
  __device__ __forceinline__ bool take() {
    const uint32_t index = tiles++;
    if ((index & 1u) != math) return false;
    if (index > 0) ptx::named_barrier_sync(kTurnBarrier + math, 256);
    return true;
  }
  // After this warpgroup's mainloop of a tile: the other's turn.
  __device__ __forceinline__ void pass() const { ptx::named_barrier_arrive(kTurnBarrier + (math ^ 1u), 256); }
  // After the last tile: its owner passed the turn to nobody; the other takes it, so that no
  // arrival stays pending on a named barrier.
  __device__ __forceinline__ void finish() const {
    if (tiles > 0 && ((tiles - 1) & 1u) != math) ptx::named_barrier_sync(kTurnBarrier + math, 256);
  }
};
template <>
struct PingPongTurns<false> {
  __device__ __forceinline__ explicit PingPongTurns(uint32_t) {}
  __device__ __forceinline__ void pass() const {}
  __device__ __forceinline__ void finish() const {}
};

template <Form kForm, class In, class Out, Epilogue kEpi, class Pipe>
__device__ __forceinline__ void grouped_gemm_body(const CUtensorMap& map_a, const CUtensorMap& map_b,
                                                  const CUtensorMap& map_d, const CUtensorMap& map_e,
                                                  const GemmParams& p) {
  static_assert(epilogue_fits(kEpi, kForm), "activation epilogues: forward on FC1, backward on FC2's dgrad");
  using Mainloop = typename MainloopFor<In, kForm, Pipe>::type;
  using Cfg = typename Pipe::Cfg;
  using Epi = EpilogueFor<kEpi, kForm, In, Out, Pipe>;
  constexpr bool kKGrouped = kForm == Form::kWgrad;
  // M-grouped forms look the next tile up under the mainloop, at step kLookupStep (or after the
  // last): its ~1k cycles of dependent loads then no longer sit between two tiles. Not wgrad:
  // the small batch's short wgrad tiles measured 4-7% slower with it. Not an epilogue that looks
  // up after itself (dGLU).
  constexpr bool kEarlyLookup = !kKGrouped && !Epi::kLookUpAfter;
  constexpr int kLookupStep = 4;

  // ---------------- setup: shared memory, barriers, the scheduler's prefix ----------------
  extern __shared__ uint8_t shared_raw[];
  const SharedStorage<Pipe> smem(shared_raw);
  // M-grouped: pairs before each group, for the scheduler's lookups (scheduler.cuh).
  const bool prefix_in_smem = !kKGrouped && p.num_groups + 1 <= int32_t(Config::kOffsetSlots);
  const uint32_t warp = ptx::warp_index(), lane = ptx::lane_index();
  // Re-read from special registers where used, rather than held in registers across the loop.
  auto first_pair = [] { return int32_t(ptx::cluster_id_x()); };
  auto pair_stride = [] { return int32_t(ptx::cluster_count_x()); };
  if (threadIdx.x == 0) smem.init_barriers();
  if (threadIdx.x == 32) {
    ptx::prefetch_tensor_map(&map_a);
    ptx::prefetch_tensor_map(&map_b);
    ptx::prefetch_tensor_map(&map_d);
    if constexpr (kEpi == Epilogue::kGluForward || kEpi == Epilogue::kActForward) ptx::prefetch_tensor_map(&map_e);
  }
  auto make_scheduler = [&] {
    if constexpr (kKGrouped)
      return KGroupedScheduler<Cfg>(p.offsets, p.num_groups, p.m_out, p.n_out);
    else
      return MGroupedScheduler<Cfg>(p.offsets, prefix_in_smem ? smem.prefix : 0u, p.num_groups, p.n_out, p.k);
  };
  if constexpr (!kKGrouped) {
    if (prefix_in_smem && warp == 1) make_scheduler().fill_prefix(lane);
  }
  // The peer block's barriers must be initialized before anything arrives on them (and the
  // prefix filled before any lookup).
  ptx::cluster_sync();
  // Accumulating into main_grad: an empty group contributes nothing and its tiles are skipped.
  auto skipped = [&](const Tile& t) { return kKGrouped && p.reduce_add && t.k_blocks == 0; };

  if (warp < 4) {
    // ---------------- producer warpgroup: one thread loads every tile's k steps ----------------
    ptx::setmaxnreg_decrease<Cfg::kProducerRegisters>();
    using Producer = typename ProducerFor<In, kForm, Pipe>::type;
    if (warp == 0 && lane == 0) {
      const Producer producer{map_a, map_b, p, smem};
      auto scheduler = make_scheduler();
      RingState<Pipe::kStages> ring;
      Tile t;
      for (int32_t i = first_pair(); scheduler.get(i, t); i += pair_stride())
        if (!skipped(t)) producer.load(t, ring);
    }
    if constexpr (Producer::kScaleWarp) {  // FP8: warp 1 stores every step's scales
      if (warp == 1) {
        const Producer producer{map_a, map_b, p, smem};
        auto scheduler = make_scheduler();
        RingState<Pipe::kStages> ring;
        Tile t;
        for (int32_t i = first_pair(); scheduler.get(i, t); i += pair_stride())
          if (!skipped(t)) producer.load_scales(t, ring, lane);
      }
    }
    // Neither block may exit while the other can still multicast into it or arrive on its barriers.
    ptx::cluster_sync();
    return;
  }

  // ---------------- math warpgroups: mainloop, then epilogue, per tile ----------------
  ptx::setmaxnreg_increase<Cfg::kMathRegisters>();
  const uint32_t math = warp / 4 - 1;  // which math warpgroup (which 64 rows of the tile: tile_slab)
  // Ping-pong: each warpgroup multiplies tiles of its own (below).
  constexpr bool kOwnTiles = Cfg::kStageConsumers == 1;
  // This warp's 16 rows within the 64: 16 * (warp % 4).
  const MathThread th{lane, math, threadIdx.x - 128 * (math + 1), 16 * (warp % 4)};
  const Mainloop mainloop(smem, p, math, lane);
  const Epi epilogue{p, map_d, map_e, smem, th};
  typename Mainloop::Accumulators acc;
  auto scheduler = make_scheduler();
  RingState<Pipe::kStages> ring;
  Tile t, next;
  int32_t pair = first_pair();
  auto look_up = [&] { return scheduler.get(pair, next); };  // the tile after t
  PingPongTurns<kOwnTiles> turns{math};
  Probe probe;  // cycle counts per phase (NoProbe: none)
  mainloop.begin();
  for (bool have = scheduler.get(pair, t); have; t = next) {
    pair += pair_stride();
    if (skipped(t)) {
      have = look_up();
      continue;
    }
    if constexpr (kOwnTiles) {
      if (!turns.take()) {  // the other warpgroup's tile
        ring.skip(t.k_blocks);
        have = look_up();
        continue;
      }
    }
    if (!t.live) {  // a ghost: keep the barrier phases in step with the peer, nothing else
      smem.pass_over(t.k_blocks, ring, lane);
      if constexpr (kOwnTiles) turns.pass();
      have = look_up();
      continue;
    }
    epilogue.begin_tile(t);
    probe.begin_tile();
    mainloop.run(
        t, acc, ring, probe,
        [&](int kb) {
          if (kEarlyLookup && kb == kLookupStep) have = look_up();
          epilogue.after_step(t, kb);
        },
        [&] {
          if constexpr (kOwnTiles) turns.pass();  // before the lookup: its loads are ~1k cycles
          const bool looked_up = kEarlyLookup && t.k_blocks > kLookupStep;
          if (!Epi::kLookUpAfter && !looked_up) have = look_up();
        });
    epilogue.store(t, acc, probe);
    if constexpr (Epi::kLookUpAfter) have = look_up();
    probe.end_tile();
  }
  mainloop.finish();
  if constexpr (kOwnTiles) turns.finish();
  if (th.wg_thread == 0) ptx::bulk_wait_group_all();
  ptx::cluster_sync();
}

// The kernels: the body above where the sm_90a features exist (wgmma, TMA multicast, setmaxnreg),
// nothing elsewhere (the host pass, other architectures). The architecture guards.
template <Form kForm, class In, class Out, Epilogue kEpi = Epilogue::kStore, class Pipe = DeepRing>
__global__ void __launch_bounds__(Config::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_d,
                        const __grid_constant__ CUtensorMap map_e, const GemmParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  grouped_gemm_body<kForm, In, Out, kEpi, Pipe>(map_a, map_b, map_d, map_e, p);
#endif
}

// The FP8 kernel: the same body with E4M3 operands (store epilogue).
template <Form kForm, class Out, class Pipe>
__global__ void __launch_bounds__(Config::kThreads, 1)
    grouped_gemm_fp8_kernel(const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_b,
                            const __grid_constant__ CUtensorMap map_d, const GemmParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  grouped_gemm_body<kForm, __nv_fp8_e4m3, Out, Epilogue::kStore, Pipe>(map_a, map_b, map_d, map_d, p);
#endif
}

}  // namespace moe::cuda::sm90
