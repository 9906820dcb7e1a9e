// Compile-time shape of the Hopper grouped GEMM: tile sizes, pipeline depth, shared-memory map.
// Shared by the kernel and its host launcher.
#pragma once

#include <cstdint>

#include "cuda/gemm/gemm_form.hpp"

namespace moe::cuda::sm90 {

using cuda::Form;

// What the epilogue does with a tile's accumulators.
enum class Epilogue : int {
  kStore = 0,        // D (+ bias / scaled bias), TMA stores (every form)
  kGluForward = 1,   // forward only: h = D + b1 -> GLU(h) * p, h stored too if asked (epilogue_glu.cuh)
  kGluBackward = 2,  // dgrad only: D = d(act * p) -> dh, act * p, dprobs shares (epilogue_glu.cuh)
  kActForward = 3,   // forward only, non-gated: h = D + b1 -> f(h) * p, h stored too if asked
  kActBackward = 4,  // dgrad only, non-gated: D = d(act * p) -> dh, act * p, dprobs shares
};

// The tile geometry and thread layout, the same for every instance.
struct Config {
  static constexpr int kBlockM = 128;  // two math warpgroups of 64 rows
  static constexpr int kBlockN = 256;
  static constexpr int kBlockK = 64;  // one 128-byte swizzle row of 16-bit values
  static constexpr int kThreads = 384;  // warpgroup 0: TMA producer; 1 and 2: math
  static constexpr int kClusterSize = 2;  // blocks per cluster: pairs of tiles sharing B (multicast)
  static constexpr int kMathWarpgroups = 2;
  // Math warpgroups that read each stage: both (they split the tile's rows), or one (ping-pong:
  // each warpgroup has tiles of its own, PingPongConfig).
  static constexpr int kStageConsumers = 2;
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
  // Epilogue buffers hold 64 rows x 128 bytes (one TMA store box of a math warpgroup).
  static constexpr uint32_t kEpilogueBufferBytes = 64 * 128;
  // Forward bias: each math warpgroup stages the tile's kBlockN bias values (16-bit).
  static constexpr uint32_t kBiasBytes = kMathWarpgroups * kBlockN * 2;
  // M-grouped forms: pairs of tiles before each group (32-bit), when G + 1 fits: the scheduler
  // finds a tile's group by binary search instead of walking the groups.
  static constexpr uint32_t kOffsetSlots = 240;
  static constexpr uint32_t kOffsetBytes = kOffsetSlots * 4;

  static constexpr uint32_t kRaggedRows = 1u << 30;  // extent of the ragged dimension
  static constexpr uint32_t kScaleBytes = 0;         // per stage: no operand scales
  static constexpr uint32_t kFullArrivals = 1;       // the producer's, with the TMA bytes
  // Lanes of a consumer warp that arrive on a stage's empty barrier: one, where the warp reads the
  // stage through the tensor core only (its wgmma complete before the release); all of them where
  // each lane also reads the stage itself (FP8 scales), so that every read is ordered before the
  // stage's refill by its own thread's release (PTX memory model).
  static constexpr uint32_t kReleasingLanes = 1;
};

// Ping-pong: 64 x 256 tiles, each math warpgroup on tiles of its own, taking turns at the mainloop
// so that one's epilogue runs under the other's multiplies. A stage is one warpgroup's: 8 KiB of
// A, 32 KiB of B.
struct PingPongConfig : Config {
  static constexpr int kBlockM = 64;
  static constexpr int kStageConsumers = 1;
  static constexpr uint32_t kABytes = kBlockM * kBlockK * 2;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
};

// The FP8 block-scaled tiles: kM x kN x 128. One k step is one 128-wide scale block of E4M3 (one
// 128-byte swizzle row); each math warpgroup holds a 64 x kN fp32 running sum and the tensor core's
// partial sum of the step, promoted with the scales (mainloop_fp8.cuh): 2 x kN / 2 registers. The
// wider the tile, the fewer bytes per multiply-add reach shared memory from L2 and the wgmma from
// shared memory; 192 columns is as wide as the two tiles' registers allow. A stage also holds its
// step's scales, which a warp of the producer warpgroup copies in (one arrival per lane on the
// full barrier). kM = 128: the math warpgroups split each tile's rows; kM = 64: ping-pong, each
// warpgroup on tiles of its own (as PingPongConfig).
template <int kN, int kM = 128>
struct Fp8Config : Config {
  static_assert(kN % 64 == 0 && kN <= 256, "FP8 tiles are 64, 128, 192 or 256 columns wide");
  static_assert(kM == 128 || kM == 64, "FP8 tiles are 128 rows (two warpgroups) or 64 (ping-pong)");
  static constexpr int kBlockM = kM;
  static constexpr int kStageConsumers = kM == 64 ? 1 : 2;
  static constexpr int kBlockN = kN;
  static constexpr int kBlockK = 128;
  static constexpr int kScaleBlock = 128;  // the operands' scale blocks along K, and the weights' along N
  static constexpr uint32_t kABytes = kBlockM * kBlockK;  // 16 KiB (ping-pong: 8)
  static constexpr uint32_t kBBytes = kBlockN * kBlockK;
  // A's kBlockM row scales, then B's kN column scales (wgrad) or the weight blocks' scales, in whole
  // KiB so that the stages stay 1024-byte aligned.
  static constexpr uint32_t kScaleBytes = ((kBlockM + kBlockN) * 4 + 1023) / 1024 * 1024;
  static constexpr uint32_t kStageBytes = kABytes + kBBytes + kScaleBytes;
  // The TMA thread's, and one per lane of the scale warp (its cp.async copies).
  static constexpr uint32_t kFullArrivals = 1 + 32;
  // Every lane reads the step's scales from the stage (Config::kReleasingLanes).
  static constexpr uint32_t kReleasingLanes = 32;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kMathRegisters = 232;
  static constexpr uint32_t kBiasBytes = kMathWarpgroups * kBlockN * 2;
};

// How a block's shared memory is split between the ring of operand stages and the epilogue's
// buffers, per math warpgroup: its output goes out in batches of that many 128-byte column
// chunks, each batch waiting for the previous one's stores to have read their buffers. 227 KiB
// hold 4 stages + 2 buffers or 3 stages + 4 buffers (a whole 16-bit 64 x 256 slab per batch).
template <int kStagesT, int kEpilogueBuffersT, class CfgT = Config>
struct Pipeline {
  using Cfg = CfgT;  // the tile shape
  static constexpr int kStages = kStagesT;
  static constexpr int kEpilogueBuffers = kEpilogueBuffersT;
  static constexpr uint32_t kEpilogueBytes =
      Config::kMathWarpgroups * kEpilogueBuffers * Config::kEpilogueBufferBytes;
  static constexpr uint32_t kBarrierBytes = 2 * kStages * sizeof(uint64_t);
  // 1 KiB of slack: the dynamic shared-memory base is aligned up to 1024 (swizzle atoms).
  static constexpr uint32_t kSharedBytes = kStages * Cfg::kStageBytes + kEpilogueBytes + Cfg::kBiasBytes +
                                           kBarrierBytes + Cfg::kOffsetBytes + 1024;
  static_assert(kSharedBytes <= 232448, "exceeds the 227 KiB of shared memory per block");
};

// The default: the deepest ring (measured: 3 stages + 4 buffers for every instance ran at 0.99x
// over the suite; per GEMM, tiles of one k step need the 4th stage's loads in flight).
using DeepRing = Pipeline<4, 2>;
// A 16-bit tile's stores in one batch, with no wait inside the epilogue, at the cost of a stage:
// faster for wgrads with 16-bit outputs over >= 4 k steps per tile (heuristics.hpp decides).
using WideEpilogue = Pipeline<3, 4>;
// Ping-pong wgrads: four 40 KiB stages and four epilogue buffers a warpgroup (a 64 x 256 fp32
// slab in two batches).
using PingPong = Pipeline<4, 4, PingPongConfig>;
// Ping-pong for FC1's activation epilogues: two epilogue buffers a warpgroup, as their batches
// (h's two, then act's) are written for; four 40 KiB stages still fit.
using ActivationPingPong = Pipeline<4, 2, PingPongConfig>;
// FP8: 128 x 192 tiles, four 42 KiB stages and three epilogue buffers per math warpgroup (a 16-bit
// output slab in one batch). Measured against 128 x 128 tiles with five stages (H200, the suite):
// 0.75x the time over the 90 GEMMs, faster on all but two (docs/performance-log.md).
using Fp8Ring = Pipeline<4, 3, Fp8Config<192>>;
// FP8 wgrads into fp32 (main_grad): a stage fewer, and six epilogue buffers a math warpgroup, its
// whole 64 x 192 fp32 slab, so the reduce-adds go out in one batch and drain under the next tile's
// mainloop instead of the second batch waiting for the first's buffers. Three 128-deep FP8 stages
// still cover the operand loads, where the 16-bit kernel's two 64-deep ones did not.
using Fp8WideEpilogue = Pipeline<3, 6, Fp8Config<192>>;
// FP8 ping-pong (the small batch's forward and dgrad): 64 x 192 tiles, each math warpgroup on
// tiles of its own, so that one's epilogue runs under the other's mainloop. A stage is one
// warpgroup's (8 KiB of A, 24 KiB of B, 1 KiB of scales): five of them beside a 16-bit slab's
// three buffers a warpgroup.
using Fp8PingPong = Pipeline<5, 3, Fp8Config<192, 64>>;

static_assert(Config::kProducerRegisters + Config::kMathWarpgroups * Config::kMathRegisters <=
                  (Config::kMathWarpgroups + 1) * Config::kLaunchRegisters,
              "setmaxnreg: the warpgroups' registers exceed the CTA's pool");
static_assert(Fp8Ring::Cfg::kProducerRegisters + Fp8Ring::Cfg::kMathWarpgroups * Fp8Ring::Cfg::kMathRegisters <=
                  (Fp8Ring::Cfg::kMathWarpgroups + 1) * Fp8Ring::Cfg::kLaunchRegisters,
              "setmaxnreg: the FP8 warpgroups' registers exceed the CTA's pool");

}  // namespace moe::cuda::sm90
