// The ring of operand stages of the Hopper grouped GEMM and the rest of a block's shared memory.
// The producer fills a stage with TMA loads and the full barrier counts their bytes; the consumers
// multiply out of it and release it on the empty barrier. Blocks run in clusters of two that may
// multicast B into both blocks (scheduler.cuh), so a stage may be refilled only once the consumers
// of *both* blocks have released it: every consumer warp arrives on the empty barrier of both
// blocks, for every step, multicast or not, which keeps the two blocks' barrier phases in lockstep.
#pragma once

#include <cstdint>

#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/sync.cuh"
#include "cuda/sm90/config.hpp"

namespace moe::cuda::sm90 {

// A position in the ring: the stage and the parity of the barrier phase it is in. Producer and
// consumers each walk the ring with their own, one step per k step of every tile.
template <int kStages>
struct RingState {
  int stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
  // Past `steps` steps that another warpgroup consumes (ping-pong).
  __device__ __forceinline__ void skip(int steps) {
    for (int i = 0; i < steps; ++i) advance();
  }
};

// Which 64 rows of its tile math warpgroup `math` multiplies and stores: its own half of the
// tile, or all of a ping-pong tile (config.hpp's kStageConsumers).
template <class Cfg>
__device__ __forceinline__ uint32_t tile_slab(uint32_t math) {
  return Cfg::kStageConsumers == 1 ? 0u : math;
}

// A block's dynamic shared memory, in order: the ring's stages (A, B, FP8 scales), the epilogue buffers,
// the bias staging, the full and empty barriers, and the M-grouped scheduler's prefix of pairs.
template <class Pipe>
struct SharedStorage {
  using Cfg = typename Pipe::Cfg;
  static constexpr int kStages = Pipe::kStages;

  uint8_t* stages;
  uint8_t* epilogue;
  uint8_t* bias;
  uint64_t* full;
  uint64_t* empty;
  uint32_t prefix;  // shared address of the scheduler's pairs-before-group table (scheduler.cuh)

  __device__ __forceinline__ explicit SharedStorage(uint8_t* raw) {
    stages = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    epilogue = stages + kStages * Cfg::kStageBytes;
    bias = epilogue + Pipe::kEpilogueBytes;
    full = reinterpret_cast<uint64_t*>(bias + Cfg::kBiasBytes);
    empty = full + kStages;
    prefix = ptx::smem_address(empty + kStages);
  }

  __device__ __forceinline__ uint8_t* stage_a(int s) const { return stages + s * Cfg::kStageBytes; }
  __device__ __forceinline__ uint8_t* stage_b(int s) const { return stages + s * Cfg::kStageBytes + Cfg::kABytes; }
  // FP8: the step's scales, after A and B (shared address).
  __device__ __forceinline__ uint32_t stage_scales(int s) const {
    return ptx::smem_address(stages + s * Cfg::kStageBytes + Cfg::kABytes + Cfg::kBBytes);
  }


  // One thread, before the cluster's first barrier.
  __device__ __forceinline__ void init_barriers() const {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full[s], Cfg::kFullArrivals);
      // One arrival per releasing lane of each consuming math warp of each block of the cluster.
      ptx::mbarrier_init(&empty[s], Config::kClusterSize * Cfg::kStageConsumers * 4 * Cfg::kReleasingLanes);
    }
    ptx::fence_barrier_init();
  }

  // A consumer warp releases a stage in both blocks (see the top of this file): lane 0, or every
  // lane (Config::kReleasingLanes).
  __device__ __forceinline__ void release(int s, uint32_t lane) const {
    static_assert(Cfg::kReleasingLanes == 1 || Cfg::kReleasingLanes == 32);
    if (Cfg::kReleasingLanes == 32 || lane == 0) {
#pragma unroll
      for (uint32_t r = 0; r < Config::kClusterSize; ++r) ptx::mbarrier_arrive_cluster(&empty[s], r);
    }
  }

  // A consumer's steps through a tile it does not multiply (a ghost): it keeps the barrier phases
  // in step with the peer block, nothing else.
  __device__ __forceinline__ void pass_over(int steps, RingState<kStages>& ring, uint32_t lane) const {
    for (int kb = 0; kb < steps; ++kb) {
      ptx::mbarrier_wait(&full[ring.stage], ring.phase);
      release(ring.stage, lane);
      ring.advance();
    }
  }
};

}  // namespace moe::cuda::sm90
