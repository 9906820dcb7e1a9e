// Compile-time shape of the Hopper grouped GEMM: tile sizes, pipeline depth, shared-memory map.
// Shared by the kernel and its host launcher.
#pragma once

#include <cstdint>

#include "cuda/gemm_form.hpp"

namespace moe::cuda::sm90 {

using cuda::Form;

// What the epilogue does with a tile's accumulators.
enum class Epilogue : int {
  kStore = 0,        // D (+ bias / scaled bias), TMA stores (every form)
  kGluForward = 1,   // forward only: h = D + b1 -> GLU(h) * p, h stored too if asked (glu_epilogue.cuh)
  kGluBackward = 2,  // dgrad only: D = d(act * p) -> dh, act * p, dprobs shares (glu_epilogue.cuh)
};

struct Config {
  static constexpr int kBlockM = 128;  // two math warpgroups of 64 rows
  static constexpr int kBlockN = 256;
  static constexpr int kBlockK = 64;  // one 128-byte swizzle row of 16-bit values
  static constexpr int kStages = 4;  // 3 stages + 4 epilogue buffers measured no better (s3)
  static constexpr int kThreads = 384;  // warpgroup 0: TMA producer; 1 and 2: math
  static constexpr int kClusterSize = 2;  // blocks per cluster: pairs of tiles sharing B (multicast)
  static constexpr int kMathWarpgroups = 2;
  // setmaxnreg: the CTA starts with 168 registers per thread (65536 / 384, rounded down to 8);
  // the producer gives some back and the math warpgroups take them. The sum must fit the pool,
  // or a math warpgroup's setmaxnreg.inc waits forever.
  static constexpr int kLaunchRegisters = 168;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kMathRegisters = 232;

  static constexpr uint32_t kABytes = kBlockM * kBlockK * 2;  // 16 KiB
  static constexpr uint32_t kBBytes = kBlockN * kBlockK * 2;  // 32 KiB
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr uint32_t kPanelBytes = kBlockK * 128;  // one 64-wide MN-major panel: 8 KiB
  // Epilogue: per math warpgroup, kEpilogueBuffers buffers of 64 rows x 128 bytes, filled and
  // stored as one batch.
  static constexpr int kEpilogueBuffers = 2;
  static constexpr uint32_t kEpilogueBufferBytes = 64 * 128;
  static constexpr uint32_t kEpilogueBytes = kMathWarpgroups * kEpilogueBuffers * kEpilogueBufferBytes;
  // Forward bias: each math warpgroup stages the tile's kBlockN bias values (16-bit).
  static constexpr uint32_t kBiasBytes = kMathWarpgroups * kBlockN * 2;
  static constexpr uint32_t kBarrierBytes = 2 * kStages * sizeof(uint64_t);
  // M-grouped forms: pairs of tiles before each group (32-bit), when G + 1 fits: the scheduler
  // finds a tile's group by binary search instead of walking the groups.
  static constexpr uint32_t kOffsetSlots = 240;
  static constexpr uint32_t kOffsetBytes = kOffsetSlots * 4;
  // 1 KiB of slack: the dynamic shared-memory base is aligned up to 1024 (swizzle atoms).
  static constexpr uint32_t kSharedBytes =
      kStages * kStageBytes + kEpilogueBytes + kBiasBytes + kBarrierBytes + kOffsetBytes + 1024;

  static constexpr uint32_t kRaggedRows = 1u << 30;  // extent of the ragged dimension
};

static_assert(Config::kSharedBytes <= 232448, "exceeds the 227 KiB of shared memory per block");
static_assert(Config::kProducerRegisters + Config::kMathWarpgroups * Config::kMathRegisters <=
                  (Config::kMathWarpgroups + 1) * Config::kLaunchRegisters,
              "setmaxnreg: the warpgroups' registers exceed the CTA's pool");

}  // namespace moe::cuda::sm90
