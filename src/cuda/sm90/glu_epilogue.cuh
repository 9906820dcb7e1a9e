// Activation epilogues of the Hopper grouped GEMM: the fused expert MLP (docs/design.md section 4).
// This file holds their per-row math; the epilogue types the kernel picks are in epilogue_glu.cuh.
// The GLUs':
//   forward (FC1): the caller has turned the accumulators into h = x W1^T + b1 rounded to the
//     input dtype (the values the unfused path stores); this computes act(gate, linear) * p
//     [T, F] into registers, 64 features at a time, and stages it for TMA stores. The epilogue
//     interleaves that math with the TMA stores of h when backward keeps h.
//   backward (FC2 dgrad): the accumulators hold d(act * p) for 256 features; with the saved h this
//     writes dh = dL/dh [T, 2F], the recomputed act * p (FC2's wgrad input) and, per row, the
//     tile's share of dprobs (reduced over the tiles in a fixed order by a separate kernel).
// Non-gated activations (srelu, gelu_tanh) do the same over FC1's F columns, one feature per column:
// act_in_place (forward) and backward_tile_elementwise.
// All compute exactly what the unfused activation kernels compute (common/glu_math.hpp, same
// roundings).
//
// Accumulators of a math warpgroup (64 x 256 fp32 over 128 threads): acc[4j + 2h + e] holds row
// lane / 4 + 8h of the warp's 16 and column 8j + 2q + e, q = lane % 4, j < 32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/glu_math.hpp"
#include "cuda/ptx/pair16.cuh"
#include "cuda/ptx/sync.cuh"
#include "cuda/sm90/glu_params.hpp"

namespace moe::cuda::sm90 {
namespace glu {

// This thread's two rows of a tile: pointers are only dereferenced where ok[h].
struct Rows {
  int64_t row;    // global index of row h = 0 (row h = 1 is row + 8)
  bool ok[2];     // inside the group
  float p[2];     // router probs (1 without probs)
};

// The Rows of a thread whose first row is `in_slab` of the math warpgroup's slab, which starts at
// row `slab_row0` of a tile of `tile_rows` rows (its group's part) starting at global row `row_begin`.
__device__ __forceinline__ Rows rows_of(const GluEpilogueParams& g, int64_t row_begin, int32_t tile_rows,
                                        int32_t slab_row0, uint32_t in_slab) {
  Rows rows;
  rows.row = row_begin + slab_row0 + int32_t(in_slab);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    rows.ok[h] = slab_row0 + int32_t(in_slab + 8 * h) < tile_rows;
    rows.p[h] = rows.ok[h] && g.probs != nullptr ? __ldg(g.probs + rows.row + 8 * h) : 1.f;
  }
  return rows;
}

// The dprobs shares of a 256-feature tile: the quad holds each row's 256 features; a fixed
// butterfly, then lane q = 0 writes.
__device__ __forceinline__ void store_dprobs_shares(float (&dp)[2], const GluEpilogueParams& g, const Rows& rows,
                                                    int32_t tile_index, uint32_t q) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dp[h] += __shfl_xor_sync(0xffffffffu, dp[h], 1);
    dp[h] += __shfl_xor_sync(0xffffffffu, dp[h], 2);
    if (q == 0 && rows.ok[h]) g.dprobs_partial[(rows.row + 8 * h) * g.partial_stride + tile_index] = dp[h];
  }
}

// Forward: act * p for one 64-feature chunk of the tile (kChunk = 0 or 1), layout with block size
// kBlock (1: pairs), packed in 16-bit pairs for stage_act. A live warp's rows past the group's end
// are computed too, without branches (their A rows were zero-filled: the values are finite), and
// dropped by the TMA store.
template <int kBlock, int kChunk, class T>
__device__ __forceinline__ void act_chunk(const float (&acc)[128], const detail::GluMath<float>& math,
                                          const Rows& rows, uint32_t q, uint32_t (&out)[16]) {
  if constexpr (kBlock == 1) {
    // Gate and linear are the two columns of one accumulator pair: one feature per row and j,
    // feature 4j + q. Lanes q and q ^ 1 swap values so that each holds one pair of adjacent
    // features: the even lane row 0's, the odd lane row 1's.
    const bool even = (q & 1u) == 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int j = 16 * kChunk + i;
      const float v0 = math.forward(acc[4 * j], acc[4 * j + 1]) * rows.p[0];
      const float v1 = math.forward(acc[4 * j + 2], acc[4 * j + 3]) * rows.p[1];
      const float other0 = __shfl_xor_sync(0xffffffffu, v0, 1);
      const float other1 = __shfl_xor_sync(0xffffffffu, v1, 1);
      out[i] = even ? Pair16<T>::pack(v0, other0) : Pair16<T>::pack(other1, v1);
    }
  } else {
    static_assert(kBlock % 8 == 0 && 128 % kBlock == 0, "blocks of 8..128 columns");
    constexpr int kD = kBlock / 8;  // accumulator groups per half block
    // The n-th gate group of the tile (features 8n + 2q, + 1) is accumulator group
    // (n / kD) * 2 kD + n % kD; its linear partner is kD groups further.
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int n = 8 * kChunk + i;
      const int j = (n / kD) * 2 * kD + n % kD;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float a0 = math.forward(acc[4 * j + 2 * h], acc[4 * (j + kD) + 2 * h]) * rows.p[h];
        const float a1 = math.forward(acc[4 * j + 2 * h + 1], acc[4 * (j + kD) + 2 * h + 1]) * rows.p[h];
        out[2 * i + h] = Pair16<T>::pack(a0, a1);
      }
    }
  }
}

// Writes act_chunk's values into a 64-row x 128-byte, 128-byte-swizzled epilogue buffer (a TMA
// store box). `row` = this thread's first row * 128 bytes; rows r and r + 8 share `swizzle`.
template <int kBlock>
__device__ __forceinline__ void stage_act(const uint32_t (&v)[16], uint32_t buffer, uint32_t row, uint32_t swizzle,
                                          uint32_t q) {
  if constexpr (kBlock == 1) {
    const uint32_t r = buffer + row + (q & 1u) * 8 * 128;  // odd lanes hold row + 8
    const uint32_t lane_bytes = 2 * (q & ~1u);
#pragma unroll
    for (int i = 0; i < 16; ++i) ptx::st_shared_b32(r + ((8 * i + lane_bytes) ^ swizzle), v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) ptx::st_shared_b32(buffer + row + h * 8 * 128 + ((16 * i + 4 * q) ^ swizzle), v[2 * i + h]);
  }
}

// Backward over one 64 x 256 slab of d(act * p): features f0 + 8j + 2q + e, f0 = the tile's
// first; the layout is pairs or blocks of a power-of-two s >= 2. h was prefetched into L2 when
// the tile started.
template <bool kPairs, class T>
__device__ __forceinline__ void backward_tile(const float (&acc)[128], const GluEpilogueParams& g, const Rows& rows,
                                              int32_t f0, int32_t ffn, int32_t tile_index, uint32_t q) {
  // Gate column of feature f: (f / s) * 2s + f % s, s a power of two.
  auto gate_col = [&](int32_t f) { return ((f >> g.block_shift) << (g.block_shift + 1)) + (f & (g.block - 1)); };
  auto h_row = [&](int h) { return static_cast<const T*>(g.h) + (rows.row + 8 * h) * g.h_stride; };
  // h is read one group at a time, so each group waits for its loads (L2 hits: the tile's h was
  // prefetched). Measured slow (docs/performance-log.md); four groups' loads in flight at once
  // measured no faster.
  float dp[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int32_t f = f0 + 8 * j + 2 * int32_t(q);
    uint32_t gate[2], linear[2];  // packed (f, f + 1) pairs
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      gate[h] = linear[h] = 0u;
      if (!rows.ok[h] || f >= ffn) continue;
      if constexpr (kPairs) {
        // g(f), l(f), g(f + 1), l(f + 1): regroup into (g, g) and (l, l) pairs.
        const uint2 v = *reinterpret_cast<const uint2*>(h_row(h) + 2 * f);
        gate[h] = __byte_perm(v.x, v.y, 0x5410);
        linear[h] = __byte_perm(v.x, v.y, 0x7632);
      } else {
        const int32_t col = gate_col(f);
        gate[h] = *reinterpret_cast<const uint32_t*>(h_row(h) + col);
        linear[h] = *reinterpret_cast<const uint32_t*>(h_row(h) + col + g.block);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // d(act * p) rounded to T, as the unfused path stores it.
      float d0 = acc[4 * j + 2 * h], d1 = acc[4 * j + 2 * h + 1];
      round_pair<T>(d0, d1);
      if (!rows.ok[h] || f >= ffn) continue;
      const float2 gv = Pair16<T>::unpack(gate[h]), lv = Pair16<T>::unpack(linear[h]);
      float act0, dg0, dl0, act1, dg1, dl1;
      g.math.backward(gv.x, lv.x, d0 * rows.p[h], act0, dg0, dl0);
      g.math.backward(gv.y, lv.y, d1 * rows.p[h], act1, dg1, dl1);
      dp[h] += act0 * d0;
      dp[h] += act1 * d1;
      const int64_t r = rows.row + 8 * h;
      T* dhr = static_cast<T*>(g.dh) + r * g.dh_stride;
      if constexpr (kPairs) {
        const uint32_t lo = Pair16<T>::pack(dg0, dl0), hi = Pair16<T>::pack(dg1, dl1);
        *reinterpret_cast<uint2*>(dhr + 2 * f) = make_uint2(lo, hi);
      } else {
        const int32_t col = gate_col(f);
        *reinterpret_cast<uint32_t*>(dhr + col) = Pair16<T>::pack(dg0, dg1);
        *reinterpret_cast<uint32_t*>(dhr + col + g.block) = Pair16<T>::pack(dl0, dl1);
      }
      if (g.act != nullptr)
        *reinterpret_cast<uint32_t*>(static_cast<T*>(g.act) + r * g.act_stride + f) =
            Pair16<T>::pack(act0 * rows.p[h], act1 * rows.p[h]);
    }
  }
  if (g.dprobs_partial != nullptr) store_dprobs_shares(dp, g, rows, tile_index, q);  // uniform
}

// Non-gated: act = f(h) * p for the tile's 64-column chunk kChunk (0..3) in place in the
// accumulators (which hold h rounded to the input dtype): the chunk's 8 accumulator groups, both
// rows, both columns. The store batches then stage them as they staged h.
template <int kChunk, class Fn>
__device__ __forceinline__ void act_in_place(float (&acc)[128], const Fn& fn, const Rows& rows) {
#pragma unroll
  for (int jj = 0; jj < 8; ++jj)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& v = acc[4 * (8 * kChunk + jj) + 2 * h + e];
        v = fn.forward(v) * rows.p[h];
      }
}

// Non-gated backward over one 64 x 256 slab of d(act * p): features f0 + 8j + 2q + e, which are
// also h's and dh's columns (h prefetched into L2 when the tile started). As backward_tile: the
// unfused activation backward's values and roundings, dprobs shares per tile.
template <class T, class Fn>
__device__ __forceinline__ void backward_tile_elementwise(const float (&acc)[128], const GluEpilogueParams& g,
                                                          const Fn& fn, const Rows& rows, int32_t f0, int32_t ffn,
                                                          int32_t tile_index, uint32_t q) {
  float dp[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int32_t f = f0 + 8 * j + 2 * int32_t(q);
    uint32_t hv[2];  // packed (f, f + 1) pairs
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      hv[h] = 0u;
      if (rows.ok[h] && f < ffn)
        hv[h] = *reinterpret_cast<const uint32_t*>(static_cast<const T*>(g.h) + (rows.row + 8 * h) * g.h_stride + f);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // d(act * p) rounded to T, as the unfused path stores it.
      float d0 = acc[4 * j + 2 * h], d1 = acc[4 * j + 2 * h + 1];
      round_pair<T>(d0, d1);
      if (!rows.ok[h] || f >= ffn) continue;
      const float2 x = Pair16<T>::unpack(hv[h]);
      float act0, dh0, act1, dh1;
      fn.backward(x.x, d0 * rows.p[h], act0, dh0);
      fn.backward(x.y, d1 * rows.p[h], act1, dh1);
      dp[h] += act0 * d0;
      dp[h] += act1 * d1;
      const int64_t r = rows.row + 8 * h;
      *reinterpret_cast<uint32_t*>(static_cast<T*>(g.dh) + r * g.dh_stride + f) = Pair16<T>::pack(dh0, dh1);
      if (g.act != nullptr)
        *reinterpret_cast<uint32_t*>(static_cast<T*>(g.act) + r * g.act_stride + f) =
            Pair16<T>::pack(act0 * rows.p[h], act1 * rows.p[h]);
    }
  }
  if (g.dprobs_partial != nullptr) store_dprobs_shares(dp, g, rows, tile_index, q);  // uniform
}

}  // namespace glu
}  // namespace moe::cuda::sm90
