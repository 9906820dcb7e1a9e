// The Hopper grouped GEMM: one persistent, warp-specialized kernel for the forward, dgrad and wgrad
// forms. Warpgroup 0 is the producer (one thread issues TMA loads into a kStages-deep ring of
// shared-memory stages guarded by full/empty mbarriers); warpgroups 1 and 2 each multiply 64 rows
// of the 128 x 256 tile with wgmma and store their results through swizzled shared memory with TMA.
//
// Blocks run in clusters of two that work on pairs of tiles (scheduler.cuh). When the pair shares
// its B tile, each block's producer loads one half of it and multicasts it into both blocks. So a
// stage may be refilled only once the consumers of *both* blocks have released it: every
// consumer warp arrives on the empty barrier of both blocks, for every step, multicast or not,
// which keeps the two blocks' barrier phases in lockstep.
//
// Group boundaries need no padding: token-indexed operands use "ragged" tensor maps (see
// tensor_maps.hpp) whose bounds end at the group's last row, so TMA zero-fills loads and clips
// stores there. Rows past offsets[G] belong to no group and are never written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/sync.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/ptx/wgmma.cuh"
#include "cuda/ptx/pair16.cuh"
#include "cuda/sm90/config.hpp"
#include "cuda/sm90/glu_epilogue.cuh"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

struct GemmParams {
  const int64_t* offsets;  // [G + 1] group offsets, sanitized on the device by GroupLayout
  int32_t num_groups;
  int32_t m_out;           // wgrad: rows of each D_g
  int32_t n_out;           // columns of D
  int32_t k;               // forward/dgrad: contraction length
  const void* bias;        // forward: [G, n_out] in the input dtype, or null
  const float* row_scale;  // forward: [T] scales of the bias ("scale_bias"), or null
  int32_t reduce_add;      // wgrad: add into D (fp32 main_grad) instead of storing
  int32_t multicast;       // 0: pairs never share B loads (an A/B switch for measurements)
  GluEpilogueParams glu;   // Epilogue::kGluForward / kGluBackward only
  // Per-expert tensors: one tensor map per group in device memory (group coordinate 0) replaces
  // the packed map (forward/dgrad: the weights; wgrad: D), and the bias comes from a device
  // pointer table (bias then points at the table too, so "has a bias" stays one test). Null: packed.
  const CUtensorMap* b_maps;
  const CUtensorMap* d_maps;
  const int64_t* bias_table;
};

#ifdef MOE_SM90_PROBE
// Diagnostics build only (-DMOE_SM90_PROBE): block 0's first math thread sums clock64() cycles per
// phase: [0] mainloop, [1] epilogue, [2] gap to the next tile's first full stage, [3] tiles,
// [4] k-steps. The launcher prints the per-tile averages after each launch.
// [8..15]: the epilogue's steps (setup, wait, barrier, shared stores, fence, barrier, store issue).
__device__ unsigned long long g_probe[16];  // [5..7]: timestamps in flight
#endif

namespace detail {

template <class In>
struct InputTraits;
template <>
struct InputTraits<__nv_bfloat16> {
  static constexpr bool kFp16 = false;
};
template <>
struct InputTraits<__half> {
  static constexpr bool kFp16 = true;
};

// Writes two adjacent output values (columns c, c+1 of a row) to shared memory at `addr`.
template <class Out>
__device__ __forceinline__ void store_pair(uint32_t addr, float a, float b, Out*) {
  ptx::st_shared_b32(addr, Pair16<Out>::pack(a, b));
}
__device__ __forceinline__ void store_pair(uint32_t addr, float a, float b, float*) {
  ptx::st_shared_v2_f32(addr, a, b);
}

// Coordinate of `row` (within a group of `rows` rows) in a ragged tensor map.
__device__ __forceinline__ int32_t ragged_row(const Tile& t, int32_t row) {
  return int32_t(Config::kRaggedRows) - t.rows + row;
}
__device__ __forceinline__ int32_t ragged_end(const Tile& t) { return int32_t(t.row_begin + t.rows); }

}  // namespace detail

template <Form kForm, class In, class Out, Epilogue kEpi = Epilogue::kStore, class Pipe = DeepRing>
__global__ void __launch_bounds__(Config::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_d,
                        const __grid_constant__ CUtensorMap map_e, const GemmParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace detail;
  static_assert(kEpi == Epilogue::kStore || (kEpi == Epilogue::kGluForward && kForm == Form::kForward) ||
                    (kEpi == Epilogue::kGluBackward && kForm == Form::kDgrad),
                "GLU epilogues: forward on FC1, backward on FC2's dgrad");
  constexpr bool kKGrouped = kForm == Form::kWgrad;
  constexpr int kTransA = kForm == Form::kWgrad ? 1 : 0;   // A MN-major (dY^T)
  constexpr int kTransB = kForm == Form::kForward ? 0 : 1;  // B MN-major (W for dgrad, X for wgrad)
  constexpr int kBM = Config::kBlockM, kBN = Config::kBlockN, kBK = Config::kBlockK;
  constexpr int kStages = Pipe::kStages;
  constexpr int kAccRegs = kBN / 2;  // 64 x kBN f32 accumulators over 128 threads

  extern __shared__ uint8_t shared_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* epilogue_smem = smem + kStages * Config::kStageBytes;
  uint8_t* bias_smem = epilogue_smem + Pipe::kEpilogueBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(bias_smem + Config::kBiasBytes);
  uint64_t* empty = full + kStages;
  // M-grouped: pairs before each group, for the scheduler's lookups (scheduler.cuh).
  const uint32_t prefix_smem = ptx::smem_address(empty + kStages);
  const bool prefix_in_smem = !kKGrouped && p.num_groups + 1 <= int32_t(Config::kOffsetSlots);
  auto stage_a = [&](int s) { return smem + s * Config::kStageBytes; };
  auto stage_b = [&](int s) { return smem + s * Config::kStageBytes + Config::kABytes; };

  const uint32_t warp = ptx::warp_index(), lane = ptx::lane_index();
  // Re-read from special registers where used, rather than held in registers across the loop.
  auto first_pair = [] { return int32_t(ptx::cluster_id_x()); };
  auto pair_stride = [] { return int32_t(ptx::cluster_count_x()); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      // One arrival per math warp of each block of the cluster.
      ptx::mbarrier_init(&empty[s], Config::kClusterSize * Config::kMathWarpgroups * 4);
    }
    ptx::fence_barrier_init();
  }
  if (threadIdx.x == 32) {
    ptx::prefetch_tensor_map(&map_a);
    ptx::prefetch_tensor_map(&map_b);
    ptx::prefetch_tensor_map(&map_d);
    if constexpr (kEpi == Epilogue::kGluForward) ptx::prefetch_tensor_map(&map_e);
  }
  auto make_scheduler = [&] {
    if constexpr (kKGrouped)
      return KGroupedScheduler(p.offsets, p.num_groups, p.m_out, p.n_out);
    else
      return MGroupedScheduler(p.offsets, prefix_in_smem ? prefix_smem : 0u, p.num_groups, p.n_out, p.k);
  };
  if constexpr (!kKGrouped) {
    if (prefix_in_smem && warp == 1) make_scheduler().fill_prefix(lane);
  }
  // The peer block's barriers must be initialized before anything arrives on them (and the
  // prefix filled before any lookup).
  ptx::cluster_sync();

  // A consumer warp releases a stage in both blocks (see the top of this file).
  auto release = [&](int s) {
    if (lane == 0) {
#pragma unroll
      for (uint32_t r = 0; r < Config::kClusterSize; ++r) ptx::mbarrier_arrive_cluster(&empty[s], r);
    }
  };
  // Accumulating into main_grad: an empty group contributes nothing and its tiles are skipped.
  auto skipped = [&](const Tile& t) { return kKGrouped && p.reduce_add && t.k_blocks == 0; };

  if (warp < 4) {
    // ---------------- producer warpgroup ----------------
    ptx::setmaxnreg_decrease<Config::kProducerRegisters>();
    if (warp == 0 && lane == 0) {
      auto scheduler = make_scheduler();
      int stage = 0;
      uint32_t phase = 0;
      Tile t;
      for (int32_t i = first_pair(); scheduler.get(i, t); i += pair_stride()) {
        if (skipped(t)) continue;
        for (int kb = 0; kb < t.k_blocks; ++kb) {
          ptx::mbarrier_wait(&empty[stage], phase ^ 1u);
          // A ghost expects nothing: its arrival alone completes the phase.
          ptx::mbarrier_arrive_expect_tx(&full[stage], t.live ? Config::kStageBytes : 0u);
          if (t.live) {
            const int32_t k0 = kb * kBK;
            uint64_t* bar = &full[stage];
            // B comes in two halves of kBN / 2 columns: with multicast this block loads half
            // `rank` into both blocks (the peer loads the other), otherwise both halves locally.
            // Forward/dgrad weights: the packed map at group t.group, or expert t.group's own map.
            const CUtensorMap* mb = p.b_maps ? p.b_maps + t.group : &map_b;
            const int32_t gb = p.b_maps ? 0 : t.group;
            auto load_b_half = [&](int half, bool multicast) {
              uint8_t* dst = stage_b(stage) + half * (Config::kBBytes / 2);
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
                ptx::tma_load_4d(stage_a(stage) + panel * Config::kPanelBytes, &map_a, bar, t.m0 + 64 * panel,
                                 ragged_row(t, k0), ragged_end(t), int32_t(Config::kRaggedRows));
            } else {
              // A = rows m0..m0+127 of the group (K-major), zero past the group's end.
              ptx::tma_load_4d(stage_a(stage), &map_a, bar, k0, ragged_row(t, t.m0), ragged_end(t),
                               int32_t(Config::kRaggedRows));
            }
            if (t.multicast && p.multicast) {
              load_b_half(int(ptx::cluster_rank()), true);
            } else {
              load_b_half(0, false);
              load_b_half(1, false);
            }
          }
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
          }
        }
      }
    }
    // Neither block may exit while the other can still multicast into it or arrive on its barriers.
    ptx::cluster_sync();
    return;
  }

  // ---------------- math warpgroups ----------------
  ptx::setmaxnreg_increase<Config::kMathRegisters>();
  const uint32_t math = warp / 4 - 1;          // which 64 rows of the tile
  const uint32_t wg_thread = threadIdx.x - 128 * (math + 1);
  const uint32_t warp_row = 16 * (warp % 4);   // this warp's 16 rows within the 64

  // Descriptor bases (low word varies by stage and k step).
  constexpr uint32_t kLeadA = kTransA ? Config::kPanelBytes : 0;
  constexpr uint32_t kLeadB = kTransB ? Config::kPanelBytes : 0;
  constexpr uint32_t kStepA = kTransA ? 16 * 128 : 32;  // bytes per k16 step
  constexpr uint32_t kStepB = kTransB ? 16 * 128 : 32;
  const uint32_t a_offset = kTransA ? math * Config::kPanelBytes : math * 64 * 128;

  using Wgmma = ptx::WgmmaSS<kBN, InputTraits<In>::kFp16>;
  float acc[kAccRegs];
  auto scheduler = make_scheduler();
  int stage = 0;
  uint32_t phase = 0;
  Tile t, next;
  int32_t pair = first_pair();
  for (bool have = scheduler.get(pair, t); have; t = next) {
    pair += pair_stride();
    if (skipped(t)) {
      have = scheduler.get(pair, next);
      continue;
    }
    if (!t.live) {  // a ghost: keep the barrier phases in step with the peer, nothing else
      for (int kb = 0; kb < t.k_blocks; ++kb) {
        ptx::mbarrier_wait(&full[stage], phase);
        release(stage);
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
      have = scheduler.get(pair, next);
      continue;
    }
    if constexpr (kEpi == Epilogue::kGluBackward) {
      // The epilogue reads this tile's h (1 KiB per row): pull it into L2 under the mainloop.
      const int32_t row = t.m0 + 64 * int32_t(math) + int32_t(wg_thread);
      const int32_t h_cols = min(2 * kBN, 2 * (p.n_out - t.n0));
      if (wg_thread < 64 && row < t.rows)
        ptx::prefetch_l2(static_cast<const In*>(p.glu.h) + (t.row_begin + row) * p.glu.h_stride + 2 * t.n0,
                         uint32_t(h_cols) * uint32_t(sizeof(In)));
    }
    // Accumulating into main_grad: the epilogue's TMA reduce-adds read the old values. This
    // warpgroup's slab of them is pulled into L2 kMainGradLead k steps before the mainloop ends:
    // early enough to hide the DRAM reads, late enough not to crowd the operands out of L2.
    // Measured (s10, performance log): wgrad_acc -11% time over the suite with a lead of 2 or 4
    // steps (small batch -30%, qwen3 -10..-22%); at the tile's start the long-K GEMMs lost 3-7%.
    constexpr int kMainGradLead = 2;
    auto prefetch_main_grad = [&] {
      if constexpr (kKGrouped && std::is_same_v<Out, float>) {
        const int32_t slab_row = t.m0 + 64 * int32_t(math);
        if (p.reduce_add && wg_thread == 0 && slab_row < p.m_out) {
          const CUtensorMap* md = p.d_maps ? p.d_maps + t.group : &map_d;
          const int32_t gd = p.d_maps ? 0 : t.group;
          constexpr int32_t kBoxCols = 128 / int32_t(sizeof(float));  // the epilogue's store boxes
          for (int32_t col = t.n0; col < min(t.n0 + kBN, p.n_out); col += kBoxCols)
            ptx::tma_prefetch_3d(md, col, slab_row, gd);
        }
      }
    };
    // ---- mainloop ----
    int previous = -1;
#ifdef MOE_SM90_PROBE
    const bool probe = blockIdx.x == 0 && threadIdx.x == 128;
#endif
    // M-grouped forms look the next tile up under the mainloop, at step kLookupStep (or after the
    // last): its ~1k cycles of dependent loads then no longer sit between two tiles. Not wgrad:
    // the small batch's short wgrad tiles measured 4-7% slower with it (s7). Not the dGLU
    // epilogue, which looks up after itself: it needs the registers the next tile would hold.
    constexpr bool kEarlyLookup = !kKGrouped && kEpi != Epilogue::kGluBackward;
    constexpr int kLookupStep = 4;
    for (int kb = 0; kb < t.k_blocks; ++kb) {
      ptx::mbarrier_wait(&full[stage], phase);
#ifdef MOE_SM90_PROBE
      if (kb == 0 && probe) {
        const unsigned long long now = clock64();
        if (g_probe[7]) atomicAdd(&g_probe[2], now - g_probe[7]);
        g_probe[6] = now;
      }
#endif
      const uint32_t a_base = ptx::smem_address(stage_a(stage)) + a_offset;
      const uint32_t b_base = ptx::smem_address(stage_b(stage));
      ptx::fence_accumulators(acc);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const uint64_t da = ptx::smem_descriptor(a_base + kk * kStepA, kLeadA, 1024);
        const uint64_t db = ptx::smem_descriptor(b_base + kk * kStepB, kLeadB, 1024);
        Wgmma::template mma<kTransA, kTransB>(acc, da, db, (kb > 0 || kk > 0) ? 1u : 0u);
      }
      ptx::wgmma_commit_group();
      ptx::fence_accumulators(acc);
      // The group before this one has retired: its stage can be refilled.
      ptx::wgmma_wait_group<1>();
      if (previous >= 0) release(previous);
      previous = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1u;
      }
      if (kEarlyLookup && kb == kLookupStep) have = scheduler.get(pair, next);
      if (kb == max(t.k_blocks - kMainGradLead, 0)) prefetch_main_grad();
    }
    ptx::wgmma_wait_group<0>();
    ptx::fence_accumulators(acc);
#ifdef MOE_SM90_PROBE
    if (probe) {
      const unsigned long long now = clock64();
      atomicAdd(&g_probe[0], now - g_probe[6]);
      g_probe[5] = now;
      atomicAdd(&g_probe[3], 1ull);
      atomicAdd(&g_probe[4], (unsigned long long)t.k_blocks);
    }
#endif
    if (previous >= 0) release(previous);
    const bool looked_up = kEarlyLookup && t.k_blocks > kLookupStep;
    if (kEpi != Epilogue::kGluBackward && !looked_up) have = scheduler.get(pair, next);
    if (kKGrouped && t.k_blocks == 0) {  // an empty wgrad group writes zeros (no wgmma in flight)
#pragma unroll
      for (int r = 0; r < kAccRegs; ++r) acc[r] = 0.f;
    }

    // ---- epilogue: registers -> swizzled shared memory -> TMA store, 128 bytes of columns at a time ----
    // Re-derived per tile behind an opaque asm: otherwise the compiler hoists every store address
    // out of the tile loop and runs out of registers (spills).
    uint32_t opaque_lane = lane;
    asm volatile("" : "+r"(opaque_lane));
    const uint32_t row_in_16 = opaque_lane / 4;
    // This thread writes columns c, c+1 of rows r and r + 8, c = 8 jj + 2 (lane % 4). In a
    // 128-byte-swizzled row, byte b of row r lives at r * 128 + (b ^ ((r % 8) << 4)).
    const uint32_t row_base = (warp_row + row_in_16) * 128;
    const uint32_t lane_bytes = 2 * (opaque_lane % 4) * uint32_t(sizeof(Out));
    const uint32_t swizzle = (row_in_16 & 7u) << 4;  // rows r and r + 8 share r % 8
    const int32_t tile_row0 = t.m0 + 64 * int32_t(math);  // first row of this warpgroup's slab
    const int32_t row_limit = kKGrouped ? p.m_out : t.rows;
    const bool slab_live = tile_row0 < row_limit;
    float row_scale[2] = {1.f, 1.f};
    // This warpgroup's copy of the tile's bias columns (pairs of 16-bit values). Shared memory is
    // addressed explicitly (32-bit, st/ld.shared): through the aligned generic pointer the
    // compiler emits generic 64-bit loads and stores, which made the epilogue issue-bound.
    const uint32_t bias_tile = ptx::smem_address(bias_smem) + math * Config::kBlockN * 2;
    if constexpr (kForm == Form::kForward) {
      if (p.bias != nullptr) {
        // n is even and n_out a multiple of 8 (TMA alignment): each pair is all in or all out.
        const int32_t n = t.n0 + 2 * int32_t(wg_thread);
        const In* bias = p.bias_table ? reinterpret_cast<const In*>(p.bias_table[t.group])
                                      : static_cast<const In*>(p.bias) + int64_t(t.group) * p.n_out;
        ptx::st_shared_b32(bias_tile + 4 * wg_thread,
                           n < p.n_out ? __ldg(reinterpret_cast<const uint32_t*>(bias + n)) : 0u);
      }
      if (p.row_scale) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int32_t r = tile_row0 + int32_t(warp_row + row_in_16 + 8 * h);
          row_scale[h] = r < t.rows ? __ldg(p.row_scale + t.row_begin + r) : 0.f;
        }
      }
    }
    constexpr int kChunkCols = 128 / int(sizeof(Out));  // columns per 128-byte row (a multiple of 8)
    constexpr int kGroupsPerChunk = kChunkCols / 8;     // 8-column accumulator groups per chunk
    constexpr int kChunks = kBN / kChunkCols;
    constexpr int kBatch = Pipe::kEpilogueBuffers < kChunks ? Pipe::kEpilogueBuffers : kChunks;  // per round trip
    // Chunks go out in batches, one per epilogue buffer, with one pair of barriers per batch: the
    // epilogue is a chain of barrier -> shared stores -> proxy fence -> barrier -> TMA store, and
    // the tensor pipe idles for all of it (measured ~850 cycles per chunk with one chunk per trip).
    const uint32_t buffers =
        ptx::smem_address(epilogue_smem) + math * Pipe::kEpilogueBuffers * Config::kEpilogueBufferBytes;
#ifdef MOE_SM90_PROBE
    uint32_t probe_last = uint32_t(g_probe[5]);
    auto probe_step = [&](int k) {
      if (probe) {
        const uint32_t now = uint32_t(clock64());
        atomicAdd(&g_probe[8 + k], (unsigned long long)(now - probe_last));
        probe_last = now;
      }
    };
#else
    auto probe_step = [](int) {};
#endif
    probe_step(0);
    // One batch: once the previous batch's (or tile's) stores have read the buffers, `stage`
    // fills them and `issue` (one thread) sends them out.
    auto run_batch = [&](auto&& stage, auto&& issue) {
      if (wg_thread == 0) ptx::bulk_wait_group_read<0>();
      probe_step(1);
      ptx::named_barrier_sync(1 + math, 128);
      probe_step(2);
      stage();
      probe_step(3);
      ptx::fence_proxy_async_shared();
      probe_step(4);
      ptx::named_barrier_sync(1 + math, 128);
      probe_step(5);
      if (wg_thread == 0) {
        issue();
        ptx::bulk_commit_group();
      }
      probe_step(6);
    };
    // Batch `batch` of D's chunks: accumulators (+ bias) -> 16- or 32-bit values in the swizzled
    // buffers -> TMA stores. The bias path is a separate copy: its shared loads and FMAs tripled
    // the staging when merely predicated off.
    auto store_batch = [&](int batch, auto with_bias) {
      auto stage = [&] {
#pragma unroll
        for (int c = 0; c < kBatch; ++c) {
          const int chunk = batch * kBatch + c;
          const uint32_t buffer = buffers + c * Config::kEpilogueBufferBytes;
#pragma unroll
          for (int jj = 0; jj < kGroupsPerChunk; ++jj) {
            const int j = chunk * kGroupsPerChunk + jj;
            const uint32_t offset = row_base + ((jj * 8 * uint32_t(sizeof(Out)) + lane_bytes) ^ swizzle);
            float b0 = 0.f, b1 = 0.f;
            if constexpr (decltype(with_bias)::value) {
              const float2 b = Pair16<In>::unpack(
                  ptx::ld_shared_b32(bias_tile + 4 * ((chunk * kChunkCols + jj * 8) / 2 + opaque_lane % 4)));
              b0 = b.x;
              b1 = b.y;
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
              if constexpr (decltype(with_bias)::value) {
                v0 += row_scale[h] * b0;
                v1 += row_scale[h] * b1;
              }
              store_pair(buffer + offset + h * 8 * 128, v0, v1, static_cast<Out*>(nullptr));
            }
          }
        }
      };
      auto issue = [&] {
#pragma unroll
        for (int c = 0; c < kBatch; ++c) {
          const int32_t col0 = t.n0 + (batch * kBatch + c) * kChunkCols;
          if (col0 >= p.n_out) break;
          const uint32_t buffer = buffers + c * Config::kEpilogueBufferBytes;
          if constexpr (kKGrouped) {
            const CUtensorMap* md = p.d_maps ? p.d_maps + t.group : &map_d;  // per-expert dW
            const int32_t gd = p.d_maps ? 0 : t.group;
            if (p.reduce_add)
              ptx::tma_store_3d<true>(md, buffer, col0, tile_row0, gd);
            else
              ptx::tma_store_3d<false>(md, buffer, col0, tile_row0, gd);
          } else {
            ptx::tma_store_4d(&map_d, buffer, col0, ragged_row(t, tile_row0), ragged_end(t),
                              int32_t(Config::kRaggedRows));
          }
        }
      };
      run_batch(stage, issue);
    };
    // Batch `batch` has columns inside D (uniform).
    auto batch_live = [&](int batch) { return t.n0 + batch * kBatch * kChunkCols < p.n_out; };

    if constexpr (kEpi != Epilogue::kStore) {
      glu::Rows rows;
      rows.row = t.row_begin + tile_row0 + int32_t(warp_row + row_in_16);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        rows.ok[h] = tile_row0 + int32_t(warp_row + row_in_16 + 8 * h) < t.rows;
        rows.p[h] = rows.ok[h] && p.glu.probs != nullptr ? __ldg(p.glu.probs + rows.row + 8 * h) : 1.f;
      }
      const uint32_t q = opaque_lane % 4;
      if constexpr (kEpi == Epilogue::kGluForward) {
        if (p.bias != nullptr) {  // h = D + b1 (the bias pairs were staged above)
          ptx::named_barrier_sync(1 + math, 128);
#pragma unroll
          for (int j = 0; j < kAccRegs / 4; ++j) {
            const float2 b = Pair16<In>::unpack(ptx::ld_shared_b32(bias_tile + 4 * (4 * j + q)));
            acc[4 * j] += b.x;
            acc[4 * j + 1] += b.y;
            acc[4 * j + 2] += b.x;
            acc[4 * j + 3] += b.y;
          }
          ptx::named_barrier_sync(1 + math, 128);  // bias reads done before the next tile stages
        }
        // h as stored (16-bit): the activation sees what backward will read.
#pragma unroll
        for (int r = 0; r < kAccRegs; r += 2) round_pair<In>(acc[r], acc[r + 1]);
        // h (when kept) goes out in two batches of two 64-column chunks and act in a third; the
        // activation math of each act chunk runs while the batch before it is being read by TMA,
        // so no wait on the buffers is exposed. act's rows and columns past the group and past F
        // are dropped by its ragged map.
        auto glu_forward = [&](auto block) {
          constexpr int kBlock = decltype(block)::value;
          static_assert(kBatch == 2 && kChunks == 4, "FC1's GLU epilogue: h in two batches of two chunks");
          // A warp whose 16 rows are all past the group's end skips the math (it would share
          // its SM sub-partition's MUFU with a live warp of the other warpgroup).
          const bool warp_live = tile_row0 + int32_t(warp_row) < t.rows;  // warp-uniform
          uint32_t act0[16] = {}, act1[16] = {};
          if (p.glu.store_h) store_batch(0, std::false_type{});
          if (warp_live) glu::act_chunk<kBlock, 0, In>(acc, p.glu.math, rows, q, act0);
          if (p.glu.store_h && batch_live(1)) store_batch(1, std::false_type{});
          if (warp_live) glu::act_chunk<kBlock, 1, In>(acc, p.glu.math, rows, q, act1);
          const int32_t f0 = t.n0 / 2, ffn = p.n_out / 2;  // the tile's first feature; F
          run_batch(
              [&] {
                glu::stage_act<kBlock>(act0, buffers, row_base, swizzle, q);
                glu::stage_act<kBlock>(act1, buffers + Config::kEpilogueBufferBytes, row_base, swizzle, q);
              },
              [&] {
#pragma unroll
                for (int c = 0; c < 2; ++c)
                  if (f0 + 64 * c < ffn)
                    ptx::tma_store_4d(&map_e, buffers + c * Config::kEpilogueBufferBytes, f0 + 64 * c,
                                      ragged_row(t, tile_row0), ragged_end(t), int32_t(Config::kRaggedRows));
              });
        };
        if (slab_live) {
          switch (p.glu.block) {
            case 1: glu_forward(std::integral_constant<int, 1>{}); break;
            case 8: glu_forward(std::integral_constant<int, 8>{}); break;
            case 16: glu_forward(std::integral_constant<int, 16>{}); break;
            case 32: glu_forward(std::integral_constant<int, 32>{}); break;
            case 64: glu_forward(std::integral_constant<int, 64>{}); break;
            default: glu_forward(std::integral_constant<int, 128>{}); break;
          }
        }
      } else {
        if (slab_live) {
          const int32_t tile_index = t.n0 / kBN;
          if (p.glu.block == 1)
            glu::backward_tile<true, In>(acc, p.glu, rows, t.n0, p.n_out, tile_index, q);
          else
            glu::backward_tile<false, In>(acc, p.glu, rows, t.n0, p.n_out, tile_index, q);
        }
        have = scheduler.get(pair, next);
      }
    } else {
#pragma unroll
      for (int batch = 0; batch < kChunks / kBatch; ++batch) {
        if (!slab_live || !batch_live(batch)) break;  // uniform
        if (kForm == Form::kForward && p.bias != nullptr)
          store_batch(batch, std::true_type{});
        else
          store_batch(batch, std::false_type{});
      }
    }
#ifdef MOE_SM90_PROBE
    if (probe) {
      const unsigned long long now = clock64();
      atomicAdd(&g_probe[1], now - g_probe[5]);
      g_probe[7] = now;
    }
#endif
  }
  if (wg_thread == 0) ptx::bulk_wait_group_all();
  ptx::cluster_sync();
#endif
}

}  // namespace moe::cuda::sm90
