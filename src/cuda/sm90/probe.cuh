// Diagnostics of the Hopper grouped GEMM: per-phase cycle counts, printed by the launcher after
// each launch. The kernel calls a Probe at fixed points of every tile; the default, NoProbe, is
// empty and compiles to nothing. A diagnostics build (-DMOE_SM90_PROBE, CMake option
// MOE_ENGINE_SM90_PROBE) selects CycleProbe here, the one place that reads the macro.
#pragma once

#include <cstdint>

#ifdef MOE_SM90_PROBE
#include <cuda_runtime_api.h>

#include <cstdio>

#include "cuda/runtime/check.hpp"
#endif

#include "cuda/sm90/config.hpp"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

// One probe per math thread for the kernel's whole tile loop. The calls, in the order a tile makes
// them. `step` k of the epilogue: 0 setup, then per batch 1 wait for the buffers, 2 barrier, 3
// shared stores, 4 fence, 5 barrier, 6 store issue.
struct NoProbe {
  __device__ __forceinline__ void begin_tile() {}
  __device__ __forceinline__ void full_stage(int /*kb*/) {}
  __device__ __forceinline__ void end_mainloop(const Tile&) {}
  __device__ __forceinline__ void begin_epilogue() {}
  __device__ __forceinline__ void step(int /*k*/) {}
  __device__ __forceinline__ void end_tile() {}
  // Host: around each launch.
  static void before_launch() {}
  static void after_launch(Form) {}
};

#ifdef MOE_SM90_PROBE
// Block 0's first math thread sums clock64() cycles per phase: [0] mainloop, [1] epilogue, [2] gap
// to the next tile's first full stage, [3] tiles, [4] k-steps; [8..14]: the epilogue's steps (setup,
// wait, barrier, shared stores, fence, barrier, store issue); [15]: the part of the gap before the
// next tile's start (the lookup's loads, a ping-pong turn). The timestamps stay in registers (one
// probe for the kernel's whole tile loop): read back from global memory they put a load's
// latency into the phases they measured. The sums go out as reductions, which nothing waits on.
__device__ unsigned long long g_probe[16];

struct CycleProbe {
  const bool on;
  unsigned long long mainloop_start = 0, mainloop_end = 0, tile_end = 0;
  uint32_t last = 0;

  __device__ __forceinline__ CycleProbe() : on(blockIdx.x == 0 && threadIdx.x == 128) {}

  __device__ __forceinline__ static void add(int slot, unsigned long long cycles) { atomicAdd(&g_probe[slot], cycles); }

  __device__ __forceinline__ void begin_tile() {
    if (on && tile_end) add(15, clock64() - tile_end);
  }
  __device__ __forceinline__ void full_stage(int kb) {
    if (kb == 0 && on) {
      const unsigned long long now = clock64();
      if (tile_end) add(2, now - tile_end);
      mainloop_start = now;
    }
  }
  __device__ __forceinline__ void end_mainloop(const Tile& t) {
    if (on) {
      const unsigned long long now = clock64();
      add(0, now - mainloop_start);
      mainloop_end = now;
      add(3, 1ull);
      add(4, (unsigned long long)t.k_blocks);
    }
  }
  __device__ __forceinline__ void begin_epilogue() {
    last = uint32_t(mainloop_end);
    step(0);
  }
  __device__ __forceinline__ void step(int k) {
    if (on) {
      const uint32_t now = uint32_t(clock64());
      add(8 + k, (unsigned long long)(now - last));
      last = now;
    }
  }
  __device__ __forceinline__ void end_tile() {
    if (on) {
      const unsigned long long now = clock64();
      add(1, now - mainloop_end);
      tile_end = now;
    }
  }

  static void before_launch() {
    unsigned long long zero[16] = {};
    MOE_CUDA_CHECK(cudaMemcpyToSymbol(g_probe, zero, sizeof(zero)), "probe reset");
  }
  static void after_launch(Form form) {
    unsigned long long v[16];
    MOE_CUDA_CHECK(cudaMemcpyFromSymbol(v, g_probe, sizeof(v)), "probe read");
    if (v[3] == 0) return;
    std::fprintf(stderr,
                 "probe form %d: tiles %llu steps/tile %.1f, cycles/tile: mainloop %.0f epilogue %.0f gap %.0f (to the "
                 "tile's start %.0f)\n",
                 int(form), v[3], double(v[4]) / v[3], double(v[0]) / v[3], double(v[1]) / v[3], double(v[2]) / v[3],
                 double(v[15]) / v[3]);
    std::fprintf(stderr, "probe epilogue steps/tile: setup %.0f wait %.0f bar %.0f st.shared %.0f fence %.0f bar %.0f issue %.0f\n",
                 double(v[8]) / v[3], double(v[9]) / v[3], double(v[10]) / v[3], double(v[11]) / v[3],
                 double(v[12]) / v[3], double(v[13]) / v[3], double(v[14]) / v[3]);
  }
};

using Probe = CycleProbe;
#else
using Probe = NoProbe;
#endif

}  // namespace moe::cuda::sm90
