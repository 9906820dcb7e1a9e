// The FP8 expert MLP's step between its two GEMMs in one pass: from FC1's output h [T, 2F] it
// writes h quantized by rows (what backward keeps) and act = GLU(h) * p quantized by rows (FC2's
// operand). The unfused steps (quantize_fp8(h), glu_forward, quantize_fp8(act)) read h twice and
// act once more; this reads h once and writes only FP8. Same bytes and scales as those steps: the
// same GLU function (common/glu_math.hpp), act rounded to h's dtype as glu_forward stores it, the
// quantizers' tile rule (common/fp8_math.hpp) on the same values.
//
// A warp takes one (row, 128-feature) item: lane l holds features f0 + 4l .. + 3, so act's 1 x 128
// scale block is the warp. h's 128-column blocks are the two half-warps (pairs, or blocks of s <= 64
// gate and s linear columns: features [f0, f0 + 64) are h's columns [2 f0, 2 f0 + 128)) or the
// gate and the linear run of the whole warp (blocks of s, s a multiple of 128, halves among them).
// Other layouts take the unfused steps.
//
// Backward, one pass from the kept h (FP8 rows) and d(act * p) (FC2 dgrad's output): h
// dequantized, the GLU backward, and dL/dh quantized by rows (FC1 dgrad's operand) and by columns
// (FC1 wgrad's), act * p recomputed and quantized by columns (FC2 wgrad's), dprobs' per-128-feature
// shares; the bytes and scales of dequantize_fp8, glu_backward and the quantizers. A block takes
// one (128-token column block of the columnwise layout, 128 features) tile: its rows as the forward
// does them (row blocks from registers), then dL/dh [128, 256] and act [128, 128] from shared memory
// by columns, the tile's tokens all of one expert (zeros past its last token, as the quantizer
// writes them).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/fp8_math.hpp"
#include "common/glu_math.hpp"
#include "cuda/backend.hpp"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"
#include "cuda/runtime/resident_blocks.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kFeatures = 4 * 32;  // one act scale block per warp
static_assert(kFeatures == kFp8Block);

// Where h's scale blocks lie relative to a warp's item.
enum class HBlocks {
  kHalfWarps,  // pairs, or blocks of s | 64: each half-warp's gate and linear values are one block
  kRuns,       // blocks of s, s % 128 == 0: the gate run is one block, the linear run another
};

struct GluQuantizeParams {
  const void* h;
  int64_t h_ld;
  const float* probs;  // [T] or null (p = 1)
  const int64_t* offsets;
  int64_t num_groups;
  int32_t ffn, block;  // F; s of the layout (1: pairs)
  detail::GluMath<float> math;
  uint8_t* h_data;  // null: h is not kept
  int64_t h_data_ld;
  float* h_scales;
  int64_t h_scales_ld;
  uint8_t* act_data;
  int64_t act_data_ld;
  float* act_scales;
  int64_t act_scales_ld;
  bool pow2;
  float epsilon;
};

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

// The value as stored in T (glu_forward's store, read back by the quantizer).
template <class T>
__device__ __forceinline__ float stored(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return __bfloat162float(__float2bfloat16_rn(v));
}

__device__ __forceinline__ uint32_t amax_bits4(const float (&v)[4]) {
  uint32_t a = detail::fp8_abs_bits(v[0]);
#pragma unroll
  for (int i = 1; i < 4; ++i) a = max(a, detail::fp8_abs_bits(v[i]));
  return a;
}

// Max over the lanes that differ in the bits of `width - 1` (a half-warp for 16, the warp for 32).
template <int kWidth>
__device__ __forceinline__ uint32_t lanes_max(uint32_t a) {
#pragma unroll
  for (int d = kWidth / 2; d > 0; d /= 2) a = max(a, __shfl_xor_sync(0xffffffffu, a, d));
  return a;
}

// The warp's sum in a fixed butterfly (deterministic).
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
  for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}

__device__ __forceinline__ uint32_t quantize4(const float (&v)[4], float m) {
  return uint32_t(detail::e4m3x2_from_float(v[0] * m, v[1] * m)) |
         uint32_t(detail::e4m3x2_from_float(v[2] * m, v[3] * m)) << 16;
}

// The tile scales of a warp's item, computed once: every lane evaluates one tile rule on the amax
// it stands for (lane 1: act's block; lanes 0 and 16: h's blocks, per half-warp or the gate and
// linear runs) and the others take theirs by shuffles, instead of every lane evaluating all three
// (two IEEE divisions each).
struct ItemScales {
  detail::Fp8TileScale gate, linear, act;
};

template <HBlocks kHBlocks>
__device__ __forceinline__ ItemScales item_scales(uint32_t gate_amax, uint32_t linear_amax, uint32_t act_amax,
                                                  uint32_t lane, bool pow2, float epsilon) {
  // Half-warps: a lane's gate and linear amax are its half-warp's one h block (lane 0 or 16 holds
  // it). Runs: the gate block's amax is lane 0's, the linear block's lane 16's (every lane holds both).
  const uint32_t h_amax = kHBlocks == HBlocks::kRuns && lane >= 16 ? linear_amax : gate_amax;
  const detail::Fp8TileScale mine = detail::fp8_tile_scale(lane == 1 ? act_amax : h_amax, pow2, epsilon);
  auto from = [&](uint32_t src) {
    return detail::Fp8TileScale{__shfl_sync(0xffffffffu, mine.multiplier, src),
                                __shfl_sync(0xffffffffu, mine.scale, src)};
  };
  ItemScales s;
  s.act = from(1);
  if constexpr (kHBlocks == HBlocks::kHalfWarps) {
    s.gate = s.linear = from(lane & 16u);
  } else {
    s.gate = from(0);
    s.linear = from(16);
  }
  return s;
}

template <class T, bool kPairs, HBlocks kHBlocks>
__global__ void __launch_bounds__(kThreads) fp8_glu_quantize_kernel(const GluQuantizeParams p) {
  const int64_t rows = p.offsets[p.num_groups];
  const int32_t feature_blocks = (p.ffn + kFeatures - 1) / kFeatures;
  const int64_t items = rows * feature_blocks;
  const uint32_t lane = threadIdx.x % 32;
  // The warp's items (row r, feature block fb) advance by a fixed stride: one division here, none
  // per item.
  const int64_t stride = int64_t(gridDim.x) * kWarps;
  const int64_t stride_rows = stride / feature_blocks;
  const int32_t stride_blocks = int32_t(stride - stride_rows * feature_blocks);
  int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  int64_t r = item / feature_blocks;
  int32_t fb = int32_t(item - r * feature_blocks);
  for (; item < items; item += stride) {  // warp-uniform
    const int32_t f = fb * kFeatures + 4 * int32_t(lane);
    const bool live = f < p.ffn;  // F % 16 == 0: a lane's four features are all in or all out
    // Gate and linear values of the lane's features; dead lanes hold zeros (amax-neutral).
    float gate[4] = {}, linear[4] = {};
    int32_t col = 0;  // pairs: the first of 8 columns g, l, g, l..; blocks: the first gate column
    const T* hr = static_cast<const T*>(p.h) + r * p.h_ld;
    if (live) {
      if constexpr (kPairs) {
        col = 2 * f;
        float a[4], b[4];
        load4(hr + col, a);
        load4(hr + col + 4, b);
        gate[0] = a[0], linear[0] = a[1], gate[1] = a[2], linear[1] = a[3];
        gate[2] = b[0], linear[2] = b[1], gate[3] = b[2], linear[3] = b[3];
      } else {
        col = (f / p.block) * 2 * p.block + f % p.block;
        load4(hr + col, gate);
        load4(hr + col + p.block, linear);
      }
    }
    const bool keep_h = p.h_data != nullptr;  // uniform
    uint32_t gate_amax = 0, linear_amax = 0;
    if (keep_h) {
      gate_amax = amax_bits4(gate);
      linear_amax = amax_bits4(linear);
      if constexpr (kHBlocks == HBlocks::kHalfWarps) {
        gate_amax = linear_amax = lanes_max<16>(max(gate_amax, linear_amax));
      } else {
        gate_amax = lanes_max<32>(gate_amax);
        linear_amax = lanes_max<32>(linear_amax);
      }
    }
    const float prob = p.probs != nullptr ? __ldg(p.probs + r) : 1.f;
    float act[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) act[i] = live ? stored<T>(p.math.forward(gate[i], linear[i]) * prob) : 0.f;
    const ItemScales scales =
        item_scales<kHBlocks>(gate_amax, linear_amax, lanes_max<32>(amax_bits4(act)), lane, p.pow2, p.epsilon);
    if (keep_h) {
      int64_t gate_block, linear_block;
      if constexpr (kHBlocks == HBlocks::kHalfWarps) {
        gate_block = linear_block = 2 * int64_t(fb) + lane / 16;
      } else {
        // Every live lane's runs lie in the blocks of lane 0's.
        const int32_t first = (fb * kFeatures / p.block) * 2 * p.block + (fb * kFeatures) % p.block;
        gate_block = first / kFp8Block;
        linear_block = (first + p.block) / kFp8Block;
      }
      uint8_t* dr = p.h_data + r * p.h_data_ld;
      if (live) {
        if constexpr (kPairs) {
          const float a[4] = {gate[0], linear[0], gate[1], linear[1]}, b[4] = {gate[2], linear[2], gate[3], linear[3]};
          *reinterpret_cast<uint2*>(dr + col) =
              make_uint2(quantize4(a, scales.gate.multiplier), quantize4(b, scales.gate.multiplier));
        } else {
          *reinterpret_cast<uint32_t*>(dr + col) = quantize4(gate, scales.gate.multiplier);
          *reinterpret_cast<uint32_t*>(dr + col + p.block) = quantize4(linear, scales.linear.multiplier);
        }
      }
      if constexpr (kHBlocks == HBlocks::kHalfWarps) {
        // A half-warp's block exists when its first lane is live (2F may end mid-warp).
        if (lane % 16 == 0 && live) p.h_scales[gate_block * p.h_scales_ld + r] = scales.gate.scale;
      } else if (lane == 0) {
        p.h_scales[gate_block * p.h_scales_ld + r] = scales.gate.scale;
        p.h_scales[linear_block * p.h_scales_ld + r] = scales.linear.scale;
      }
    }
    if (live) *reinterpret_cast<uint32_t*>(p.act_data + r * p.act_data_ld + f) = quantize4(act, scales.act.multiplier);
    if (lane == 0) p.act_scales[int64_t(fb) * p.act_scales_ld + r] = scales.act.scale;
    r += stride_rows;
    fb += stride_blocks;
    if (fb >= feature_blocks) {
      fb -= feature_blocks;
      ++r;
    }
  }
}

// ---- backward ----

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
  float* dprobs_partial;  // [T, partial_ld], share of feature block fb at [r, fb]; null: no probs
  int64_t partial_ld;
  bool pow2;
  float epsilon;
};

template <class T>
struct TileShared {
  T dh[kFp8Block][2 * kFeatures];  // dL/dh of the tile's features, gate run then linear run (or as h's columns)
  T act[kFp8Block][kFeatures];
  uint32_t act_amax[2][kFeatures];  // act's column amaxes over each half of the tile's tokens
};

// The dequantized values of 4 E4M3 bytes, rounded as dequantize_fp8 stores them in T.
template <class T>
__device__ __forceinline__ void dequantize4(uint32_t word, float scale, float (&v)[4]) {
  detail::e4m3x2_to_float(uint16_t(word & 0xffffu), v[0], v[1]);
  detail::e4m3x2_to_float(uint16_t(word >> 16), v[2], v[3]);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = stored<T>(detail::fp8_dequantize(v[i], scale));
}

template <class T>
__device__ __forceinline__ float as_float(T v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return __bfloat162float(v);
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

// The amax bits of rows [first, first + kRows) of column c of a tile in shared memory.
template <int kRows, class T, int kWidth>
__device__ __forceinline__ uint32_t column_amax(const T (*tile)[kWidth], int c, int first) {
  uint32_t amax = 0;
#pragma unroll 8
  for (int r = 0; r < kRows; ++r) amax = max(amax, detail::fp8_abs_bits(as_float(tile[first + r][c])));
  return amax;
}

// Rows [first, first + kRows) of column c quantized with scale s into kRows bytes at `out`.
template <int kRows, class T, int kWidth>
__device__ __forceinline__ void quantize_column_rows(const T (*tile)[kWidth], int c, int first,
                                                     const detail::Fp8TileScale& s, uint8_t* out) {
#pragma unroll
  for (int r0 = 0; r0 < kRows; r0 += 16) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = first + r0 + 4 * i;
      const float v[4] = {as_float(tile[r][c]), as_float(tile[r + 1][c]), as_float(tile[r + 2][c]),
                          as_float(tile[r + 3][c])};
      w[i] = quantize4(v, s.multiplier);
    }
    *reinterpret_cast<uint4*>(out + r0) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Quantizes one column of `rows` x `width` values in shared memory (column `c`) into 128 bytes at
// `out`, returning the scale.
template <class T, int kWidth>
__device__ __forceinline__ float quantize_column(const T (*tile)[kWidth], int c, uint8_t* out, bool pow2,
                                                 float epsilon) {
  const detail::Fp8TileScale s =
      detail::fp8_tile_scale(column_amax<kFp8Block>(tile, c, 0), pow2, epsilon);
  quantize_column_rows<kFp8Block>(tile, c, 0, s, out);
  return s.scale;
}

template <class T, bool kPairs, HBlocks kHBlocks>
__global__ void __launch_bounds__(kThreads) fp8_glu_backward_quantize_kernel(const GluBackwardQuantizeParams p) {
  extern __shared__ __align__(16) uint8_t shared_raw[];
  TileShared<T>& tile = *reinterpret_cast<TileShared<T>*>(shared_raw);
  const int32_t feature_blocks = (p.ffn + kFeatures - 1) / kFeatures;
  const int64_t G = p.num_groups;
  if (blockIdx.x == 0)  // the columnwise copies share dy's expert offsets
    for (int64_t g = threadIdx.x; g <= G; g += kThreads) {
      p.dh_column_offsets[g] = p.column_offsets[g];
      p.act_column_offsets[g] = p.column_offsets[g];
    }
  const int64_t used_blocks = p.column_offsets[G] / kFp8Block;
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t item = blockIdx.x; item < p.column_blocks * feature_blocks; item += gridDim.x) {  // uniform
    const int64_t j = item / feature_blocks;
    const int32_t fb = int32_t(item - j * feature_blocks);
    if (j >= used_blocks) break;  // items run in order of j
    // The expert whose column segment holds block j: the last g with column_offsets[g] <= 128 j
    // (an empty expert's segment is empty, so it is never the one).
    int64_t lo = 0, hi = G - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (p.column_offsets[mid] <= j * kFp8Block) lo = mid;
      else hi = mid - 1;
    }
    const int64_t into = j * kFp8Block - p.column_offsets[lo];
    const int64_t token0 = p.offsets[lo] + into;
    const int64_t left = p.offsets[lo + 1] - p.offsets[lo] - into;
    const int32_t tokens = int32_t(left < kFp8Block ? left : kFp8Block);
    const int32_t f0 = fb * kFeatures, f = f0 + 4 * int32_t(lane);
    const bool live = f < p.ffn;
    // Runs of the warp's features: the gate columns of feature f0 (and the linear ones s later).
    const int32_t gate0 = kPairs ? 2 * f0 : (f0 / p.block) * 2 * p.block + f0 % p.block;
    int32_t col = 0;  // the lane's first column: pairs g, l, g, l..; blocks its first gate column
    if (live) col = kPairs ? 2 * f : (f / p.block) * 2 * p.block + f % p.block;
    // Where the lane's values sit in the tile's dL/dh: h's columns from 2 f0 (half-warp blocks), or
    // the gate run at 0 and the linear run at 128.
    const int32_t gate_at = kHBlocks == HBlocks::kRuns ? col - gate0 : col - 2 * f0;
    const int32_t linear_at = kHBlocks == HBlocks::kRuns ? kFeatures + gate_at : gate_at + p.block;

    // ---- rows: one warp per token, kBatch tokens' loads in flight at once ----
    constexpr int kBatch = 4;
    auto zero_row = [&](int32_t rr) {  // past the expert's last token: zeros for the column quantizers
      if (!live) return;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        tile.act[rr][4 * lane + i] = from<T>(0.f);
        if constexpr (kPairs) {
          tile.dh[rr][gate_at + 2 * i] = from<T>(0.f);
          tile.dh[rr][gate_at + 2 * i + 1] = from<T>(0.f);
        } else {
          tile.dh[rr][gate_at + i] = from<T>(0.f);
          tile.dh[rr][linear_at + i] = from<T>(0.f);
        }
      }
    };
    for (int32_t first = int32_t(warp); first < kFp8Block; first += kBatch * kWarps) {
      // The batch's tokens first + 8 q: the kept h's words and scales and d_act, all loads issued.
      uint32_t h_word[kBatch][2] = {};
      float h_scale[kBatch][2] = {}, d_in[kBatch][4] = {}, prob_in[kBatch];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        const int32_t rr = first + kWarps * q;
        const int64_t r = token0 + rr;
        prob_in[q] = 1.f;
        if (rr >= tokens) continue;
        if (p.probs != nullptr) prob_in[q] = __ldg(p.probs + r);
        if (!live) continue;
        const uint8_t* hr = p.h_data + r * p.h_data_ld;
        if constexpr (kPairs) {
          const uint2 w = *reinterpret_cast<const uint2*>(hr + col);
          h_word[q][0] = w.x, h_word[q][1] = w.y;
          h_scale[q][0] = h_scale[q][1] = p.h_scales[(col / kFp8Block) * p.h_scales_ld + r];
        } else {
          h_word[q][0] = *reinterpret_cast<const uint32_t*>(hr + col);
          h_word[q][1] = *reinterpret_cast<const uint32_t*>(hr + col + p.block);
          h_scale[q][0] = p.h_scales[(col / kFp8Block) * p.h_scales_ld + r];
          h_scale[q][1] = p.h_scales[((col + p.block) / kFp8Block) * p.h_scales_ld + r];
        }
        load4(static_cast<const T*>(p.d_act) + r * p.d_act_ld + f, d_in[q]);
      }
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        const int32_t rr = first + kWarps * q;
        if (rr >= tokens) {
          zero_row(rr);
          continue;
        }
        const int64_t r = token0 + rr;
        const float prob = prob_in[q];
        float gate[4] = {}, linear[4] = {};
        const float(&d)[4] = d_in[q];
        if (live) {
          if constexpr (kPairs) {
            float a[4], b[4];
            dequantize4<T>(h_word[q][0], h_scale[q][0], a);
            dequantize4<T>(h_word[q][1], h_scale[q][1], b);
            gate[0] = a[0], linear[0] = a[1], gate[1] = a[2], linear[1] = a[3];
            gate[2] = b[0], linear[2] = b[1], gate[3] = b[2], linear[3] = b[3];
          } else {
            dequantize4<T>(h_word[q][0], h_scale[q][0], gate);
            dequantize4<T>(h_word[q][1], h_scale[q][1], linear);
          }
        }
        float dgate[4], dlinear[4], act[4], dp = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float a, dg, dl;
          p.math.backward(gate[i], linear[i], d[i] * prob, a, dg, dl);
          dgate[i] = live ? stored<T>(dg) : 0.f;
          dlinear[i] = live ? stored<T>(dl) : 0.f;
          act[i] = live ? stored<T>(a * prob) : 0.f;
          dp += live ? a * d[i] : 0.f;
        }
        if (p.dprobs_partial != nullptr) {  // uniform
          dp = lanes_sum(dp);
          if (lane == 0) p.dprobs_partial[r * p.partial_ld + fb] = dp;
        }
        if (p.dh_rows != nullptr) {  // uniform
          uint32_t gate_amax = amax_bits4(dgate), linear_amax = amax_bits4(dlinear);
          int64_t gate_block, linear_block;
          if constexpr (kHBlocks == HBlocks::kHalfWarps) {
            gate_amax = linear_amax = lanes_max<16>(max(gate_amax, linear_amax));
            gate_block = linear_block = 2 * int64_t(fb) + lane / 16;
          } else {
            gate_amax = lanes_max<32>(gate_amax);
            linear_amax = lanes_max<32>(linear_amax);
            gate_block = gate0 / kFp8Block;
            linear_block = (gate0 + p.block) / kFp8Block;
          }
          const detail::Fp8TileScale gs = detail::fp8_tile_scale(gate_amax, p.pow2, p.epsilon);
          const detail::Fp8TileScale ls = detail::fp8_tile_scale(linear_amax, p.pow2, p.epsilon);
          uint8_t* out = p.dh_rows + r * p.dh_rows_ld;
          if (live) {
            if constexpr (kPairs) {
              const float a[4] = {dgate[0], dlinear[0], dgate[1], dlinear[1]};
              const float b[4] = {dgate[2], dlinear[2], dgate[3], dlinear[3]};
              *reinterpret_cast<uint2*>(out + col) =
                  make_uint2(quantize4(a, gs.multiplier), quantize4(b, gs.multiplier));
            } else {
              *reinterpret_cast<uint32_t*>(out + col) = quantize4(dgate, gs.multiplier);
              *reinterpret_cast<uint32_t*>(out + col + p.block) = quantize4(dlinear, ls.multiplier);
            }
          }
          if constexpr (kHBlocks == HBlocks::kHalfWarps) {
            if (lane % 16 == 0 && live) p.dh_row_scales[gate_block * p.dh_row_scales_ld + r] = gs.scale;
          } else if (lane == 0) {
            p.dh_row_scales[gate_block * p.dh_row_scales_ld + r] = gs.scale;
            p.dh_row_scales[linear_block * p.dh_row_scales_ld + r] = ls.scale;
          }
        }
        if (live) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            tile.act[rr][4 * lane + i] = from<T>(act[i]);
            if constexpr (kPairs) {
              tile.dh[rr][gate_at + 2 * i] = from<T>(dgate[i]);
              tile.dh[rr][gate_at + 2 * i + 1] = from<T>(dlinear[i]);
            } else {
              tile.dh[rr][gate_at + i] = from<T>(dgate[i]);
              tile.dh[rr][linear_at + i] = from<T>(dlinear[i]);
            }
          }
        }
      }
    }
    __syncthreads();
    // ---- columns: one thread per column of dL/dh, then per column of act ----
    {
      const int32_t c = int32_t(threadIdx.x);  // 0 .. 255
      // h's column of tile column c.
      const int64_t h_col = kHBlocks == HBlocks::kRuns ? (c < kFeatures ? gate0 + c : gate0 + p.block + c - kFeatures)
                                                       : 2 * int64_t(f0) + c;
      const bool valid = kHBlocks == HBlocks::kRuns ? f0 + (c % kFeatures) < p.ffn : h_col < 2 * int64_t(p.ffn);
      if (valid) {
        uint8_t* out = p.dh_columns + h_col * p.dh_columns_ld + j * kFp8Block;
        const float scale = quantize_column<T, 2 * kFeatures>(tile.dh, c, out, p.pow2, p.epsilon);
        p.dh_column_scales[j * 2 * int64_t(p.ffn) + h_col] = scale;
      }
      // act: two threads per column, each over half of the tokens.
      const int32_t ac = c % kFeatures, half = c / kFeatures;
      const int64_t feature = f0 + ac;
      if (feature < p.ffn) tile.act_amax[half][ac] = column_amax<kFp8Block / 2>(tile.act, ac, 64 * half);
      __syncthreads();
      if (feature < p.ffn) {
        const detail::Fp8TileScale s =
            detail::fp8_tile_scale(max(tile.act_amax[0][ac], tile.act_amax[1][ac]), p.pow2, p.epsilon);
        quantize_column_rows<kFp8Block / 2>(tile.act, ac, 64 * half, s,
                                            p.act_columns + feature * p.act_columns_ld + j * kFp8Block + 64 * half);
        if (half == 0) p.act_column_scales[j * int64_t(p.ffn) + feature] = s.scale;
      }
    }
    __syncthreads();  // the tile's shared memory is reused by the next item
  }
}

// ---- backward, rows only: the GLU backward from the kept FP8 h ----

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

// A kernel that takes one item per warp: blocks at most as many as are resident at once (from the
// device only, never the routing), so that no block waits for a second wave.
template <auto kKernel, class Params>
void launch_warp_items(const Params& p, int64_t items, int device, Stream stream, const char* name) {
  const int resident = resident_blocks<kKernel>(device, kThreads, 0, name);
  const int64_t wanted = (items + kWarps - 1) / kWarps;
  const unsigned blocks = unsigned(std::max<int64_t>(1, std::min<int64_t>(wanted, resident)));
  kKernel<<<blocks, kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH(name);
}

// Vector access to rows of t: its data `bytes`-aligned and its row pitch a multiple of `bytes`.
bool rows_aligned(const TensorView& t, size_t bytes) {
  return is_aligned(t.data(), bytes) && (t.stride(0) * int64_t(dtype_size(t.dtype()))) % int64_t(bytes) == 0;
}

template <class T, bool kPairs, HBlocks kHBlocks>
void launch_backward(const GluBackwardQuantizeParams& p, int64_t items, int device, Stream stream) {
  constexpr auto kernel = fp8_glu_backward_quantize_kernel<T, kPairs, kHBlocks>;
  constexpr size_t shared = sizeof(TileShared<T>);
  const int resident = resident_blocks<kernel>(device, kThreads, shared, "fp8_glu_backward_quantize_kernel");
  const unsigned blocks = unsigned(std::max<int64_t>(1, std::min<int64_t>(items, resident)));
  kernel<<<blocks, kThreads, shared, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH("fp8_glu_backward_quantize_kernel");
}

// The layouts both passes take: pairs, blocks of s | 64 (h's blocks are half-warps), blocks of a
// multiple of 128 (runs); 0: none.
enum class LayoutCase { kNone, kPairs, kHalfWarps, kRuns };
LayoutCase layout_case(int64_t s) {
  if (s == 1) return LayoutCase::kPairs;
  if (s >= 4 && 64 % s == 0) return LayoutCase::kHalfWarps;
  if (s % kFp8Block == 0) return LayoutCase::kRuns;
  return LayoutCase::kNone;
}

}  // namespace

bool fp8_glu_quantize(const TensorView& h, const TensorView& probs, const GroupLayout& groups, const Fp8Rows& h_rows,
                      const Fp8Rows& act_rows, const GluSpec& spec, const Fp8Recipe& recipe, Stream stream) {
  const int64_t F = act_rows.data.size(1), T = groups.capacity();
  if (!spec.gated()) return false;  // GLUs only: a non-gated activation takes the separate steps
  if (h.dtype() != DType::kBFloat16 && h.dtype() != DType::kFloat32) return false;
  if (F % 16 != 0 || F >= (int64_t(1) << 30)) return false;
  const int64_t s = F > 0 ? spec.layout.block_size(F) : 1;
  const bool keep_h = h_rows.data.defined();
  // Without h kept any layout of 4-column runs will do (the runs case computes act alone).
  LayoutCase layout = layout_case(s);
  if (layout == LayoutCase::kNone && !keep_h && s % 4 == 0) layout = LayoutCase::kRuns;
  if (layout == LayoutCase::kNone) return false;
  // Vector loads and stores: h's 4-value runs (16 bytes for fp32) and the FP8 rows' 4-byte words.
  const size_t esize = dtype_size(h.dtype());
  if (!rows_aligned(h, 4 * esize) || !rows_aligned(act_rows.data, 4)) return false;
  if (keep_h && !rows_aligned(h_rows.data, 8)) return false;
  if (T == 0 || F == 0) return true;

  GluQuantizeParams p{};
  p.h = h.data();
  p.h_ld = h.stride(0);
  p.probs = probs.defined() ? probs.data_as<float>() : nullptr;
  p.offsets = groups.offsets().data_as<int64_t>();
  p.num_groups = groups.num_groups();
  p.ffn = int32_t(F);
  p.block = int32_t(s);
  p.math = detail::GluMath<float>::from(spec);
  if (keep_h) {
    p.h_data = static_cast<uint8_t*>(h_rows.data.data());
    p.h_data_ld = h_rows.data.stride(0);
    p.h_scales = h_rows.scales.data_as<float>();
    p.h_scales_ld = h_rows.scales.stride(0);
  }
  p.act_data = static_cast<uint8_t*>(act_rows.data.data());
  p.act_data_ld = act_rows.data.stride(0);
  p.act_scales = act_rows.scales.data_as<float>();
  p.act_scales_ld = act_rows.scales.stride(0);
  p.pow2 = recipe.pow2_scales;
  p.epsilon = recipe.amax_epsilon;
  const int64_t items = T * ((F + kFeatures - 1) / kFeatures);
  const int device = h.device().index;
  auto go = [&](auto type) {
    using T_ = decltype(type);
    constexpr const char* kName = "fp8_glu_quantize_kernel";
    if (layout == LayoutCase::kPairs)
      return launch_warp_items<fp8_glu_quantize_kernel<T_, true, HBlocks::kHalfWarps>>(p, items, device, stream, kName);
    if (layout == LayoutCase::kHalfWarps)
      return launch_warp_items<fp8_glu_quantize_kernel<T_, false, HBlocks::kHalfWarps>>(p, items, device, stream, kName);
    launch_warp_items<fp8_glu_quantize_kernel<T_, false, HBlocks::kRuns>>(p, items, device, stream, kName);
  };
  if (h.dtype() == DType::kFloat32) go(float{});
  else go(__nv_bfloat16{});
  return true;
}

}  // namespace moe::cuda

namespace moe::cuda {

bool fp8_glu_backward_quantize(const Fp8Rows& h, const TensorView& d_act, const TensorView& probs,
                               const GroupLayout& groups, const TensorView& column_offsets, const Fp8Rows& dh_rows,
                               const Fp8Columns& dh_columns, const Fp8Columns& act_columns, const TensorView& dprobs,
                               const TensorView& scratch, const GluSpec& spec, const Fp8Recipe& recipe, Stream stream) {
  const int64_t F = d_act.size(1), T = groups.capacity(), G = groups.num_groups();
  if (!spec.gated()) return false;  // GLUs only: a non-gated activation takes the separate steps
  if (d_act.dtype() != DType::kBFloat16 && d_act.dtype() != DType::kFloat32) return false;
  if (F % 16 != 0 || F >= (int64_t(1) << 30) || F == 0) return false;
  const LayoutCase layout = layout_case(spec.layout.block_size(F));
  if (layout == LayoutCase::kNone) return false;
  const int64_t feature_blocks = (F + kFeatures - 1) / kFeatures;
  if (dprobs.defined() && scratch.nbytes() < size_t(T * feature_blocks) * sizeof(float)) return false;
  const size_t esize = dtype_size(d_act.dtype());
  if (!rows_aligned(d_act, 4 * esize) || !rows_aligned(h.data, 8)) return false;
  if (dh_rows.data.defined() && !rows_aligned(dh_rows.data, 8)) return false;
  for (const Fp8Columns* c : {&dh_columns, &act_columns})
    if (!rows_aligned(c->data, 16)) return false;
  if (T == 0) return true;

  GluBackwardQuantizeParams p{};
  p.h_data = static_cast<const uint8_t*>(h.data.data());
  p.h_data_ld = h.data.stride(0);
  p.h_scales = h.scales.data_as<float>();
  p.h_scales_ld = h.scales.stride(0);
  p.d_act = d_act.data();
  p.d_act_ld = d_act.stride(0);
  p.probs = probs.defined() ? probs.data_as<float>() : nullptr;
  p.offsets = groups.offsets().data_as<int64_t>();
  p.column_offsets = column_offsets.data_as<int64_t>();
  p.num_groups = G;
  p.column_blocks = dh_columns.data.size(1) / kFp8Block;
  p.ffn = int32_t(F);
  p.block = int32_t(spec.layout.block_size(F));
  p.math = detail::GluMath<float>::from(spec);
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
    p.partial_ld = feature_blocks;
  }
  p.pow2 = recipe.pow2_scales;
  p.epsilon = recipe.amax_epsilon;
  const int64_t items = p.column_blocks * feature_blocks;
  const int device = d_act.device().index;
  auto go = [&](auto type) {
    using T_ = decltype(type);
    if (layout == LayoutCase::kPairs) return launch_backward<T_, true, HBlocks::kHalfWarps>(p, items, device, stream);
    if (layout == LayoutCase::kHalfWarps)
      return launch_backward<T_, false, HBlocks::kHalfWarps>(p, items, device, stream);
    launch_backward<T_, false, HBlocks::kRuns>(p, items, device, stream);
  };
  if (d_act.dtype() == DType::kFloat32) go(float{});
  else go(__nv_bfloat16{});
  if (dprobs.defined()) glu_dprobs_reduce(p.dprobs_partial, feature_blocks, feature_blocks, groups, dprobs, stream);
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
  p.h_data = static_cast<const uint8_t*>(h.data.data());
  p.h_data_ld = h.data.stride(0);
  p.h_scales = h.scales.data_as<float>();
  p.h_scales_ld = h.scales.stride(0);
  p.d_act = d_act.data();
  p.d_act_ld = d_act.stride(0);
  p.write_act = act.defined();
  p.probs = probs.defined() ? probs.data_as<float>() : nullptr;
  p.offsets = groups.offsets().data_as<int64_t>();
  p.num_groups = groups.num_groups();
  p.ffn = int32_t(F);
  p.block = int32_t(s);
  p.math = detail::GluMath<float>::from(spec);
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
