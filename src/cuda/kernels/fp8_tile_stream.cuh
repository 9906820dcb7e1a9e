// The machinery the FP8 quantizers (fp8_quantize_tokens.cu, fp8_quantize_weight.cu) are built on,
// its register-level pieces shared with the FP8 MLP's GLU passes (fp8_glu_forward.cu,
// fp8_glu_backward.cu):
// a stream of 128 x 128 tiles through a ring of shared-memory stages, and the grid and ring depth
// of a launch. The math is common/fp8_math.hpp's, so the bytes and scale bits are the CPU backend's.
// The kernels are bound by memory, so they keep it busy: a grid of as many blocks as fit on the
// device, each taking an even share of the tiles that hold work, streams its tiles through a ring
// of shared-memory stages with 16-byte cp.async copies, several tiles ahead (the copies need no
// registers, so the next tiles are in flight while the current one is quantized). Two ways to hold
// a tile in the threads: rows (a row per half-warp: row amaxes are shuffles, the row bytes stored
// straight; with columns too, the column amaxes are combined over the warps through shared memory
// and the bytes transposed through the consumed stage, and so for the weight's data_t), and, for
// columns alone, strips (a warp per 16 features of all 128 rows: column amaxes are shuffles, and
// each lane's 4 tokens of a feature are one 4-byte word of the transposed row, which the warp stores
// whole: no barrier but the ring's). Amaxes run on packed 16-bit magnitudes; the per-value work is
// one multiplication and half a conversion instruction per copy.
// Launch shapes come from the device only, the routing is read on the device (the number of tiles
// with work too): graph safe, one launch for all experts, no atomics (deterministic: every byte has
// one writer, whatever the grid).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "common/fp8_math.hpp"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/device_traits.hpp"
#include "cuda/runtime/per_device.hpp"

namespace moe::cuda::fp8_tiles {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 128;  // == kFp8Block
static_assert(kTile == kFp8Block);
constexpr int kMaxStages = 4;
static_assert(kMaxStages - 2 <= 2, "the ring waits with cp_async_wait_group_at_most_2");

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// ---- one input type's words ----

// Values are held as the input's raw 32-bit words (two 16-bit values per word, or one float).
// Magnitudes are compared as the unsigned bits of |v|, which order them with infinity above every
// finite value and NaN above infinity: amax is exact, independent of the reduction order, and a
// tile holds a NaN or an infinity exactly when its amax does.
template <class T>
struct Words {
  static constexpr bool kPacked = sizeof(T) == 2;
  static constexpr int kPerWord = kPacked ? 2 : 1;  // values per word

  static __device__ __forceinline__ uint32_t magnitude(uint32_t w) { return w & (kPacked ? 0x7fff7fffu : 0x7fffffffu); }
  // Per 16-bit half for packed words (one instruction on sm_90).
  static __device__ __forceinline__ uint32_t max(uint32_t a, uint32_t b) {
    if constexpr (kPacked) {
#if __CUDA_ARCH__ >= 900
      uint32_t r;
      asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
      return r;
#else
      return __vmaxu2(a, b);
#endif
    } else {
      return a > b ? a : b;
    }
  }
  // The float bits of a 16-bit magnitude (exact; infinity and NaN stay so).
  static __device__ __forceinline__ uint32_t float_bits_of(uint32_t half) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return half << 16;
    else return detail::float_bits(__half2float(__ushort_as_half(static_cast<unsigned short>(half))));
  }
  // The amax bits of a magnitude word (both halves) / of one of its values.
  static __device__ __forceinline__ uint32_t amax_bits(uint32_t w) {
    if constexpr (kPacked) return float_bits_of(std::max(w & 0xffffu, w >> 16));
    else return w;
  }
  static __device__ __forceinline__ uint32_t value_bits(uint32_t w, int which) {
    if constexpr (kPacked) return float_bits_of(which ? w >> 16 : w & 0xffffu);
    else return w;
  }
  // Value j of a run of words, as float.
  template <int N>
  static __device__ __forceinline__ float value(const uint32_t (&words)[N], int j) {
    if constexpr (std::is_same_v<T, float>) {
      return __uint_as_float(words[j]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const uint32_t w = words[j / 2];
      return __uint_as_float(j % 2 ? w & 0xffff0000u : w << 16);
    } else {
      const uint32_t w = words[j / 2];
      return __half2float(__ushort_as_half(static_cast<unsigned short>(j % 2 ? w >> 16 : w & 0xffffu)));
    }
  }
  // The magnitude of a run of words, folded into one word.
  template <int N>
  static __device__ __forceinline__ uint32_t fold(const uint32_t (&words)[N]) {
    uint32_t a = magnitude(words[0]);
#pragma unroll
    for (int w = 1; w < N; ++w) a = max(a, magnitude(words[w]));
    return a;
  }
};

// Four values E4M3(v * m), packed little-endian.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  return uint32_t(detail::e4m3x2_from_float(a, b)) | uint32_t(detail::e4m3x2_from_float(c, d)) << 16;
}

// ---- two ways to hold a 128 x 128 tile in 256 threads ----

// Rows: thread (warp w, lane l) holds rows 8 g + i, g = 2 w + l / 16, and features 8 (l % 16) + j,
// i, j < 8: a half-warp covers one row's 128 features, so a row's amax is a half-warp reduction.
template <class T>
struct RowLayout {
  static constexpr int kWords = 8 / Words<T>::kPerWord;  // one row's 8 values
  int m, group;
  __device__ RowLayout() : m(int(threadIdx.x) % 16), group(int(threadIdx.x) / 16) {}
};

// Strips (columns alone): warp w holds features 16 w .. 16 w + 15 of all 128 rows, lane l rows
// 4 l .. 4 l + 3: a column's amax is a warp reduction, and the 4 bytes of one feature for the
// lane's 4 tokens are one word of the transposed copy, whose 128-token rows a warp stores whole,
// straight from registers, with no barrier.
template <class T>
struct StripLayout {
  static constexpr int kWords = 16 / Words<T>::kPerWord;  // one row's 16 values: 8 or 16 words
  int warp, lane;
  __device__ StripLayout() : warp(int(threadIdx.x) / 32), lane(int(threadIdx.x) % 32) {}
};

// A stage: the tile's 128 rows of 128 values, row after row (256 or 512 bytes), zeros past the
// tile's rows and features. Copied in by every thread (16-byte chunks, consecutive threads on
// consecutive chunks: whole rows per warp). For the strip layout the 16-byte chunk c of row r sits
// at c ^ (r / 4 % 8): a quarter-warp then reads 8 rows of one strip from distinct banks (the row
// layout's quarter-warps read 128 contiguous bytes of one row).
template <class T, bool kSwizzle>
struct Stage {
  static constexpr int kRowBytes = kTile * int(sizeof(T));
  static constexpr int kBytes = kTile * kRowBytes;

  static __device__ __forceinline__ int chunk(int r, int c) { return kSwizzle ? c ^ ((r >> 2) & 7) : c; }

  // The tile at `src` (rows `ld` elements apart): 16-byte cp.async where the caller knows the rows
  // aligned, else element loads (synchronous; odd strides only). A thread's chunks share their
  // column and step down the rows.
  template <bool kVector>
  static __device__ __forceinline__ void load(uint8_t* stage, const T* src, int64_t ld, int rows, int features) {
    constexpr int kChunksPerRow = kRowBytes / 16, kElements = 16 / int(sizeof(T));
    constexpr int kRowStep = kThreads / kChunksPerRow;  // rows between a thread's chunks
    static_assert(kThreads % kChunksPerRow == 0);
    const int r0 = int(threadIdx.x) / kChunksPerRow, q = int(threadIdx.x) % kChunksPerRow;
    const bool feature_in = q * kElements < features;
    const T* from = src + int64_t(r0) * ld + q * kElements;
    const int64_t step = int64_t(kRowStep) * ld;
#pragma unroll
    for (int it = 0; it < kTile / kRowStep; ++it, from += step) {
      const int r = r0 + it * kRowStep;
      const bool valid = feature_in && r < rows;
      uint8_t* dst = stage + r * kRowBytes + 16 * chunk(r, q);
      if constexpr (kVector) {
        ptx::cp_async_16(shared_address(dst), valid ? from : src, valid);
      } else {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (valid) {
          T* e = reinterpret_cast<T*>(&v);
#pragma unroll
          for (int k = 0; k < kElements; ++k) e[k] = from[k];
        }
        *reinterpret_cast<uint4*>(dst) = v;
      }
    }
  }

  template <int N>
  static __device__ __forceinline__ void read_chunks(const uint8_t* row, int r, int first_chunk, uint32_t (&words)[N]) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) {
      const uint4 v = reinterpret_cast<const uint4*>(row)[chunk(r, first_chunk + c)];
      words[4 * c] = v.x, words[4 * c + 1] = v.y, words[4 * c + 2] = v.z, words[4 * c + 3] = v.w;
    }
  }
  // The row layout's 8 x 8 values: row i's 8 values in words[i].
  static __device__ __forceinline__ void read(const uint8_t* stage, const RowLayout<T>& at,
                                              uint32_t (&words)[8][RowLayout<T>::kWords]) {
    constexpr int kChunks = RowLayout<T>::kWords / 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 8 * at.group + i;
      read_chunks(stage + r * kRowBytes, r, at.m * kChunks, words[i]);
    }
  }
  // The strip layout's 4 x 16 values: row i's 16 values in words[i].
  static __device__ __forceinline__ void read(const uint8_t* stage, const StripLayout<T>& at,
                                              uint32_t (&words)[4][StripLayout<T>::kWords]) {
    constexpr int kChunks = StripLayout<T>::kWords / 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * at.lane + i;
      read_chunks(stage + r * kRowBytes, r, at.warp * kChunks, words[i]);
    }
  }
};

// N values (W words) -> N bytes E4M3(v * m), N = 8 or 16.
template <class T, int N, int W>
__device__ __forceinline__ void quantize_run(const uint32_t (&words)[W], float m, uint32_t (&out)[N / 4]) {
  using V = Words<T>;
#pragma unroll
  for (int k = 0; k < N / 4; ++k)
    out[k] = e4m3x4(V::value(words, 4 * k) * m, V::value(words, 4 * k + 1) * m, V::value(words, 4 * k + 2) * m,
                    V::value(words, 4 * k + 3) * m);
}

// Value j of R rows -> R bytes E4M3(v * m), packed little-endian (R = 4 or 8).
template <class T, int R, int W>
__device__ __forceinline__ void quantize_column(const uint32_t (&words)[R][W], int j, float m, uint32_t (&out)[R / 4]) {
  using V = Words<T>;
#pragma unroll
  for (int k = 0; k < R / 4; ++k)
    out[k] = e4m3x4(V::value(words[4 * k], j) * m, V::value(words[4 * k + 1], j) * m,
                    V::value(words[4 * k + 2], j) * m, V::value(words[4 * k + 3], j) * m);
}

// Byte j of the eight rows q[0..7], packed: column j of an 8 x 8 byte matrix.
__device__ __forceinline__ uint2 byte_column(const uint32_t (&q)[8][2], int j) {
  const auto word = [&](int i) { return q[i][j / 4]; };
  const unsigned b = unsigned(j % 4);
  const unsigned pick = b | (b + 4) << 4;  // byte b of the first word, byte b of the second
  const uint32_t lo = __byte_perm(__byte_perm(word(0), word(1), pick), __byte_perm(word(2), word(3), pick), 0x5410);
  const uint32_t hi = __byte_perm(__byte_perm(word(4), word(5), pick), __byte_perm(word(6), word(7), pick), 0x5410);
  return make_uint2(lo, hi);
}

// A 128 x 128-byte tile in shared memory (a processed stage), written by rows of the source tile
// (8 bytes: one feature, the 8 rows of a thread) and read by features (16 bytes: 16 rows of one
// feature). The 8-byte unit u of feature row f sits at unit u ^ (f / 8 % 16): a half-warp's stores
// (features 8 m + j, same u) and a quarter-warp's loads (one feature row, 8 consecutive 16-byte
// chunks) hit distinct banks.
struct TransposeTile {
  uint8_t* bytes;

  __device__ __forceinline__ void put(int feature, int unit, uint2 value) const {
    const int swizzle = (feature / 8) % 16;
    *reinterpret_cast<uint2*>(bytes + feature * kTile + 8 * (unit ^ swizzle)) = value;
  }
  // 16 bytes: rows 16 c .. 16 c + 15 of `feature` (units 2c and 2c + 1, swapped back if the
  // swizzle swapped them).
  __device__ __forceinline__ uint4 get(int feature, int c) const {
    const int swizzle = (feature / 8) % 16;
    uint4 v = *reinterpret_cast<const uint4*>(bytes + feature * kTile + 16 * (c ^ (swizzle >> 1)));
    if (swizzle & 1) v = make_uint4(v.z, v.w, v.x, v.y);
    return v;
  }
  // Stores the transposed tile: feature f < features goes to `first` + f * ld, bytes
  // [0, 16 * chunks); a warp writes four whole 128-byte feature rows.
  __device__ __forceinline__ void store(int features, int chunks, uint8_t* first, int64_t ld) const {
#pragma unroll
    for (int it = 0; it < kTile * kTile / 16 / kThreads; ++it) {
      const int index = it * kThreads + int(threadIdx.x), feature = index / 8, c = index % 8;
      if (feature < features && c < chunks) *reinterpret_cast<uint4*>(first + feature * ld + 16 * c) = get(feature, c);
    }
  }
};

struct Recipe {
  bool pow2;
  float epsilon;
  __device__ detail::Fp8TileScale scale(uint32_t amax_bits) const {
    return detail::fp8_tile_scale(amax_bits, pow2, epsilon);
  }
};

// The row part of the register-resident quantizers: a half-warp's 4 rows of one 128-feature block,
// 8 values a lane in words[s] (W words: 4 of 16-bit pairs, 8 floats; zeros past K). Slot s's bytes
// go to out + s * out_step (the lane's 8 features), its scale to scales + s * scales_step, where
// in_range(s). The row amaxes are reduced and scattered at once over the half-warp (xor 8 and 4
// halve the slots a lane carries, xor 2 and 1 finish): 5 shuffles instead of 16, and lane m ends
// with slot m / 4's amax, whose scale it computes (the divisions of one row per lane); the
// multipliers go back by shuffles.
template <class T, int W, class InRange>
__device__ __forceinline__ void quantize_row_slots(const Recipe& recipe, const uint32_t (&words)[4][W], uint8_t* out,
                                                   int64_t out_step, float* scales, int scales_step,
                                                   InRange&& in_range, bool feature_in, int lane) {
  using V = Words<T>;
  static_assert(W * V::kPerWord == 8, "8 values a lane and slot");
  const int half = lane / 16, m = lane % 16;
  const bool upper8 = m & 8, upper4 = m & 4;
  uint32_t a[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) a[s] = V::fold(words[s]);
  // xor 8: the upper lanes keep slots 2 and 3, the lower ones 0 and 1.
  uint32_t keep0 = upper8 ? a[2] : a[0], keep1 = upper8 ? a[3] : a[1];
  const uint32_t send0 = upper8 ? a[0] : a[2], send1 = upper8 ? a[1] : a[3];
  keep0 = V::max(keep0, __shfl_xor_sync(~0u, send0, 8));
  keep1 = V::max(keep1, __shfl_xor_sync(~0u, send1, 8));
  // xor 4: bit 2 picks the odd slot.
  uint32_t mine = upper4 ? keep1 : keep0;
  mine = V::max(mine, __shfl_xor_sync(~0u, upper4 ? keep0 : keep1, 4));
  mine = V::max(mine, __shfl_xor_sync(~0u, mine, 2));
  mine = V::max(mine, __shfl_xor_sync(~0u, mine, 1));
  const int own = m / 4;  // the slot whose amax this lane holds
  const detail::Fp8TileScale scale = recipe.scale(V::amax_bits(mine));
  if (m % 4 == 0 && in_range(own)) scales[own * scales_step] = scale.scale;
#pragma unroll
  for (int s = 0; s < 4; ++s, out += out_step) {
    const float multiplier = __shfl_sync(~0u, scale.multiplier, 16 * half + 4 * s);
    uint32_t q[2];
    quantize_run<T, 8>(words[s], multiplier, q);
    if (feature_in && in_range(s)) *reinterpret_cast<uint2*>(out) = make_uint2(q[0], q[1]);
  }
}

// The column part of the register-resident quantizers: the column bytes of a tile of 128 tokens,
// transposed through shared memory so that they go out as whole 128-token rows (a row: a feature,
// or a column of h). A thread quantizes 4 tokens of a row into one word. Word w of row r sits at
// index 32 r + (w ^ 2 u), u = r / kRowsPerUnit, so that a warp whose 16 lanes each own one unit
// and whose half-warps hold adjacent token words stores to 32 distinct banks.
template <int kRowsPerUnit>
struct TransposedTokens {
  // `unit` is row / kRowsPerUnit, passed in: derived here, the one pass compiled to 24 more
  // bytes of stack and ~190 more instructions (the compiler does not see that (8 m + j) / 8 is m).
  static __device__ __forceinline__ int index(int row, int unit, int word) {
    return row * (kTile / 4) + (word ^ (2 * unit));
  }
  // Rows 0 .. kRows - 1 of `tile` (those below valid_rows) to out + row * ld: 16 bytes a thread
  // and pass, 8 threads a row.
  template <int kRows, int kBlockThreads>
  static __device__ __forceinline__ void store(const uint32_t* tile, int valid_rows, uint8_t* out, int64_t ld) {
    static_assert(kRows * 8 % kBlockThreads == 0, "whole passes");
#pragma unroll
    for (int it = 0; it < kRows * 8 / kBlockThreads; ++it) {
      const int index = it * kBlockThreads + int(threadIdx.x), row = index / 8, chunk = index % 8;
      const int swizzle = 2 * (row / kRowsPerUnit);
      uint4 v = reinterpret_cast<const uint4*>(tile + row * (kTile / 4))[chunk ^ (swizzle >> 2)];
      if (swizzle & 2) v = make_uint4(v.z, v.w, v.x, v.y);
      if (row < valid_rows) *reinterpret_cast<uint4*>(out + row * ld + 16 * chunk) = v;
    }
  }
};

// The bytes of a word of 4 tokens (token i in byte i) that lie before the expert's end, `valid`
// tokens from the word's first: padding tokens are zero bytes, whatever the multiplier (a NaN one
// would make them 0x7f).
__device__ __forceinline__ uint32_t tokens_kept(int valid) {
  return valid >= 4 ? ~0u : valid <= 0 ? 0u : (~0u >> (32 - 8 * valid));
}

// The row layout's row amaxes over a half-warp by halving exchanges: after the steps over lane bits
// 3, 2, 1 the thread holds the partial amax of one row, 4 b3 + 2 b2 + b1 = m / 2, and the step over
// bit 0 completes it (8 shuffles for 8 rows). Returns the amax bits of row m / 2 of the group.
template <class T>
__device__ __forceinline__ uint32_t row_amax(const uint32_t (&words)[8][RowLayout<T>::kWords], int m) {
  using V = Words<T>;
  uint32_t a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = V::fold(words[i]);
#pragma unroll
  for (int half = 4; half >= 1; half /= 2) {
    const bool upper = m & (2 * half);  // lane bit 3, 2, 1 for half 4, 2, 1
#pragma unroll
    for (int t = 0; t < half; ++t) {
      const uint32_t keep = upper ? a[t + half] : a[t], send = upper ? a[t] : a[t + half];
      a[t] = V::max(keep, __shfl_xor_sync(~0u, send, 2 * half));
    }
  }
  return V::amax_bits(V::max(a[0], __shfl_xor_sync(~0u, a[0], 1)));
}

// The strip layout's column amaxes: the warp's 16 columns folded over its 128 rows by halving
// exchanges, then a plain reduction over the lowest lane bits. Lane l ends with the amax word of
// word index l / (32 / kWords) of the strip (words of 2 or 1 columns).
template <class T>
__device__ __forceinline__ uint32_t strip_column_amax(const uint32_t (&words)[4][StripLayout<T>::kWords], int lane) {
  using V = Words<T>;
  constexpr int kWords = StripLayout<T>::kWords;
  uint32_t c[kWords];
#pragma unroll
  for (int w = 0; w < kWords; ++w)
    c[w] = V::max(V::max(V::magnitude(words[0][w]), V::magnitude(words[1][w])),
                  V::max(V::magnitude(words[2][w]), V::magnitude(words[3][w])));
  int bit = 16;
#pragma unroll
  for (int half = kWords / 2; half >= 1; half /= 2, bit /= 2) {
    const bool upper = lane & bit;
#pragma unroll
    for (int t = 0; t < half; ++t) {
      const uint32_t keep = upper ? c[t + half] : c[t], send = upper ? c[t] : c[t + half];
      c[t] = V::max(keep, __shfl_xor_sync(~0u, send, bit));
    }
  }
#pragma unroll
  for (int b = 32 / kWords / 2; b >= 1; b /= 2) c[0] = V::max(c[0], __shfl_xor_sync(~0u, c[0], b));
  return c[0];
}

// Where a staged tile came from, for the threads that quantize it.
struct Slot {
  int64_t row0;   // first row of the source
  int64_t block;  // token tile / column block (tokens), or expert (weights)
  int64_t k0;     // first feature
  int rows, features;
};

// The ring of stages: item i of [begin, end) is copied in `stages - 1` items ahead of its use (on
// one stage, just before). issue(stage) starts the copies of the next item (block-uniform; it may
// synchronize the block; items come in order) and process(stage) quantizes item i; a stage is
// refilled only after every thread passed the barrier that follows its processing.
template <class Issue, class Process>
__device__ __forceinline__ void run_stages(int64_t begin, int64_t end, int stages, Issue&& issue, Process&& process) {
  for (int p = 0; p < stages - 1; ++p) {
    if (begin + p < end) issue(p);
    ptx::cp_async_commit_group();
  }
  int stage = 0;
#pragma unroll 1
  for (int64_t i = begin; i < end; ++i) {
    if (stages == 1) {
      __syncthreads();
      issue(0);
      ptx::cp_async_commit_group();
    }
    ptx::cp_async_wait_group_at_most_2(std::max(stages - 2, 0));
    __syncthreads();
    if (stages > 1) {
      if (i + stages - 1 < end) issue(stage == 0 ? stages - 1 : stage - 1);
      ptx::cp_async_commit_group();
    }
    process(stage);
    stage = stage + 1 == stages ? 0 : stage + 1;
  }
}

// This block's even share [begin, end) of `items`.
__device__ __forceinline__ void share_of(int64_t items, int64_t& begin, int64_t& end) {
  begin = items * blockIdx.x / gridDim.x;
  end = items * (blockIdx.x + 1) / gridDim.x;
}

// ---- launch ----

// A kernel's grid and ring on one device, chosen once: the number of stages S (1..4) and blocks
// per SM B that maximize the tiles a multiprocessor holds, B x S (ties: more blocks, whose
// barriers then overlap), with a grid of B blocks per SM. MOE_ENGINE_FP8_QUANTIZE_PLAN=S,B[,N]
// sets S (or as many as fit), at most B blocks per SM and at most N blocks in all instead (A/B
// measurements; tests that cycle every ring depth with small problems): the results are the same
// bytes whatever the plan.
struct LaunchPlan {
  int grid = 0;
  int stages = 0;
  int shared_bytes = 0;
};

struct PlanOverride {
  int stages = 0, blocks = 0, grid = 0;  // 0: none
};

inline PlanOverride plan_override() {
  static const PlanOverride value = [] {
    PlanOverride o;
    const char* v = std::getenv("MOE_ENGINE_FP8_QUANTIZE_PLAN");
    const int fields = v != nullptr ? std::sscanf(v, "%d,%d,%d", &o.stages, &o.blocks, &o.grid) : 0;
    if (fields >= 2 && o.stages >= 1 && o.stages <= kMaxStages && o.blocks >= 1 && (fields == 2 || o.grid >= 1)) {
      if (fields == 2) o.grid = 0;
      return o;
    }
    return PlanOverride{};
  }();
  return value;
}

template <auto kKernel>
const LaunchPlan& launch_plan(int device, int stage_bytes, const char* what) {
  static PerDevice<LaunchPlan> plans;
  return plans.get(device, [&](int) {
    const int sm_count = device_traits(device).sm_count;
    int optin = 0;
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                   "shared memory per block");
    cudaFuncAttributes attributes{};
    MOE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kKernel), "attributes of ", what);
    const int limit = optin - int(attributes.sharedSizeBytes);
    MOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        std::min(limit, kMaxStages * stage_bytes)),
                   "raising the shared-memory limit of ", what);
    const PlanOverride forced = plan_override();
    const int most_stages = std::min(kMaxStages, limit / stage_bytes);  // forced stages: at most these
    LaunchPlan best;
    int best_blocks = 0;
    for (int s = most_stages; s >= 1; --s) {
      if (forced.stages != 0 && s != std::min(forced.stages, most_stages)) continue;
      int blocks = 0;
      MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, kThreads, size_t(s) * stage_bytes),
                     "occupancy of ", what);
      if (forced.blocks != 0) blocks = std::min(blocks, forced.blocks);
      if (blocks * s > best_blocks * best.stages || (blocks * s == best_blocks * best.stages && blocks > best_blocks)) {
        best = {blocks * sm_count, s, s * stage_bytes};
        best_blocks = blocks;
      }
    }
    MOE_CHECK(best_blocks > 0, ErrorCode::kCuda, what, " does not fit on device ", device);
    if (forced.grid != 0) best.grid = std::min(best.grid, forced.grid);
    if (std::getenv("MOE_ENGINE_VERBOSE"))
      std::fprintf(stderr, "moe-engine: %s on device %d: %d stages of %d bytes, %d blocks per SM (%d SMs), grid %d\n",
                   what, device, best.stages, stage_bytes, best_blocks, sm_count, best.grid);
    return best;
  });
}

inline int64_t blocks_of(int64_t n) { return (n + kTile - 1) / kTile; }

// Whether rows starting at `p`, `ld` elements of `bytes` apart, allow 16-byte loads.
inline bool vector_aligned(const void* p, int64_t ld, size_t bytes) {
  return is_aligned(p, 16) && (ld * int64_t(bytes)) % 16 == 0;
}

}  // namespace moe::cuda::fp8_tiles
