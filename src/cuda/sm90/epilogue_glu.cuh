// The activation epilogues of the Hopper grouped GEMM as epilogue types (the interface is at the top
// of epilogue_store.cuh); their per-row math is in glu_epilogue.cuh.
//   ForwardActivationEpilogue (FC1's forward): h = D + b1, stored if backward keeps it, and act * p.
//   BackwardActivationEpilogue (FC2's dgrad): d(act * p) -> dh, act * p recomputed, dprobs shares.
// Each for a GLU (kGated) or a non-gated activation.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/ptx/pair16.cuh"
#include "cuda/ptx/sync.cuh"
#include "cuda/ptx/tma.cuh"
#include "cuda/sm90/config.hpp"
#include "cuda/sm90/epilogue_slab.cuh"
#include "cuda/sm90/glu_epilogue.cuh"
#include "cuda/sm90/params.hpp"
#include "cuda/sm90/ring.cuh"
#include "cuda/sm90/scheduler.cuh"

namespace moe::cuda::sm90 {

// FC1's h = D + b1 (the bias pairs were staged by the slab), rounded to the input dtype as it is
// stored: the activation sees what backward will read.
template <class In, int kAccRegs>
__device__ __forceinline__ void add_bias_and_round(const GemmParams& p, float (&acc)[kAccRegs], uint32_t math,
                                                   uint32_t bias_tile, uint32_t q) {
  if (p.bias != nullptr) {
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
#pragma unroll
  for (int r = 0; r < kAccRegs; r += 2) round_pair<In>(acc[r], acc[r + 1]);
}

// FC1's forward: h = D + b1, stored if backward keeps it, and act * p.
//   kGated (a GLU): h (when kept) goes out in two batches of two 64-column chunks and act, half as
//     wide, in a third; each act chunk's math runs while the batch before it is being read by TMA.
//   Non-gated (srelu, gelu_tanh): act has h's F columns. The accumulators become act in place, chunk
//     by chunk, once h's batch holding them has been staged, and go out through act's map (map_e) in
//     h's own chunks and batches: with h, h0 | f(0, 1) | h1 | f(2) | act0 | f(3) | act1, each chunk's
//     math again under a batch being read. act's columns past F (= D's width) are dropped by the
//     batch's issue.
template <class In, class Pipe, bool kGated>
struct ForwardActivationEpilogue {
  using Slab = EpilogueSlab<Form::kForward, In, In, Pipe>;
  static constexpr int kAccRegs = Config::kBlockN / 2;
  static constexpr bool kLookUpAfter = false;
  static_assert(Slab::kBatch == 2 && Slab::kChunks == 4, "FC1's activation epilogue: h in two batches of two chunks");

  const GemmParams& p;
  const CUtensorMap& map_d;  // h
  const CUtensorMap& map_e;  // act
  const SharedStorage<Pipe>& smem;
  const MathThread& th;

  __device__ __forceinline__ void begin_tile(const Tile&) const {}
  __device__ __forceinline__ void after_step(const Tile&, int) const {}

  template <class Probe>
  __device__ __forceinline__ void store(const Tile& t, float (&acc)[kAccRegs], Probe& probe) const {
    if constexpr (kGated) {
      // The GLU step after the slab's setup. It copies the slab's values into locals for the
      // lambdas below to capture: lambdas over the slab's fields compiled to more instructions.
      auto finish = [&](const Slab& s, auto& run_batch, auto& store_batch, auto& batch_live) {
        const uint32_t math = th.math, warp_row = th.warp_row, row_in_16 = s.row_in_16;
        const uint32_t bias_tile = s.bias_tile, buffers = s.buffers, row_base = s.row_base, swizzle = s.swizzle;
        const int32_t tile_row0 = s.tile_row0;
        // Written out rather than glu::rows_of: through it, the same values compiled to another
        // schedule of the tuned GLU math below (8 instructions fewer, registers reassigned).
        glu::Rows rows;
        rows.row = t.row_begin + tile_row0 + int32_t(warp_row + row_in_16);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          rows.ok[h] = tile_row0 + int32_t(warp_row + row_in_16 + 8 * h) < t.rows;
          rows.p[h] = rows.ok[h] && p.glu.probs != nullptr ? __ldg(p.glu.probs + rows.row + 8 * h) : 1.f;
        }
        const uint32_t q = s.opaque_lane % 4;
        add_bias_and_round<In>(p, acc, math, bias_tile, q);
        // h (when kept) goes out in two batches of two 64-column chunks and act in a third; the
        // activation math of each act chunk runs while the batch before it is being read by TMA,
        // so no wait on the buffers is exposed. act's rows and columns past the group and past F
        // are dropped by its ragged map.
        auto glu_forward = [&](auto block) {
          constexpr int kBlock = decltype(block)::value;
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
        if (s.slab_live) {
          switch (p.glu.block) {
            case 1: glu_forward(std::integral_constant<int, 1>{}); break;
            case 8: glu_forward(std::integral_constant<int, 8>{}); break;
            case 16: glu_forward(std::integral_constant<int, 16>{}); break;
            case 32: glu_forward(std::integral_constant<int, 32>{}); break;
            case 64: glu_forward(std::integral_constant<int, 64>{}); break;
            default: glu_forward(std::integral_constant<int, 128>{}); break;
          }
        }
      };
      with_store_batches<Slab>(p, smem, th, t, acc, map_d, probe, finish);
    } else {
      auto finish = [&](const Slab& s, auto& run_batch, auto& store_batch, auto& batch_live) {
        (void)run_batch;
        const int32_t tile_row0 = s.tile_row0;
        const glu::Rows rows = glu::rows_of(p.glu, t.row_begin, t.rows, tile_row0, th.warp_row + s.row_in_16);
        add_bias_and_round<In>(p, acc, th.math, s.bias_tile, s.opaque_lane % 4);
        if (!s.slab_live) return;  // uniform
        // A warp whose 16 rows are all past the group's end skips the math (its values are dropped).
        const bool warp_live = tile_row0 + int32_t(th.warp_row) < t.rows;  // warp-uniform
        const bool second = batch_live(1);  // the tile has columns past its first 128 (uniform)
        auto act_forward = [&](const auto& fn) {
          if (p.glu.store_h) store_batch(0, std::false_type{});
          if (warp_live) {
            glu::act_in_place<0>(acc, fn, rows);
            glu::act_in_place<1>(acc, fn, rows);
          }
          if (p.glu.store_h && second) store_batch(1, std::false_type{});
          if (warp_live && second) glu::act_in_place<2>(acc, fn, rows);
          store_batch(0, std::false_type{}, &map_e);
          if (!second) return;
          if (warp_live) glu::act_in_place<3>(acc, fn, rows);
          store_batch(1, std::false_type{}, &map_e);
        };
        detail::with_elementwise<float>(p.glu.activation, act_forward);
      };
      with_store_batches<Slab>(p, smem, th, t, acc, map_d, probe, finish);
    }
  }
};

// FC2's dgrad: d(act * p) -> dh, act * p recomputed, dprobs shares; kGated: a GLU's dh has 2F
// columns (glu::backward_tile), else F (glu::backward_tile_elementwise).
template <class In, class Pipe, bool kGated>
struct BackwardActivationEpilogue {
  using Slab = EpilogueSlab<Form::kDgrad, In, In, Pipe>;
  static constexpr int kBN = Config::kBlockN;
  // The next tile is looked up after this epilogue, not under the mainloop: the epilogue needs
  // the registers the next tile would hold.
  static constexpr bool kLookUpAfter = true;
  static constexpr int32_t kHColumns = kGated ? 2 : 1;  // h's columns per feature
  // Built on shared tiles only (heuristics.hpp's activation_instance_exists): begin_tile's rows
  // are this warpgroup's half of a 128-row tile.
  static_assert(Pipe::Cfg::kStageConsumers == 2, "FC2's dGLU epilogue runs on the cooperative pipelines only");

  const GemmParams& p;
  const CUtensorMap& map_d;  // unused (D is never stored)
  const CUtensorMap& map_e;  // unused
  const SharedStorage<Pipe>& smem;
  const MathThread& th;

  // The epilogue reads this tile's h (1 KiB per row for a GLU): pull it into L2 under the mainloop.
  __device__ __forceinline__ void begin_tile(const Tile& t) const {
    const int32_t row = t.m0 + 64 * int32_t(th.math) + int32_t(th.wg_thread);
    const int32_t h_cols = min(kHColumns * kBN, kHColumns * (p.n_out - t.n0));
    if (th.wg_thread < 64 && row < t.rows)
      ptx::prefetch_l2(static_cast<const In*>(p.glu.h) + (t.row_begin + row) * p.glu.h_stride + kHColumns * t.n0,
                       uint32_t(h_cols) * uint32_t(sizeof(In)));
  }
  __device__ __forceinline__ void after_step(const Tile&, int) const {}

  template <class Probe>
  __device__ __forceinline__ void store(const Tile& t, float (&acc)[kBN / 2], Probe& probe) const {
    const Slab s(p, smem, th, t, probe);
    // This thread's two rows, with their router probs.
    const glu::Rows rows = glu::rows_of(p.glu, t.row_begin, t.rows, s.tile_row0, th.warp_row + s.row_in_16);
    const uint32_t q = s.opaque_lane % 4;
    if (!s.slab_live) return;
    const int32_t tile_index = t.n0 / kBN;
    if constexpr (kGated) {
      if (p.glu.block == 1)
        glu::backward_tile<true, In>(acc, p.glu, rows, t.n0, p.n_out, tile_index, q);
      else
        glu::backward_tile<false, In>(acc, p.glu, rows, t.n0, p.n_out, tile_index, q);
    } else {
      detail::with_elementwise<float>(p.glu.activation, [&](const auto& fn) {
        glu::backward_tile_elementwise<In>(acc, p.glu, fn, rows, t.n0, p.n_out, tile_index, q);
      });
    }
  }
};

}  // namespace moe::cuda::sm90
