// The per-tile machinery of the Hopper grouped GEMM's epilogues: a math warpgroup's 64-row slab
// of a tile (EpilogueSlab: addresses in the 128-byte-swizzled epilogue buffers, bias and row
// scales) and the batches that send accumulators out through those buffers with TMA stores
// (with_store_batches). The store epilogue (epilogue_store.cuh) and FC1's activation epilogues
// (epilogue_glu.cuh) are built on them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/ptx/pair16.cuh"
#include "cuda/ptx/sync.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/sm90/config.hpp"
#include "cuda/sm90/params.hpp"
#include "cuda/sm90/ring.cuh"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

// A math thread's place: lane, math warpgroup (its epilogue buffers and barrier; which 64 rows of
// the tile: ring.cuh's tile_slab), thread within it, and its warp's first row within the 64.
struct MathThread {
  uint32_t lane, math, wg_thread, warp_row;
};

// Writes two adjacent output values (columns c, c+1 of a row) to shared memory at `addr`.
template <class Out>
__device__ __forceinline__ void store_pair(uint32_t addr, float a, float b, Out*) {
  ptx::st_shared_b32(addr, Pair16<Out>::pack(a, b));
}
__device__ __forceinline__ void store_pair(uint32_t addr, float a, float b, float*) {
  ptx::st_shared_v2_f32(addr, a, b);
}

// The bias's element type: the input dtype for 16-bit GEMMs, bf16 for FP8 ones.
template <class In>
struct BiasTypeOf {
  using type = In;
};
template <>
struct BiasTypeOf<__nv_fp8_e4m3> {
  using type = __nv_bfloat16;
};

// One math warpgroup's slab of tile t in the epilogue: its addresses in the epilogue buffers, its
// bias (staged in shared memory) and row scales. Plain values: with references to the kernel's
// parameters and tile among its fields, the epilogues using it compiled to different code.
template <Form kForm, class In, class Out, class Pipe>
struct EpilogueSlab {
  using InType = typename BiasTypeOf<In>::type;  // what the epilogue reads in the input dtype: the bias
  using OutType = Out;
  using Cfg = typename Pipe::Cfg;
  static constexpr bool kKGrouped = kForm == Form::kWgrad;
  static constexpr bool kDgrad = kForm == Form::kDgrad;
  static constexpr int kBN = Cfg::kBlockN;
  static_assert(kBN <= 256, "the bias staging gives each of a warpgroup's 128 threads at most one pair of columns");
  static constexpr int kChunkCols = 128 / int(sizeof(Out));  // columns per 128-byte row (a multiple of 8)
  static constexpr int kGroupsPerChunk = kChunkCols / 8;     // 8-column accumulator groups per chunk
  static constexpr int kChunks = kBN / kChunkCols;
  static constexpr int kBatch = Pipe::kEpilogueBuffers < kChunks ? Pipe::kEpilogueBuffers : kChunks;  // per round trip
  static_assert(kChunks % kBatch == 0, "the slab's chunks must go out in whole batches");

  uint32_t opaque_lane, row_in_16, row_base, lane_bytes, swizzle;
  int32_t tile_row0;  // first row of this warpgroup's slab
  bool slab_live;
  float row_scale[2];
  uint32_t bias_tile, buffers;

  template <class Probe>
  __device__ __forceinline__ EpilogueSlab(const GemmParams& p, const SharedStorage<Pipe>& smem, const MathThread& th,
                                          const Tile& t, Probe& probe) {
    const uint32_t math = th.math, wg_thread = th.wg_thread, warp_row = th.warp_row;
    // Re-derived per tile behind an opaque asm: otherwise the compiler hoists every store address
    // out of the tile loop and runs out of registers (spills).
    opaque_lane = th.lane;
    asm volatile("" : "+r"(opaque_lane));
    row_in_16 = opaque_lane / 4;
    // This thread writes columns c, c+1 of rows r and r + 8, c = 8 jj + 2 (lane % 4). In a
    // 128-byte-swizzled row, byte b of row r lives at r * 128 + (b ^ ((r % 8) << 4)).
    row_base = (warp_row + row_in_16) * 128;
    lane_bytes = 2 * (opaque_lane % 4) * uint32_t(sizeof(Out));
    swizzle = (row_in_16 & 7u) << 4;  // rows r and r + 8 share r % 8
    // ring.cuh's tile_slab, written out: through the call, the fused dGLU epilogue's instances
    // compiled to a different schedule (+88 instructions) although the value is the same.
    if constexpr (Cfg::kStageConsumers == 1)  // a ping-pong tile's 64 rows are all its warpgroup's
      tile_row0 = t.m0;
    else
      tile_row0 = t.m0 + 64 * int32_t(math);
    const int32_t row_limit = kKGrouped ? p.m_out : t.rows;
    slab_live = tile_row0 < row_limit;
    row_scale[0] = row_scale[1] = 1.f;
    // This warpgroup's copy of the tile's bias columns (pairs of 16-bit values). Shared memory is
    // addressed explicitly (32-bit, st/ld.shared): through the aligned generic pointer the
    // compiler emits generic 64-bit loads and stores, which made the epilogue issue-bound.
    bias_tile = ptx::smem_address(smem.bias) + math * kBN * 2;
    if constexpr (kForm == Form::kForward) {
      // One pair of the tile's kBN bias columns per thread: all 128 threads for the 16-bit tile's
      // 256 columns, the first 64 for the FP8 tile's 128 (the others would write past this
      // warpgroup's staging, into the next one's or the barriers).
      if (p.bias != nullptr && (kBN == 256 || 2 * wg_thread < uint32_t(kBN))) {
        // n is even and n_out a multiple of 8 (TMA alignment): each pair is all in or all out.
        const int32_t n = t.n0 + 2 * int32_t(wg_thread);
        using Bias = InType;
        const Bias* bias = p.bias_table ? reinterpret_cast<const Bias*>(p.bias_table[t.group])
                                        : static_cast<const Bias*>(p.bias) + int64_t(t.group) * p.n_out;
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
    // Chunks go out in batches, one per epilogue buffer, with one pair of barriers per batch: the
    // epilogue is a chain of barrier -> shared stores -> proxy fence -> barrier -> TMA store, and
    // the tensor pipe idles for all of it (measured ~850 cycles per chunk with one chunk per trip).
    buffers = ptx::smem_address(smem.epilogue) + math * Pipe::kEpilogueBuffers * Config::kEpilogueBufferBytes;
    probe.begin_epilogue();
  }
};

// The store batches over a slab, for an epilogue's `finish` step: sets up the slab of tile t,
// defines the batch steps over it and calls finish(slab, run_batch, store_batch, batch_live).
//   run_batch(stage, issue): once the previous batch's (or tile's) stores have read the buffers,
//     `stage` fills them and `issue` (one thread) sends them out.
//   store_batch(batch, with_bias[, map]): batch `batch` of D's chunks: accumulators (+ bias) -> 16-
//     or 32-bit values in the swizzled buffers -> TMA stores, through D's map or (M-grouped forms)
//     `map`, a map of D's shape (the non-gated FC1 epilogue's act). The bias path is a separate
//     copy: its shared loads and FMAs tripled the staging when merely predicated off.
//   batch_live(batch): batch `batch` has columns inside D (uniform).
// The steps are lambdas over locals, defined here: so they compile as they did written out in the
// kernel. As member functions of the slab, or as lambdas over its fields or made in a function of
// their own, the same source compiled to 112 more SASS instructions in the fp32 forward and 1520
// fewer in FC1's GLU forward (store addresses recomputed in each batch, the act switch laid out
// differently): not the tuned code.
template <class Slab, class Pipe, class Probe, class Finish>
__device__ __forceinline__ void with_store_batches(const GemmParams& p, const SharedStorage<Pipe>& smem,
                                                   const MathThread& th, const Tile& t,
                                                   float (&acc)[Slab::kBN / 2], const CUtensorMap& map_d,
                                                   Probe& probe, Finish&& finish) {
  using In = typename Slab::InType;
  using Out = typename Slab::OutType;
  constexpr int kBatch = Slab::kBatch, kGroupsPerChunk = Slab::kGroupsPerChunk, kChunkCols = Slab::kChunkCols;
  const Slab s(p, smem, th, t, probe);
  const uint32_t math = th.math, wg_thread = th.wg_thread, opaque_lane = s.opaque_lane;
  const uint32_t row_base = s.row_base, lane_bytes = s.lane_bytes, swizzle = s.swizzle;
  const uint32_t bias_tile = s.bias_tile, buffers = s.buffers;
  const int32_t tile_row0 = s.tile_row0;
  const float(&row_scale)[2] = s.row_scale;
  auto run_batch = [&](auto&& stage, auto&& issue) {
    if (wg_thread == 0) ptx::bulk_wait_group_read<0>();
    probe.step(1);
    ptx::named_barrier_sync(1 + math, 128);
    probe.step(2);
    stage();
    probe.step(3);
    ptx::fence_proxy_async_shared();
    probe.step(4);
    ptx::named_barrier_sync(1 + math, 128);
    probe.step(5);
    if (wg_thread == 0) {
      issue();
      ptx::bulk_commit_group();
    }
    probe.step(6);
  };
  auto store_batch = [&](int batch, auto with_bias, const CUtensorMap* map = nullptr) {
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
        if constexpr (Slab::kKGrouped) {
          const CUtensorMap* md = p.d_maps ? p.d_maps + t.group : &map_d;  // per-expert dW
          const int32_t gd = p.d_maps ? 0 : t.group;
          if (p.reduce_add)
            ptx::tma_store_3d<true>(md, buffer, col0, tile_row0, gd);
          else
            ptx::tma_store_3d<false>(md, buffer, col0, tile_row0, gd);
        } else {
          const CUtensorMap* md = map != nullptr ? map : &map_d;
          const int32_t row = ragged_row(t, tile_row0), end = ragged_end(t);
          if (Slab::kDgrad && p.reduce_add)  // the dgrad adds into dx (the router's dx)
            ptx::tma_store_4d<true>(md, buffer, col0, row, end, int32_t(Config::kRaggedRows));
          else
            ptx::tma_store_4d<false>(md, buffer, col0, row, end, int32_t(Config::kRaggedRows));
        }
      }
    };
    run_batch(stage, issue);
  };
  auto batch_live = [&](int batch) { return t.n0 + batch * kBatch * kChunkCols < p.n_out; };
  finish(s, run_batch, store_batch, batch_live);
}

}  // namespace moe::cuda::sm90
