// FP8 quantizers on CUDA (moe_engine/fp8.hpp), the math of common/fp8_math.hpp: the same bytes and
// scale bits as the CPU backend. The work is a list of 128 x 128 tiles:
//   tokens (activations, gradients): 128 tokens x 128 features. Rows: one scale per token.
//     Columns: the tile never mixes experts (tiles restart at each expert's first token, so token
//     tile j is column block j of the columnwise layout); one scale per feature, the bytes stored
//     transposed (tokens contiguous). With both wanted, one kernel writes both from one read.
//   weights: one 128 x 128 block, one scale; data, and data_t transposed.
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
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "common/fp8_math.hpp"
#include "cuda/backend.hpp"
#include "cuda/gemm/expert_address.hpp"
#include "cuda/ptx/cp_async.cuh"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"

namespace moe::cuda {
namespace {

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

// ---- tokens: rows and / or columns ----

struct TokenParams {
  const void* x;
  int64_t x_ld, K, k_blocks;
  const int64_t* offsets;  // the routing's [G + 1]
  int64_t num_groups;
  uint8_t* rows_data;
  int64_t rows_ld;
  float* rows_scales;
  int64_t rows_scales_ld;
  uint8_t* cols_data;
  int64_t cols_ld;
  float* cols_scales;
  int64_t cols_scales_ld;
  int64_t* cols_offsets;  // written by block 0
  int stages;
  Recipe recipe;
};

template <class T>
struct TokenShared {
  Slot slot[kMaxStages];
  alignas(16) uint32_t col_partial[kWarps][kTile * sizeof(T) / 4];  // rows + columns: packed column magnitudes
  alignas(16) float col_multiplier[kTile];
  cub::BlockScan<int64_t, kThreads>::TempStorage scan;
  int64_t found_row0, found_rows;
};

// Scans the experts' column spans (round_up(rows, 128)) in chunks of kThreads experts; returns the
// columns of all experts (or, once `target` is found, of those scanned so far). With target >= 0,
// sets found_row0 / found_rows to column block `target`'s tokens (rows 0: none). With `write`,
// stores every expert's first column to cols_offsets. Block-uniform.
template <class T>
__device__ int64_t scan_column_spans(const TokenParams& p, int64_t target, bool write, TokenShared<T>& shared) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __syncthreads();  // earlier readers of found_* and the scan storage are done
  if (threadIdx.x == 0) shared.found_rows = 0;
  __syncthreads();
  int64_t carry = 0;  // columns of the experts before this chunk (the same in every thread)
  for (int64_t base = 0; base < p.num_groups; base += kThreads) {
    const int64_t g = base + threadIdx.x;
    const int64_t rows = g < p.num_groups ? p.offsets[g + 1] - p.offsets[g] : 0;
    const int64_t span = detail::fp8_column_span(rows);
    int64_t before = 0, total = 0;
    Scan(shared.scan).ExclusiveSum(span, before, total);
    const int64_t first = carry + before;
    if (g < p.num_groups) {
      if (write) p.cols_offsets[g] = first;
      if (first <= target && target < first + span) {
        shared.found_row0 = p.offsets[g] + (target - first);
        shared.found_rows = std::min<int64_t>(kTile, rows - (target - first));
      }
    }
    carry += total;
    __syncthreads();  // the scan's storage is reused
    if (!write && target >= 0 && carry > target) break;  // block-uniform: carry is
  }
  if (write && threadIdx.x == 0) p.cols_offsets[p.num_groups] = carry;
  return carry;
}

// Rows (row layout), and with kColumns the columns too, from the same registers: each thread's
// column amaxes over its 8 rows, combined over the 8 warps through shared memory; the bytes
// transposed through the consumed stage so that the global stores run along the tokens.
template <class T, bool kColumns>
__device__ __forceinline__ void quantize_rows_tile(const TokenParams& p, const Slot& tile, uint8_t* stage,
                                                   TokenShared<T>& shared) {
  using V = Words<T>;
  constexpr int kWords = RowLayout<T>::kWords;
  const RowLayout<T> at;
  uint32_t words[8][kWords];
  Stage<T, false>::read(stage, at, words);
  const detail::Fp8TileScale s = p.recipe.scale(row_amax<T>(words, at.m));  // row m / 2 of the group
  const int own_row = 8 * at.group + at.m / 2;
  if (at.m % 2 == 0 && own_row < tile.rows)
    p.rows_scales[tile.k0 / kTile * p.rows_scales_ld + tile.row0 + own_row] = s.scale;
  const bool features_in = 8 * at.m < tile.features;
  uint8_t* out = p.rows_data + (tile.row0 + 8 * at.group) * p.rows_ld + tile.k0 + 8 * at.m;
#pragma unroll
  for (int i = 0; i < 8; ++i, out += p.rows_ld) {
    const float multiplier = __shfl_sync(~0u, s.multiplier, (threadIdx.x & 16) | (2 * i));
    uint32_t q[2];
    quantize_run<T, 8>(words[i], multiplier, q);
    if (features_in && 8 * at.group + i < tile.rows) *reinterpret_cast<uint2*>(out) = make_uint2(q[0], q[1]);
  }
  if constexpr (kColumns) {
    uint32_t c[kWords];
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      c[w] = V::magnitude(words[0][w]);
#pragma unroll
      for (int i = 1; i < 8; ++i) c[w] = V::max(c[w], V::magnitude(words[i][w]));
      c[w] = V::max(c[w], __shfl_xor_sync(~0u, c[w], 16));
    }
    const int warp = int(threadIdx.x) / 32;
    if ((threadIdx.x & 16) == 0) {
#pragma unroll
      for (int w = 0; w < kWords / 4; ++w)
        reinterpret_cast<uint4*>(&shared.col_partial[warp][at.m * kWords])[w] =
            make_uint4(c[4 * w], c[4 * w + 1], c[4 * w + 2], c[4 * w + 3]);
    }
    __syncthreads();  // partials complete; every thread has read its values out of the stage
    if (threadIdx.x < kTile) {
      const int f = int(threadIdx.x), word = f / V::kPerWord;
      uint32_t amax = shared.col_partial[0][word];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) amax = V::max(amax, shared.col_partial[w][word]);
      const detail::Fp8TileScale cs = p.recipe.scale(V::value_bits(amax, f % V::kPerWord));
      shared.col_multiplier[f] = cs.multiplier;
      if (f < tile.features) p.cols_scales[tile.block * p.cols_scales_ld + tile.k0 + f] = cs.scale;
    }
    __syncthreads();
    float m[8];
    {
      const float4 lo = reinterpret_cast<const float4*>(shared.col_multiplier)[2 * at.m];
      const float4 hi = reinterpret_cast<const float4*>(shared.col_multiplier)[2 * at.m + 1];
      m[0] = lo.x, m[1] = lo.y, m[2] = lo.z, m[3] = lo.w, m[4] = hi.x, m[5] = hi.y, m[6] = hi.z, m[7] = hi.w;
    }
    // Padding tokens past the expert's end are zero bytes, whatever the multiplier (a NaN one
    // would make them 0x7f).
    const int valid = tile.rows - 8 * at.group;
    const uint64_t keep = valid >= 8 ? ~0ull : valid <= 0 ? 0ull : (~0ull >> (64 - 8 * valid));
    const TransposeTile transposed{stage};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t q[2];
      quantize_column<T>(words, j, m[j], q);
      const uint64_t bits = (uint64_t(q[1]) << 32 | q[0]) & keep;
      transposed.put(8 * at.m + j, at.group, make_uint2(uint32_t(bits), uint32_t(bits >> 32)));
    }
    __syncthreads();
    transposed.store(tile.features, kTile / 16, p.cols_data + tile.k0 * p.cols_ld + tile.block * kTile, p.cols_ld);
  }
}

// Columns alone (strip layout): no barrier, each warp's columns are its own.
template <class T>
__device__ __forceinline__ void quantize_strip_tile(const TokenParams& p, const Slot& tile, const uint8_t* stage) {
  using V = Words<T>;
  constexpr int kWords = StripLayout<T>::kWords;
  const StripLayout<T> at;
  uint32_t words[4][kWords];
  Stage<T, true>::read(stage, at, words);
  const bool features_in = 16 * at.warp < tile.features;  // K is a multiple of 16: the whole strip
  // Lane l's word of column amaxes holds columns kPerWord * (l / (32 / kWords)) + h of the strip.
  constexpr int kLanesPerWord = 32 / kWords;
  const uint32_t amax = strip_column_amax<T>(words, at.lane);
  const int first = V::kPerWord * (at.lane / kLanesPerWord);
  detail::Fp8TileScale s[V::kPerWord];
#pragma unroll
  for (int h = 0; h < V::kPerWord; ++h) s[h] = p.recipe.scale(V::value_bits(amax, h));
  if (at.lane % kLanesPerWord == 0 && features_in) {
    float* scales = p.cols_scales + tile.block * p.cols_scales_ld + tile.k0 + 16 * at.warp + first;
    if constexpr (V::kPacked)
      *reinterpret_cast<float2*>(scales) = make_float2(s[0].scale, s[V::kPerWord - 1].scale);
    else
      *scales = s[0].scale;
  }
  // Padding tokens past the expert's end are zero bytes, whatever the multiplier.
  const int valid = tile.rows - 4 * at.lane;
  const uint32_t keep = valid >= 4 ? ~0u : valid <= 0 ? 0u : (~0u >> (32 - 8 * valid));
  uint8_t* out = p.cols_data + (tile.k0 + 16 * at.warp) * p.cols_ld + tile.block * kTile + 4 * at.lane;
#pragma unroll
  for (int j = 0; j < 16; ++j, out += p.cols_ld) {
    const float m = __shfl_sync(~0u, s[j % V::kPerWord].multiplier, j / V::kPerWord * kLanesPerWord);
    uint32_t q[1];
    quantize_column<T>(words, j, m, q);
    if (features_in) *reinterpret_cast<uint32_t*>(out) = q[0] & keep;
  }
}

// Items: (token tile, feature block), feature blocks fastest. Rows only: the token tiles of the
// routed rows. With columns: the column blocks of the experts' segments (block 0 writes the offsets
// on the way), each holding one expert's tokens. Two blocks per SM (128 registers a thread): 3 or 4
// (80 or 64 registers, no spills) measured the same on an H200.
template <class T, bool kVector, bool kRows, bool kColumns>
__global__ void __launch_bounds__(kThreads, 2) quantize_tokens_kernel(const TokenParams p) {
  constexpr bool kStrips = kColumns && !kRows;
  using Staged = Stage<T, kStrips>;
  extern __shared__ __align__(16) uint8_t stages[];
  __shared__ TokenShared<T> shared;
  int64_t tiles;
  if constexpr (kColumns) {
    tiles = scan_column_spans(p, -1, blockIdx.x == 0, shared) / kTile;
  } else {
    tiles = (p.offsets[p.num_groups] + kTile - 1) / kTile;
  }
  int64_t begin, end;
  share_of(tiles * p.k_blocks, begin, end);
  if (begin >= end) return;  // block-uniform

  const T* x = static_cast<const T*>(p.x);
  int64_t next_tile = begin / p.k_blocks, next_kb = begin % p.k_blocks;  // the item issue() takes next
  int64_t current = -1, row0 = 0;  // the token tile whose rows are known, block-uniform
  int rows = 0;
  auto issue = [&](int stage) {
    const int64_t tile = next_tile, k0 = next_kb * kTile;
    if (++next_kb == p.k_blocks) next_kb = 0, ++next_tile;
    if (tile != current) {
      current = tile;
      if constexpr (kColumns) {
        scan_column_spans(p, tile * kTile, false, shared);
        __syncthreads();
        row0 = shared.found_row0;
        rows = int(shared.found_rows);
      } else {
        row0 = tile * kTile;
        rows = int(std::min<int64_t>(kTile, p.offsets[p.num_groups] - row0));
      }
    }
    const int features = int(std::min<int64_t>(kTile, p.K - k0));
    if (threadIdx.x == 0) shared.slot[stage] = Slot{row0, tile, k0, rows, features};
    Staged::template load<kVector>(stages + stage * Staged::kBytes, x + row0 * p.x_ld + k0, p.x_ld, rows, features);
  };
  auto process = [&](int stage) {
    const Slot tile = shared.slot[stage];
    uint8_t* staged = stages + stage * Staged::kBytes;
    if constexpr (kStrips)
      quantize_strip_tile<T>(p, tile, staged);
    else
      quantize_rows_tile<T, kColumns>(p, tile, staged, shared);
  };
  run_stages(begin, end, p.stages, issue, process);
}

// ---- weights: 128 x 128 blocks, data and / or data_t ----

struct WeightParams {
  ExpertAddress w;  // G x [N, K] contiguous
  int64_t N, K, row_blocks, col_blocks, items;
  uint8_t* data;  // [G, N, K]
  float* scales;  // [G, ceil(N/128), ceil(K/128)]
  uint8_t* data_t;  // [G, K, N]
  float* scales_t;  // [G, ceil(K/128), ceil(N/128)]
  int stages;
  Recipe recipe;
};

struct WeightShared {
  Slot slot[kMaxStages];
  uint32_t warp_amax[kWarps];
};

// Items: (expert, row block, column block), column blocks fastest; the row layout. One scale per
// block: a warp reduction, then the 8 warps' through shared memory. Each value quantized once: the
// rows' bytes go to data, their 8 x 8 transposes through the consumed stage to data_t.
template <class T, bool kVector>
__global__ void __launch_bounds__(kThreads, 2) quantize_weight_kernel(const WeightParams p) {
  using V = Words<T>;
  using Staged = Stage<T, false>;
  extern __shared__ __align__(16) uint8_t stages[];
  __shared__ WeightShared shared;
  int64_t begin, end;
  share_of(p.items, begin, end);
  if (begin >= end) return;
  const ExpertAddress address = p.w;  // a local copy: calling a member on a kernel parameter spills it
  int64_t next_kb = begin % p.col_blocks, next_nb = begin / p.col_blocks % p.row_blocks;
  int64_t next_g = begin / p.col_blocks / p.row_blocks;

  auto issue = [&](int stage) {
    const int64_t g = next_g, row0 = next_nb * kTile, k0 = next_kb * kTile;
    if (++next_kb == p.col_blocks) {
      next_kb = 0;
      if (++next_nb == p.row_blocks) next_nb = 0, ++next_g;
    }
    const int rows = int(std::min<int64_t>(kTile, p.N - row0)), features = int(std::min<int64_t>(kTile, p.K - k0));
    if (threadIdx.x == 0) shared.slot[stage] = Slot{row0, g, k0, rows, features};
    Staged::template load<kVector>(stages + stage * Staged::kBytes, address.at<const T>(g) + row0 * p.K + k0, p.K,
                                   rows, features);
  };
  auto process = [&](int stage) {
    const Slot tile = shared.slot[stage];
    const int64_t g = tile.block, nb = tile.row0 / kTile, kb = tile.k0 / kTile;
    uint8_t* staged = stages + stage * Staged::kBytes;
    const RowLayout<T> at;
    uint32_t words[8][RowLayout<T>::kWords];
    Staged::read(staged, at, words);
    uint32_t a = V::fold(words[0]);
#pragma unroll
    for (int i = 1; i < 8; ++i) a = V::max(a, V::fold(words[i]));
    a = __reduce_max_sync(~0u, V::amax_bits(a));
    if (threadIdx.x % 32 == 0) shared.warp_amax[threadIdx.x / 32] = a;
    __syncthreads();  // partials complete; every thread has read its values out of the stage
#pragma unroll
    for (int w = 0; w < kWarps; ++w) a = max(a, shared.warp_amax[w]);
    const detail::Fp8TileScale s = p.recipe.scale(a);
    if (threadIdx.x == 0) {
      if (p.scales) p.scales[(g * p.row_blocks + nb) * p.col_blocks + kb] = s.scale;
      if (p.scales_t) p.scales_t[(g * p.col_blocks + kb) * p.row_blocks + nb] = s.scale;
    }
    uint32_t q[8][2];
#pragma unroll
    for (int i = 0; i < 8; ++i) quantize_run<T, 8>(words[i], s.multiplier, q[i]);
    if (p.data && 8 * at.m < tile.features) {
      uint8_t* out = p.data + (g * p.N + tile.row0 + 8 * at.group) * p.K + tile.k0 + 8 * at.m;
#pragma unroll
      for (int i = 0; i < 8; ++i, out += p.K)
        if (8 * at.group + i < tile.rows) *reinterpret_cast<uint2*>(out) = make_uint2(q[i][0], q[i][1]);
    }
    if (p.data_t) {
      const TransposeTile transposed{staged};
#pragma unroll
      for (int j = 0; j < 8; ++j) transposed.put(8 * at.m + j, at.group, byte_column(q, j));
      __syncthreads();
      transposed.store(tile.features, tile.rows / 16, p.data_t + (g * p.K + tile.k0) * p.N + tile.row0, p.N);
    }
  };
  run_stages(begin, end, p.stages, issue, process);
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
  constexpr int kMaxDevices = 64;
  static LaunchPlan plans[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  MOE_CHECK(device >= 0 && device < kMaxDevices, ErrorCode::kDevice, "device index ", device, " out of range");
  std::call_once(once[device], [&] {
    int sm_count = 0, optin = 0;
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device), "SM count");
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
    plans[device] = best;
  });
  return plans[device];
}

template <bool kRows, bool kColumns, class T, bool kVector>
void launch_tokens(TokenParams params, int device, Stream stream) {
  constexpr auto kernel = quantize_tokens_kernel<T, kVector, kRows, kColumns>;
  const LaunchPlan& plan = launch_plan<kernel>(device, Stage<T, false>::kBytes, "quantize_tokens_kernel");
  params.stages = plan.stages;
  kernel<<<plan.grid, kThreads, plan.shared_bytes, stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH("quantize_tokens_kernel");
}

template <class T, bool kVector>
void launch_weight(WeightParams params, int device, Stream stream) {
  constexpr auto kernel = quantize_weight_kernel<T, kVector>;
  const LaunchPlan& plan = launch_plan<kernel>(device, Stage<T, false>::kBytes, "quantize_weight_kernel");
  params.stages = plan.stages;
  kernel<<<plan.grid, kThreads, plan.shared_bytes, stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH("quantize_weight_kernel");
}

int64_t blocks_of(int64_t n) { return (n + kTile - 1) / kTile; }

// Whether rows starting at `p`, `ld` elements of `bytes` apart, allow 16-byte loads.
bool vector_aligned(const void* p, int64_t ld, size_t bytes) {
  return is_aligned(p, 16) && (ld * int64_t(bytes)) % 16 == 0;
}

}  // namespace

void quantize_fp8(const TensorView& x, const GroupLayout& groups, const Fp8Rows& rows, const Fp8Columns& columns,
                  const Fp8Recipe& recipe, Stream stream) {
  const bool want_rows = rows.data.defined(), want_columns = columns.data.defined();
  const int64_t T = groups.capacity(), K = x.size(1), G = groups.num_groups();
  // Rows only: nothing to do without rows or features. Columns: the offsets are written whatever
  // the sizes.
  if (!want_columns && (T == 0 || K == 0)) return;
  TokenParams p{};
  p.x = x.data();
  p.x_ld = x.stride(0);
  p.K = K;
  p.k_blocks = blocks_of(K);
  p.offsets = groups.offsets().data_as<int64_t>();
  p.num_groups = G;
  p.recipe = {recipe.pow2_scales, recipe.amax_epsilon};
  if (want_rows) {
    p.rows_data = rows.data.data_as<uint8_t>();
    p.rows_ld = rows.data.stride(0);
    p.rows_scales = rows.scales.data_as<float>();
    p.rows_scales_ld = rows.scales.stride(0);
  }
  if (want_columns) {
    p.cols_data = columns.data.data_as<uint8_t>();
    p.cols_ld = columns.data.stride(0);
    p.cols_scales = columns.scales.data_as<float>();
    p.cols_scales_ld = columns.scales.stride(0);
    p.cols_offsets = columns.offsets.data_as<int64_t>();
  }
  const int device = x.device().index;
  with_cuda_type(x.dtype(), "quantize_fp8", [&](auto type) {
    using T = decltype(type);
    const bool vector = vector_aligned(x.data(), x.stride(0), sizeof(T));
    auto launch = [&](auto vec) {
      constexpr bool kVector = decltype(vec)::value;
      if (want_rows && want_columns)
        launch_tokens<true, true, T, kVector>(p, device, stream);
      else if (want_rows)
        launch_tokens<true, false, T, kVector>(p, device, stream);
      else
        launch_tokens<false, true, T, kVector>(p, device, stream);
    };
    if (vector)
      launch(std::true_type{});
    else
      launch(std::false_type{});
  });
}

void quantize_fp8_weight(const GroupedParam& weight, const Fp8Weight& out, const Fp8Recipe& recipe, Stream stream) {
  const int64_t G = weight.num_groups(), N = weight.expert_shape()[0], K = weight.expert_shape()[1];
  if (G == 0 || N == 0 || K == 0) return;
  WeightParams p{};
  p.w = expert_address("quantize_fp8_weight", "weight", weight);
  p.N = N;
  p.K = K;
  p.row_blocks = blocks_of(N);
  p.col_blocks = blocks_of(K);
  p.items = G * p.row_blocks * p.col_blocks;
  p.data = out.data.defined() ? out.data.data_as<uint8_t>() : nullptr;
  p.scales = out.scales.defined() ? out.scales.data_as<float>() : nullptr;
  p.data_t = out.data_t.defined() ? out.data_t.data_as<uint8_t>() : nullptr;
  p.scales_t = out.scales_t.defined() ? out.scales_t.data_as<float>() : nullptr;
  p.recipe = {recipe.pow2_scales, recipe.amax_epsilon};
  bool vector = true;
  for (int64_t g = 0; g < G; ++g) vector = vector && is_aligned(weight.expert(g).data(), 16);
  const int device = weight.device().index;
  with_cuda_type(weight.dtype(), "quantize_fp8_weight", [&](auto type) {
    using T = decltype(type);
    // K is a multiple of 16 (validated): with aligned experts every row is 16-byte aligned.
    if (vector)
      launch_weight<T, true>(p, device, stream);
    else
      launch_weight<T, false>(p, device, stream);
  });
}

}  // namespace moe::cuda
