// The FP8 expert MLP's backward step between FC2's dgrad and the weight gradients, from the kept h
// (FP8 rows) and d(act * p) (FC2 dgrad's output), in one of two passes:
// - one pass (fp8_glu_backward_quantize_kernel): h dequantized, the GLU backward, and dL/dh
//   quantized by rows (FC1 dgrad's operand) and by columns (FC1 wgrad's), act * p recomputed and
//   quantized by columns (FC2 wgrad's), dprobs' per-128-column shares; the bytes and scales of
//   dequantize_fp8, glu_backward and the quantizers;
// - rows (fp8_glu_backward_rows_kernel): h dequantized and the GLU backward, dL/dh and act * p out
//   in the activation dtype for the quantizers that follow; the bytes of dequantize_fp8 and
//   glu_backward.
// dprobs differs from glu_backward's in its last bits only (its shares are added in order).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/fp8_math.hpp"
#include "common/glu_math.hpp"
#include "cuda/backend.hpp"
#include "cuda/kernels/fp8_glu_pass.cuh"
#include "cuda/kernels/group_search.cuh"
#include "cuda/kernels/fp8_tile_stream.cuh"
#include "cuda/ptx/pair16.cuh"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/resident_blocks.cuh"

namespace moe::cuda {
namespace {

using namespace glu_pass;

template <class T>
__device__ __forceinline__ void load4(const T* p, float (&v)[4]) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 w = *reinterpret_cast<const float4*>(p);
    v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
  } else {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    v[0] = __uint_as_float(w.x << 16), v[1] = __uint_as_float(w.x & 0xffff0000u);
    v[2] = __uint_as_float(w.y << 16), v[3] = __uint_as_float(w.y & 0xffff0000u);
  }
}

// The warp's sum in a fixed butterfly (deterministic).
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
  for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}

// ---- one pass ----

struct GluBackwardQuantizeParams {
  const uint8_t* h_data;  // the kept h, rows [T, 2F] and scales [ceil(2F/128), S]
  int64_t h_data_ld;
  const float* h_scales;
  int64_t h_scales_ld;
  const void* d_act;  // d(act * p) [T, F]
  int64_t d_act_ld;
  const float* probs;
  const int64_t* offsets;  // the routing's [G + 1]
  const int64_t* column_offsets;  // the columnwise layout's [G + 1] (written by an earlier quantizer)
  int64_t num_groups, column_blocks;  // column_blocks: C / 128
  int32_t ffn, block;
  detail::GluMath<float> math;
  uint8_t* dh_rows;  // null: no dx
  int64_t dh_rows_ld;
  float* dh_row_scales;
  int64_t dh_row_scales_ld;
  uint8_t* dh_columns;  // [2F, C], scales [C / 128, 2F]
  int64_t dh_columns_ld;
  float* dh_column_scales;
  int64_t* dh_column_offsets;
  uint8_t* act_columns;  // [F, C], scales [C / 128, F]
  int64_t act_columns_ld;
  float* act_column_scales;
  int64_t* act_column_offsets;
  float* dprobs_partial;  // [T, partial_ld], share of h's column block kb at [r, kb]; null: no probs
  int64_t partial_ld;
  bool pow2;
  float epsilon;
};

// The dequantized values of 4 E4M3 bytes, rounded as dequantize_fp8 stores them in T.
template <class T>
__device__ __forceinline__ void dequantize4(uint32_t word, float scale, float (&v)[4]) {
  detail::e4m3x2_to_float(uint16_t(word & 0xffffu), v[0], v[1]);
  detail::e4m3x2_to_float(uint16_t(word >> 16), v[2], v[3]);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = detail::fp8_dequantize(v[i], scale);
  if constexpr (!std::is_same_v<T, float>) {
    round_pair<T>(v[0], v[1]);
    round_pair<T>(v[2], v[3]);
  }
}

template <class T>
__device__ __forceinline__ T from(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return __float2bfloat16_rn(v);
}

// Four values of T in one vector store (8 bytes for bf16, 16 for fp32).
template <class T>
__device__ __forceinline__ void store4(T* p, const T (&v)[4]) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    const auto bits = [&](int i) { return uint32_t(__bfloat16_as_ushort(v[i])); };
    *reinterpret_cast<uint2*>(p) = make_uint2(bits(0) | bits(1) << 16, bits(2) | bits(3) << 16);
  }
}

// One pass from the kept h to FC1's and FC2's backward operands, on the columns quantizer's layout
// (fp8_quantize_tokens.cu's quantize_columns_direct_kernel): a block of 512 threads takes one tile
// of 128 tokens of one expert (column block j of the columnwise layout) x one 128-column block kb of
// h (64 features). Warp w holds tokens 8 w .. 8 w + 7, half-warp hh tokens 8 w + 4 hh .. + 3, lane m
// h's columns 8 m .. 8 m + 7 of them: one 8-byte load of h a token, and the GLU backward of 4 of
// the features those columns belong to (the partner lane, which holds their other half, does the
// other 4, GluLanes::kPartner). dL/dh's rows are quantized from registers (quantize_row_slots); its
// columns and act's through column amaxes combined over the warps in shared memory and bytes
// transposed there, stored along the tokens. dprobs' share of the 64 features per token.
constexpr int kBackwardThreads = 512;
constexpr int kBackwardWarps = kBackwardThreads / 32;
constexpr int kActColumns = kFp8Block / 2;  // act's columns (features) of a tile

struct BackwardShared {
  uint32_t dh_transposed[kFp8Block * kFp8Block / 4];  // [h column][token word], word index swizzled
  uint32_t act_transposed[kActColumns * kFp8Block / 4];  // [feature][token word], swizzled
  uint32_t dh_partial[kBackwardWarps][kFp8Block / 2];  // per warp: packed bf16 column magnitudes
  uint32_t act_partial[kBackwardWarps][kActColumns / 2];
  float dh_multiplier[kFp8Block];
  float act_multiplier[kActColumns];
};

using DhColumns = fp8_tiles::TransposedTokens<8>;   // h's columns 8 m .. 8 m + 7: lane m's unit
using ActColumns = fp8_tiles::TransposedTokens<4>;  // the lane's 4 features

// A thread's inputs for one tile: per token, h's 8 bytes and scale, d(act * p) of its 4 features, p.
struct BackwardInputs {
  uint2 h[4];
  uint2 d[4];
  float h_scale[4], prob[4];
};

// kSwiGLU: the GLU's constants at compile time (GluMath::swiglu), the same values as p.math's.
template <GluLanes kLanes, bool kPairs, bool kSwiGLU>
__global__ void __launch_bounds__(kBackwardThreads, 1) fp8_glu_backward_quantize_kernel(const GluBackwardQuantizeParams p) {
  using T = __nv_bfloat16;
  const auto math = detail::GluMath<float>::fixed<kSwiGLU>(p.math);
  using V = fp8_tiles::Words<T>;
  static_assert(kLanes != GluLanes::kRuns, "a tile's h columns hold both halves of their features");
  __shared__ __align__(16) BackwardShared shared;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32, hh = lane / 16, m = lane % 16;
  const int64_t G = p.num_groups;
  if (blockIdx.x == 0)  // the columnwise copies share dy's expert offsets
    for (int64_t g = tid; g <= G; g += kBackwardThreads) {
      p.dh_column_offsets[g] = p.column_offsets[g];
      p.act_column_offsets[g] = p.column_offsets[g];
    }
  const int32_t h_blocks = (2 * p.ffn + kFp8Block - 1) / kFp8Block;
  int64_t begin, end;
  fp8_tiles::share_of(p.column_offsets[G] / kFp8Block * h_blocks, begin, end);
  if (begin >= end) return;  // block-uniform
  const fp8_tiles::Recipe recipe{p.pow2, p.epsilon};
  const int first_row = 8 * warp + 4 * hh;  // this thread's 4 tokens of the tile: first_row .. + 3
  // The lane's 4 features, relative to the h block's first (64 kb): pairs and blocks of 4, those of
  // its 8 columns; partners, the gate lane the first 4 of the 8 features its columns belong to, the
  // linear lane the last 4.
  bool is_gate = true;
  int feature_in_block;
  if constexpr (kLanes == GluLanes::kFour) {
    feature_in_block = 4 * m;
  } else {
    const int within = (8 * m) % (2 * p.block);
    is_gate = within < p.block;
    feature_in_block = (8 * m) / (2 * p.block) * p.block + within % p.block + (is_gate ? 0 : 4);
  }
  // Tile item's expert: the last g with column_offsets[g] <= 128 j (an empty expert's segment is
  // empty, so it is never the one); token0 and tokens of the tile.
  int64_t located = -1, token0 = 0;
  int tokens = 0;
  auto locate = [&](int64_t j) {
    if (j == located) return;
    located = j;
    const int64_t lo = group_at(p.column_offsets, G, j * kFp8Block);
    const int64_t into = j * kFp8Block - p.column_offsets[lo];
    token0 = p.offsets[lo] + into;
    const int64_t left = p.offsets[lo + 1] - p.offsets[lo] - into;
    tokens = int(left < kFp8Block ? left : kFp8Block);
  };
  auto load = [&](int64_t j, int kb, BackwardInputs& in) {
    locate(j);
    const int col = kb * kFp8Block + 8 * m;
    const bool col_in = col < 2 * p.ffn;  // 2F % 32 == 0: a lane's 8 columns are all in or all out
    const int64_t f = int64_t(kb) * kActColumns + feature_in_block;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int64_t r = token0 + first_row + s;
      const bool in_tile = first_row + s < tokens;
      in.h[s] = make_uint2(0, 0), in.d[s] = make_uint2(0, 0);
      in.h_scale[s] = 0.f, in.prob[s] = 1.f;
      if (in_tile && p.probs != nullptr) in.prob[s] = __ldg(p.probs + r);
      if (in_tile && col_in) {
        in.h[s] = __ldcs(reinterpret_cast<const uint2*>(p.h_data + r * p.h_data_ld + col));
        in.h_scale[s] = p.h_scales[kb * p.h_scales_ld + r];
        in.d[s] = __ldcs(reinterpret_cast<const uint2*>(static_cast<const T*>(p.d_act) + r * p.d_act_ld + f));
      }
    }
  };
  // The item's column block j and h block kb, advanced by one each item (no division in the loop).
  int64_t j = begin / h_blocks;
  int kb = int(begin - j * h_blocks);
  BackwardInputs in;
  load(j, kb, in);
#pragma unroll 1
  for (int64_t item = begin; item < end; ++item) {
    const int next_kb = kb + 1 == h_blocks ? 0 : kb + 1;
    const int64_t next_j = next_kb == 0 ? j + 1 : j;
    const int tile_tokens = tokens;
    const int64_t row0 = token0;
    const bool col_in = kb * kFp8Block + 8 * m < 2 * p.ffn;
    // ---- the GLU backward of the thread's 4 tokens x 4 features ----
    uint32_t dh[4][4], act[4][2];
    float dp[4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      float gate[4], linear[4];
      if constexpr (kLanes == GluLanes::kFour) {
        float a[4], b[4];
        dequantize4<T>(in.h[s].x, in.h_scale[s], a);
        dequantize4<T>(in.h[s].y, in.h_scale[s], b);
        if constexpr (kPairs) {
          gate[0] = a[0], linear[0] = a[1], gate[1] = a[2], linear[1] = a[3];
          gate[2] = b[0], linear[2] = b[1], gate[3] = b[2], linear[3] = b[3];
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) gate[i] = a[i], linear[i] = b[i];
        }
      } else {
        // The gate lane has the gate values of all 8 features and takes the linear values of the
        // first 4 from its partner; the linear lane the other way round for the last 4.
        const uint32_t other = __shfl_xor_sync(~0u, is_gate ? in.h[s].y : in.h[s].x, p.block / 8);
        dequantize4<T>(is_gate ? in.h[s].x : other, in.h_scale[s], gate);
        dequantize4<T>(is_gate ? other : in.h[s].y, in.h_scale[s], linear);
      }
      const float d[4] = {__uint_as_float(in.d[s].x << 16), __uint_as_float(in.d[s].x & 0xffff0000u),
                          __uint_as_float(in.d[s].y << 16), __uint_as_float(in.d[s].y & 0xffff0000u)};
      const float prob = in.prob[s];
      float dgate[4], dlinear[4], a[4];
      dp[s] = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float ai, dg, dl;
        math.backward(gate[i], linear[i], d[i] * prob, ai, dg, dl);
        dgate[i] = dg, dlinear[i] = dl, a[i] = ai * prob;  // rounded to T as they are packed
        dp[s] += ai * d[i];
      }
      auto pack = [](float lo, float hi) { return Pair16<T>::pack(lo, hi); };
      act[s][0] = pack(a[0], a[1]), act[s][1] = pack(a[2], a[3]);
      if constexpr (kLanes == GluLanes::kFour) {
        if constexpr (kPairs) {
#pragma unroll
          for (int i = 0; i < 4; ++i) dh[s][i] = pack(dgate[i], dlinear[i]);
        } else {
          dh[s][0] = pack(dgate[0], dgate[1]), dh[s][1] = pack(dgate[2], dgate[3]);
          dh[s][2] = pack(dlinear[0], dlinear[1]), dh[s][3] = pack(dlinear[2], dlinear[3]);
        }
      } else {
        // The gate lane's columns are the 8 features' dL/dgate (its 4, then the partner's), the
        // linear lane's their dL/dlinear (the partner's 4, then its own).
        const uint32_t mine0 = pack(dgate[0], dgate[1]), mine1 = pack(dgate[2], dgate[3]);
        const uint32_t lin0 = pack(dlinear[0], dlinear[1]), lin1 = pack(dlinear[2], dlinear[3]);
        const uint32_t got0 = __shfl_xor_sync(~0u, is_gate ? lin0 : mine0, p.block / 8);
        const uint32_t got1 = __shfl_xor_sync(~0u, is_gate ? lin1 : mine1, p.block / 8);
        dh[s][0] = is_gate ? mine0 : got0, dh[s][1] = is_gate ? mine1 : got1;
        dh[s][2] = is_gate ? got0 : lin0, dh[s][3] = is_gate ? got1 : lin1;
      }
    }
    // The next tile's inputs go out now, in flight through the quantization and the barriers.
    if (item + 1 < end) load(next_j, next_kb, in);
    // ---- dprobs' share: the half-warp's 64 features of each token, in a fixed butterfly ----
    if (p.dprobs_partial != nullptr) {  // uniform
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        float v = dp[s];
#pragma unroll
        for (int d = 8; d > 0; d /= 2) v += __shfl_xor_sync(~0u, v, d);
        if (m == 0 && first_row + s < tile_tokens) p.dprobs_partial[(row0 + first_row + s) * p.partial_ld + kb] = v;
      }
    }
    // ---- dL/dh by rows ----
    if (p.dh_rows != nullptr)  // uniform
      fp8_tiles::quantize_row_slots<T>(recipe, dh, p.dh_rows + (row0 + first_row) * p.dh_rows_ld + kb * kFp8Block + 8 * m,
                                       p.dh_rows_ld, p.dh_row_scales + kb * p.dh_row_scales_ld + row0 + first_row, 1,
                                       [&](int s) { return first_row + s < tile_tokens; }, col_in, lane);
    // ---- column amaxes: the thread's 4 tokens, the warp's 8, then every warp's ----
    {
      uint32_t c[4], ca[2];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        c[w] = V::max(V::max(V::magnitude(dh[0][w]), V::magnitude(dh[1][w])),
                      V::max(V::magnitude(dh[2][w]), V::magnitude(dh[3][w])));
        c[w] = V::max(c[w], __shfl_xor_sync(~0u, c[w], 16));
      }
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        ca[w] = V::max(V::max(V::magnitude(act[0][w]), V::magnitude(act[1][w])),
                       V::max(V::magnitude(act[2][w]), V::magnitude(act[3][w])));
        ca[w] = V::max(ca[w], __shfl_xor_sync(~0u, ca[w], 16));
      }
      if (hh == 0) {
        reinterpret_cast<uint4*>(shared.dh_partial[warp])[m] = make_uint4(c[0], c[1], c[2], c[3]);
        reinterpret_cast<uint2*>(shared.act_partial[warp])[feature_in_block / 4] = make_uint2(ca[0], ca[1]);
      }
    }
    __syncthreads();  // partials complete (and the previous tile's transposed bytes stored)
    if (tid < kFp8Block + kActColumns) {
      const bool is_dh = tid < kFp8Block;
      const int c = is_dh ? tid : tid - kFp8Block;
      uint32_t amax = 0;
#pragma unroll
      for (int w = 0; w < kBackwardWarps; ++w)
        amax = V::max(amax, is_dh ? shared.dh_partial[w][c / 2] : shared.act_partial[w][c / 2]);
      const detail::Fp8TileScale cs = recipe.scale(V::value_bits(amax, c % 2));
      if (is_dh) {
        shared.dh_multiplier[c] = cs.multiplier;
        if (kb * kFp8Block + c < 2 * p.ffn) p.dh_column_scales[j * 2 * int64_t(p.ffn) + kb * kFp8Block + c] = cs.scale;
      } else {
        shared.act_multiplier[c] = cs.multiplier;
        if (kb * kActColumns + c < p.ffn) p.act_column_scales[j * int64_t(p.ffn) + kb * kActColumns + c] = cs.scale;
      }
    }
    __syncthreads();  // multipliers complete; every partial read
    // ---- the columns' bytes, transposed: a word of 4 tokens per column ----
    {
      const uint32_t keep = fp8_tiles::tokens_kept(tile_tokens - first_row);
      const int word = first_row / 4;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const float mj = shared.dh_multiplier[8 * m + jj];
        const uint32_t q = fp8_tiles::e4m3x4(V::value(dh[0], jj) * mj, V::value(dh[1], jj) * mj,
                                             V::value(dh[2], jj) * mj, V::value(dh[3], jj) * mj);
        shared.dh_transposed[DhColumns::index(8 * m + jj, m, word)] = q & keep;
      }
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int c = feature_in_block + jj;
        const float mj = shared.act_multiplier[c];
        const uint32_t q = fp8_tiles::e4m3x4(V::value(act[0], jj) * mj, V::value(act[1], jj) * mj,
                                             V::value(act[2], jj) * mj, V::value(act[3], jj) * mj);
        shared.act_transposed[ActColumns::index(c, c / 4, word)] = q & keep;
      }
    }
    __syncthreads();  // the transposed tiles complete
    DhColumns::store<kFp8Block, kBackwardThreads>(
        shared.dh_transposed, 2 * p.ffn - kb * kFp8Block,
        p.dh_columns + int64_t(kb) * kFp8Block * p.dh_columns_ld + j * kFp8Block, p.dh_columns_ld);
    ActColumns::store<kActColumns, kBackwardThreads>(
        shared.act_transposed, p.ffn - kb * kActColumns,
        p.act_columns + int64_t(kb) * kActColumns * p.act_columns_ld + j * kFp8Block, p.act_columns_ld);
    j = next_j, kb = next_kb;
  }
}

// ---- rows only: the GLU backward from the kept FP8 h ----

struct GluBackwardRowsParams {
  const uint8_t* h_data;  // the kept h, rows [T, 2F] and scales [ceil(2F/128), S]
  int64_t h_data_ld;
  const float* h_scales;
  int64_t h_scales_ld;
  void* d_act;  // d(act * p) [T, F] in; act * p out (in place: each element read, then written, by one lane)
  int64_t d_act_ld;
  bool write_act;
  const float* probs;
  const int64_t* offsets;
  int64_t num_groups;
  int32_t ffn, block;
  detail::GluMath<float> math;
  void* dh;  // dL/dh [T, 2F]
  int64_t dh_ld;
  float* dprobs_partial;  // [T, partial_ld], share of feature block fb at [r, fb]; null: no probs
  int64_t partial_ld;
};

// dequantize_fp8(h) followed by glu_backward in one pass, with the same bytes (h dequantized and
// rounded to T as dequantize_fp8 stores it; the GLU backward's math and roundings), but for
// dprobs, whose per-128-feature shares are added in order by glu_dprobs_reduce. A warp per (row,
// 128 features) item as the forward pass: h's FP8 words and their scales, d(act * p) and the
// outputs move once, where the separate steps write and read h in T.
template <class T, bool kPairs>
__global__ void __launch_bounds__(kThreads) fp8_glu_backward_rows_kernel(const GluBackwardRowsParams p) {
  const int64_t rows = p.offsets[p.num_groups];
  const int32_t feature_blocks = (p.ffn + kFeatures - 1) / kFeatures;
  const int64_t items = rows * feature_blocks;
  const uint32_t lane = threadIdx.x % 32;
  const int64_t stride = int64_t(gridDim.x) * kWarps;
  const int64_t stride_rows = stride / feature_blocks;
  const int32_t stride_blocks = int32_t(stride - stride_rows * feature_blocks);
  int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  int64_t r = item / feature_blocks;
  int32_t fb = int32_t(item - r * feature_blocks);
  for (; item < items; item += stride) {  // warp-uniform
    const int32_t f = fb * kFeatures + 4 * int32_t(lane);
    const bool live = f < p.ffn;  // F % 16 == 0: a lane's four features are all in or all out
    float dp = 0.f;
    if (live) {
      // The lane's columns: pairs g, l, g, l.. from 2 f (one 128-column block); blocks 4 gate columns
      // from col and 4 linear ones s later (4 | s: each run of 4 lies in one block).
      const int32_t col = kPairs ? 2 * f : (f / p.block) * 2 * p.block + f % p.block;
      const int32_t col2 = kPairs ? col + 4 : col + p.block;
      const uint8_t* hr = p.h_data + r * p.h_data_ld;
      const uint32_t w0 = *reinterpret_cast<const uint32_t*>(hr + col);
      const uint32_t w1 = *reinterpret_cast<const uint32_t*>(hr + col2);
      const float s0 = p.h_scales[(col / kFp8Block) * p.h_scales_ld + r];
      const float s1 = p.h_scales[(col2 / kFp8Block) * p.h_scales_ld + r];
      T* dar = static_cast<T*>(p.d_act) + r * p.d_act_ld;
      float d[4];
      load4(dar + f, d);
      const float prob = p.probs != nullptr ? __ldg(p.probs + r) : 1.f;
      float gate[4], linear[4];
      if constexpr (kPairs) {
        float a[4], b[4];
        dequantize4<T>(w0, s0, a);
        dequantize4<T>(w1, s1, b);
        gate[0] = a[0], linear[0] = a[1], gate[1] = a[2], linear[1] = a[3];
        gate[2] = b[0], linear[2] = b[1], gate[3] = b[2], linear[3] = b[3];
      } else {
        dequantize4<T>(w0, s0, gate);
        dequantize4<T>(w1, s1, linear);
      }
      T dgate[4], dlinear[4], act[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float a, dg, dl;
        p.math.backward(gate[i], linear[i], d[i] * prob, a, dg, dl);
        dgate[i] = from<T>(dg);
        dlinear[i] = from<T>(dl);
        act[i] = from<T>(a * prob);
        dp += a * d[i];
      }
      T* dhr = static_cast<T*>(p.dh) + r * p.dh_ld;
      if constexpr (kPairs) {
        const T a[4] = {dgate[0], dlinear[0], dgate[1], dlinear[1]}, b[4] = {dgate[2], dlinear[2], dgate[3], dlinear[3]};
        store4(dhr + col, a);
        store4(dhr + col2, b);
      } else {
        store4(dhr + col, dgate);
        store4(dhr + col2, dlinear);
      }
      if (p.write_act) store4(dar + f, act);
    }
    if (p.dprobs_partial != nullptr) {  // uniform
      dp = lanes_sum(dp);
      if (lane == 0) p.dprobs_partial[r * p.partial_ld + fb] = dp;
    }
    r += stride_rows;
    fb += stride_blocks;
    if (fb >= feature_blocks) {
      fb -= feature_blocks;
      ++r;
    }
  }
}


template <GluLanes kLanes, bool kPairs, bool kSwiGLU>
void launch_backward(const GluBackwardQuantizeParams& p, int64_t items, int device, Stream stream) {
  constexpr auto kernel = fp8_glu_backward_quantize_kernel<kLanes, kPairs, kSwiGLU>;
  const int resident = resident_blocks<kernel>(device, kBackwardThreads, 0, "fp8_glu_backward_quantize_kernel");
  const unsigned blocks = unsigned(std::max<int64_t>(1, std::min<int64_t>(items, resident)));
  kernel<<<blocks, kBackwardThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH("fp8_glu_backward_quantize_kernel");
}


}  // namespace

bool fp8_glu_backward_quantize(const Fp8Rows& h, const TensorView& d_act, const TensorView& probs,
                               const GroupLayout& groups, const TensorView& column_offsets, const Fp8Rows& dh_rows,
                               const Fp8Columns& dh_columns, const Fp8Columns& act_columns, const TensorView& dprobs,
                               const TensorView& scratch, const GluSpec& spec, const Fp8Recipe& recipe, Stream stream) {
  const int64_t F = d_act.size(1), T = groups.capacity();
  if (!spec.gated()) return false;  // GLUs only: a non-gated activation takes the separate steps
  if (d_act.dtype() != DType::kBFloat16) return false;
  if (F % 16 != 0 || F >= (int64_t(1) << 30) || F == 0) return false;
  const int64_t s = spec.layout.block_size(F);
  // A tile's 128 columns of h hold both halves of their features: pairs, blocks of 4 (in the
  // lane), blocks of 8..64 dividing 64 (in the lane and its partner).
  const GluLanes lanes = glu_lanes(s);
  if (lanes != GluLanes::kFour && lanes != GluLanes::kPartner) return false;
  const int64_t h_blocks = (2 * F + kFp8Block - 1) / kFp8Block;
  if (dprobs.defined() && scratch.nbytes() < size_t(T * h_blocks) * sizeof(float)) return false;
  if (!rows_aligned(d_act, 8) || !rows_aligned(h.data, 8)) return false;
  if (dh_rows.data.defined() && !rows_aligned(dh_rows.data, 8)) return false;
  for (const Fp8Columns* c : {&dh_columns, &act_columns})
    if (!rows_aligned(c->data, 16)) return false;
  if (T == 0) return true;

  GluBackwardQuantizeParams p{};
  set_h_rows(p, h);
  p.d_act = d_act.data();
  p.d_act_ld = d_act.stride(0);
  p.probs = probs.defined() ? probs.data_as<float>() : nullptr;
  set_glu_fields(p, groups, F, s, spec);
  p.column_offsets = column_offsets.data_as<int64_t>();
  p.column_blocks = dh_columns.data.size(1) / kFp8Block;
  if (dh_rows.data.defined()) {
    p.dh_rows = static_cast<uint8_t*>(dh_rows.data.data());
    p.dh_rows_ld = dh_rows.data.stride(0);
    p.dh_row_scales = dh_rows.scales.data_as<float>();
    p.dh_row_scales_ld = dh_rows.scales.stride(0);
  }
  p.dh_columns = static_cast<uint8_t*>(dh_columns.data.data());
  p.dh_columns_ld = dh_columns.data.stride(0);
  p.dh_column_scales = dh_columns.scales.data_as<float>();
  p.dh_column_offsets = dh_columns.offsets.data_as<int64_t>();
  p.act_columns = static_cast<uint8_t*>(act_columns.data.data());
  p.act_columns_ld = act_columns.data.stride(0);
  p.act_column_scales = act_columns.scales.data_as<float>();
  p.act_column_offsets = act_columns.offsets.data_as<int64_t>();
  if (dprobs.defined()) {
    p.dprobs_partial = scratch.data_as<float>();
    p.partial_ld = h_blocks;
  }
  p.pow2 = recipe.pow2_scales;
  p.epsilon = recipe.amax_epsilon;
  const int64_t items = p.column_blocks * h_blocks;  // at most: the kernel reads the blocks in use
  const int device = d_act.device().index;
  detail::with_swiglu_constants(spec, [&](auto swiglu) {
    constexpr bool kSwiGLU = decltype(swiglu)::value;
    if (lanes == GluLanes::kPartner) launch_backward<GluLanes::kPartner, false, kSwiGLU>(p, items, device, stream);
    else if (s == 1) launch_backward<GluLanes::kFour, true, kSwiGLU>(p, items, device, stream);
    else launch_backward<GluLanes::kFour, false, kSwiGLU>(p, items, device, stream);
  });
  if (dprobs.defined()) glu_dprobs_reduce(p.dprobs_partial, h_blocks, h_blocks, groups, dprobs, stream);
  return true;
}

bool fp8_glu_backward_rows(const Fp8Rows& h, const TensorView& d_act, const TensorView& probs,
                           const GroupLayout& groups, const TensorView& dh, const TensorView& act,
                           const TensorView& dprobs, const TensorView& scratch, const GluSpec& spec, Stream stream) {
  const int64_t F = d_act.size(1), T = groups.capacity();
  if (!spec.gated()) return false;  // GLUs only: a non-gated activation takes the separate steps
  if (d_act.dtype() != DType::kBFloat16 && d_act.dtype() != DType::kFloat32) return false;
  if (dh.dtype() != d_act.dtype()) return false;
  if (act.defined() && act.data() != d_act.data()) return false;  // act is written in place of d_act
  if (F % 16 != 0 || F >= (int64_t(1) << 30) || F == 0) return false;
  const int64_t s = spec.layout.block_size(F);
  if (s != 1 && s % 4 != 0) return false;  // pairs, or runs of whole 4-column groups
  const int64_t feature_blocks = (F + kFeatures - 1) / kFeatures;
  if (dprobs.defined() && scratch.nbytes() < size_t(T * feature_blocks) * sizeof(float)) return false;
  const size_t esize = dtype_size(d_act.dtype());
  if (!rows_aligned(d_act, 4 * esize) || !rows_aligned(dh, 4 * esize) || !rows_aligned(h.data, 4)) return false;
  if (T == 0) return true;

  GluBackwardRowsParams p{};
  set_h_rows(p, h);
  p.d_act = d_act.data();
  p.d_act_ld = d_act.stride(0);
  p.write_act = act.defined();
  p.probs = probs.defined() ? probs.data_as<float>() : nullptr;
  set_glu_fields(p, groups, F, s, spec);
  p.dh = dh.data();
  p.dh_ld = dh.stride(0);
  if (dprobs.defined()) {
    p.dprobs_partial = scratch.data_as<float>();
    p.partial_ld = feature_blocks;
  }
  const int64_t items = T * feature_blocks;
  const int device = d_act.device().index;
  auto go = [&](auto type) {
    using T_ = decltype(type);
    constexpr const char* kName = "fp8_glu_backward_rows_kernel";
    if (s == 1) launch_warp_items<fp8_glu_backward_rows_kernel<T_, true>>(p, items, device, stream, kName);
    else launch_warp_items<fp8_glu_backward_rows_kernel<T_, false>>(p, items, device, stream, kName);
  };
  if (d_act.dtype() == DType::kFloat32) go(float{});
  else go(__nv_bfloat16{});
  if (dprobs.defined()) glu_dprobs_reduce(p.dprobs_partial, feature_blocks, feature_blocks, groups, dprobs, stream);
  return true;
}

}  // namespace moe::cuda
