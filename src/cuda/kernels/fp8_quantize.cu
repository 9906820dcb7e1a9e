// FP8 quantizers on CUDA (moe_engine/fp8.hpp), the math of common/fp8_math.hpp: the same bytes and
// scale bits as the CPU backend. Values are read from global memory once, into registers, in tiles
// of 128 x 128:
//   tokens (activations, gradients): 128 tokens x 128 features. Rows: one scale per token, the row
//     bytes stored straight from registers. Columns: the tile never mixes experts (tiles restart at
//     each expert's first token, so token tile j is column block j of the columnwise layout); one
//     scale per feature, the bytes transposed through shared memory so that the global stores run
//     along the tokens. With both wanted, one kernel writes both from the same registers. A block
//     takes one token tile and a run of feature blocks, loading the next feature block while it
//     quantizes the current one (the kernel is bound by latency otherwise).
//   weights: one 128 x 128 block, one scale; data stored straight, data_t transposed.
// Launch shapes come from static sizes only (tiles of the capacity T, or of the columnwise capacity
// C), the routing is read on the device and blocks without work return at once: graph safe, one
// launch for all experts, no atomics (deterministic).
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "common/fp8_math.hpp"
#include "cuda/backend.hpp"
#include "cuda/gemm/expert_address.hpp"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 128;  // == kFp8Block
static_assert(kTile == kFp8Block);

// Thread (warp w, lane l) of a tile holds rows 8 * (2 w + l / 16) + i and features 8 * (l % 16) + j,
// i, j < 8: a half-warp covers one row's 128 features (256 contiguous bytes of bf16 per load).
struct Lane {
  int m;      // feature group: features 8 m .. 8 m + 7
  int group;  // row group: rows 8 group .. 8 group + 7
  __device__ Lane() : m(threadIdx.x % 16), group(threadIdx.x / 16) {}
};

// The tile's place: rows [row0, row0 + rows) and features [k0, k0 + features) of the source.
struct TileExtent {
  int64_t row0;
  int rows;
  int64_t k0;
  int features;
};

struct Recipe {
  bool pow2;
  float epsilon;
  __device__ float scale(uint32_t amax_bits) const { return detail::fp8_tile_scale(amax_bits, pow2, epsilon); }
};

// The thread's 8 x 8 values of a tile in the input's own type: row i's 8 features in kWords 16-byte
// words (1 for 16-bit types, 2 for float). Kept raw and converted where used, so that a second tile
// can be in flight in the registers of the same thread.
template <class T>
struct RawTile {
  static constexpr int kWords = int(sizeof(T)) / 2;
  uint4 word[8][kWords];

  __device__ __forceinline__ float value(int i, int j) const {
    return to_float(reinterpret_cast<const T*>(&word[i][0])[j]);
  }
  __device__ __forceinline__ void row(int i, float (&v)[8]) const {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = value(i, j);
  }
  __device__ __forceinline__ void column(int j, float (&v)[8]) const {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = value(i, j);
  }
};

// Loads the thread's rows r < rows of a tile whose first row's first feature is at `tile`, rows
// `ld` elements apart (zeros for the other rows and where the features are past the end). 16-byte
// loads where the caller knows them aligned.
template <class T, bool kVector>
__device__ __forceinline__ void load_tile(const Lane& lane, int rows, bool features_in, const T* tile, int64_t ld,
                                          RawTile<T>& raw) {
  const T* mine = tile + 8 * lane.group * ld + 8 * lane.m;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (features_in && 8 * lane.group + i < rows) {
      const T* p = mine + i * ld;
      if constexpr (kVector) {
#pragma unroll
        for (int w = 0; w < RawTile<T>::kWords; ++w) raw.word[i][w] = reinterpret_cast<const uint4*>(p)[w];
      } else {
        T* dst = reinterpret_cast<T*>(&raw.word[i][0]);
#pragma unroll
        for (int j = 0; j < 8; ++j) dst[j] = p[j];
      }
    } else {
#pragma unroll
      for (int w = 0; w < RawTile<T>::kWords; ++w) raw.word[i][w] = make_uint4(0, 0, 0, 0);
    }
  }
}

__device__ __forceinline__ uint32_t max_bits(uint32_t a, uint32_t b) { return a > b ? a : b; }

// Eight bytes E4M3(v[j] / s) packed little-endian; one branch for the eight (multiply or divide).
__device__ __forceinline__ uint2 quantize8(const float (&v)[8], const detail::Fp8Divisor& d) {
  float q[8];
  if (d.exact_inverse) {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = v[j] * d.inverse;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[j] = detail::ieee_div(v[j], d.scale);
  }
  const auto pair = [&](int j) { return uint32_t(detail::e4m3x2_from_float(q[j], q[j + 1])); };
  return make_uint2(pair(0) | pair(2) << 16, pair(4) | pair(6) << 16);
}

// Byte j of the eight rows q[0..7], packed: column j of an 8 x 8 byte matrix.
__device__ __forceinline__ uint2 byte_column(const uint2 (&q)[8], int j) {
  const auto word = [&](int i) { return j < 4 ? q[i].x : q[i].y; };
  const unsigned b = unsigned(j % 4);
  const unsigned pick = b | (b + 4) << 4;  // byte b of the first word, byte b of the second
  const uint32_t lo = __byte_perm(__byte_perm(word(0), word(1), pick), __byte_perm(word(2), word(3), pick), 0x5410);
  const uint32_t hi = __byte_perm(__byte_perm(word(4), word(5), pick), __byte_perm(word(6), word(7), pick), 0x5410);
  return make_uint2(lo, hi);
}

// A 128 x 128-byte tile in shared memory, written by rows of the source tile (8 bytes: one feature,
// the 8 rows of a thread) and read by features (16 bytes: 16 rows of one feature). The 8-byte unit
// u of feature row f sits at unit u ^ (f / 8 % 16): a half-warp's stores (features 8 m + j, same
// u) and a quarter-warp's loads (one feature row, 8 consecutive 16-byte chunks) hit distinct banks.
struct TransposeTile {
  uint8_t bytes[kTile * kTile];

  __device__ __forceinline__ void put(int feature, int unit, uint2 value) {
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
  // Stores the transposed tile: feature f < features goes to dst_row(f), bytes [0, 16 * chunks).
  template <class RowAddress>
  __device__ __forceinline__ void store(int features, int chunks, RowAddress dst_row) const {
#pragma unroll
    for (int it = 0; it < kTile * kTile / 16 / kThreads; ++it) {
      const int index = it * kThreads + threadIdx.x, feature = index / 8, c = index % 8;
      if (feature < features && c < chunks) *reinterpret_cast<uint4*>(dst_row(feature) + 16 * c) = get(feature, c);
    }
  }
};

// ---- tokens: rows and / or columns ----

struct TokenParams {
  const void* x;
  int64_t x_ld, K;
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
  int64_t* cols_offsets;  // written by block (0, 0)
  Recipe recipe;
};

struct TokenShared {
  TransposeTile transposed;
  uint32_t col_amax[kThreads / 32][kTile];
  float col_scale[kTile];
  float row_scale[2][kTile];  // by feature block parity: a block's readers and the next one's writers
  int64_t row0, rows;
};

// Feature blocks per token block: enough to hide the next block's loads behind the current one's
// work and to spend the routing lookup on several tiles (8 measured no better on an H100).
constexpr int64_t kFeatureBlocksPerBlock = 4;

// Column block `target`'s tokens: the expert whose column span holds it, found by a block-wide scan
// of the experts' spans (round_up(rows, 128)) in chunks of kThreads experts. Block (0, 0) also
// writes every expert's first column to cols_offsets. Sets shared.row0 / rows (rows 0: no tokens).
__device__ void locate_column_block(const TokenParams& p, int64_t target, TokenShared& shared) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const bool writer = blockIdx.x == 0 && blockIdx.y == 0;
  if (threadIdx.x == 0) shared.rows = 0;
  __syncthreads();
  int64_t carry = 0;  // columns of the experts before this chunk (the same in every thread)
  for (int64_t base = 0; base < p.num_groups; base += kThreads) {
    const int64_t g = base + threadIdx.x;
    const int64_t rows = g < p.num_groups ? p.offsets[g + 1] - p.offsets[g] : 0;
    const int64_t span = detail::fp8_column_span(rows);
    int64_t before = 0, total = 0;
    Scan(scan).ExclusiveSum(span, before, total);
    const int64_t first = carry + before;
    if (g < p.num_groups) {
      if (writer) p.cols_offsets[g] = first;
      if (first <= target && target < first + span) {
        shared.row0 = p.offsets[g] + (target - first);
        shared.rows = std::min<int64_t>(kTile, rows - (target - first));
      }
    }
    carry += total;
    __syncthreads();  // the scan's storage is reused
    if (!writer && carry > target) break;  // block-uniform: carry is
  }
  if (writer && threadIdx.x == 0) p.cols_offsets[p.num_groups] = carry;
  __syncthreads();
}

// Rows and / or columns of one 128 x 128 tile whose values the thread holds in `raw` (rows past
// tile.rows are zeros when columns are wanted). `parity` alternates between feature blocks.
template <class T, bool kRows, bool kColumns>
__device__ __forceinline__ void quantize_token_tile(const TokenParams& p, const Lane& lane, const TileExtent& tile,
                                                    int64_t feature_block, int parity, const RawTile<T>& raw,
                                                    TokenShared& shared) {
  const bool features_in = 8 * lane.m < tile.features;
  if constexpr (kRows) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float v[8];
      raw.row(i, v);
      uint32_t amax = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = max_bits(amax, detail::fp8_abs_bits(v[j]));
#pragma unroll
      for (int offset = 1; offset < 16; offset *= 2) amax = max_bits(amax, __shfl_xor_sync(~0u, amax, offset));
      const float s = p.recipe.scale(amax);
      const int r = 8 * lane.group + i;
      if (lane.m == 0) shared.row_scale[parity][r] = s;
      if (features_in && r < tile.rows)
        *reinterpret_cast<uint2*>(p.rows_data + (tile.row0 + r) * p.rows_ld + tile.k0 + 8 * lane.m) =
            quantize8(v, detail::Fp8Divisor(s));
    }
  }
  if constexpr (kColumns) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t amax = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = max_bits(amax, detail::fp8_abs_bits(raw.value(i, j)));
      amax = max_bits(amax, __shfl_xor_sync(~0u, amax, 16));
      if (threadIdx.x % 32 < 16) shared.col_amax[threadIdx.x / 32][8 * lane.m + j] = amax;
    }
  }
  __syncthreads();
  if constexpr (kRows) {
    if (int(threadIdx.x) < tile.rows)
      p.rows_scales[feature_block * p.rows_scales_ld + tile.row0 + threadIdx.x] = shared.row_scale[parity][threadIdx.x];
  }
  if constexpr (kColumns) {
    if (threadIdx.x < kTile) {
      uint32_t amax = 0;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) amax = max_bits(amax, shared.col_amax[w][threadIdx.x]);
      const float s = p.recipe.scale(amax);
      shared.col_scale[threadIdx.x] = s;
      if (int(threadIdx.x) < tile.features)
        p.cols_scales[int64_t(blockIdx.x) * p.cols_scales_ld + tile.k0 + threadIdx.x] = s;
    }
    __syncthreads();
    // Padding tokens past the expert's end are zero bytes, whatever the scale (a NaN scale would
    // make them 0x7f).
    const int valid = tile.rows - 8 * lane.group;
    const uint64_t keep = valid >= 8 ? ~0ull : valid <= 0 ? 0ull : (~0ull >> (64 - 8 * valid));
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int f = 8 * lane.m + j;
      float column[8];
      raw.column(j, column);
      const uint2 q = quantize8(column, detail::Fp8Divisor(shared.col_scale[f]));
      const uint64_t bits = (uint64_t(q.y) << 32 | q.x) & keep;
      shared.transposed.put(f, lane.group, make_uint2(uint32_t(bits), uint32_t(bits >> 32)));
    }
    __syncthreads();
    uint8_t* out = p.cols_data + int64_t(blockIdx.x) * kTile;
    shared.transposed.store(tile.features, kTile / 16, [&](int f) { return out + (tile.k0 + f) * p.cols_ld; });
  }
}

// grid (token tiles, feature block runs): a token tile x kFeatureBlocksPerBlock feature blocks.
template <class T, bool kVector, bool kRows, bool kColumns>
__global__ void __launch_bounds__(kThreads, 2) quantize_tokens_kernel(const TokenParams p) {
  // A second tile in flight in registers: for rows only. Next to the columns' transposition it
  // spilled, and those kernels ran slower with it than without (H100).
  constexpr bool kPrefetch = !kColumns;
  __shared__ TokenShared shared;
  const Lane lane;
  TileExtent tile;
  if constexpr (kColumns) {
    locate_column_block(p, int64_t(blockIdx.x) * kTile, shared);
    tile.row0 = shared.row0;
    tile.rows = int(shared.rows);
  } else {
    tile.row0 = int64_t(blockIdx.x) * kTile;
    tile.rows = int(std::min<int64_t>(kTile, p.offsets[p.num_groups] - tile.row0));
  }
  const int64_t first_block = int64_t(blockIdx.y) * kFeatureBlocksPerBlock;
  const int64_t end_block = std::min<int64_t>(first_block + kFeatureBlocksPerBlock, (p.K + kTile - 1) / kTile);
  if (tile.rows <= 0 || first_block >= end_block) return;  // block-uniform

  const T* x = static_cast<const T*>(p.x) + tile.row0 * p.x_ld;
  auto load = [&](int64_t block, RawTile<T>& raw) {
    load_tile<T, kVector>(lane, tile.rows, 8 * lane.m < p.K - block * kTile, x + block * kTile, p.x_ld, raw);
  };
  RawTile<T> current, next;
  if constexpr (kPrefetch) load(first_block, current);
#pragma unroll 1
  for (int64_t block = first_block; block < end_block; ++block) {
    if constexpr (kPrefetch) {
      if (block + 1 < end_block) load(block + 1, next);
    } else {
      load(block, current);
    }
    tile.k0 = block * kTile;
    tile.features = int(std::min<int64_t>(kTile, p.K - tile.k0));
    quantize_token_tile<T, kRows, kColumns>(p, lane, tile, block, int(block & 1), current, shared);
    if constexpr (kPrefetch) current = next;
  }
}

// ---- weights: 128 x 128 blocks, data and / or data_t ----

struct WeightParams {
  ExpertAddress w;  // G x [N, K] contiguous
  int64_t N, K, row_blocks, col_blocks;
  uint8_t* data;  // [G, N, K]
  float* scales;  // [G, ceil(N/128), ceil(K/128)]
  uint8_t* data_t;  // [G, K, N]
  float* scales_t;  // [G, ceil(K/128), ceil(N/128)]
  Recipe recipe;
};

template <class T, bool kVector>
__global__ void __launch_bounds__(kThreads) quantize_weight_kernel(const WeightParams p) {
  __shared__ TransposeTile transposed;
  __shared__ uint32_t warp_amax[kThreads / 32];
  const Lane lane;
  const int64_t g = blockIdx.x / p.row_blocks, nb = blockIdx.x % p.row_blocks, kb = blockIdx.y;
  TileExtent tile;
  tile.row0 = nb * kTile;
  tile.rows = int(std::min<int64_t>(kTile, p.N - tile.row0));
  tile.k0 = kb * kTile;
  tile.features = int(std::min<int64_t>(kTile, p.K - tile.k0));

  RawTile<T> raw;
  const ExpertAddress address = p.w;  // a local copy: calling a member on a kernel parameter spills it
  const T* w = address.at<const T>(g) + tile.row0 * p.K + tile.k0;
  load_tile<T, kVector>(lane, tile.rows, 8 * lane.m < tile.features, w, p.K, raw);

  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = max_bits(amax, detail::fp8_abs_bits(raw.value(i, j)));
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) amax = max_bits(amax, __shfl_xor_sync(~0u, amax, offset));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
#pragma unroll
  for (int w8 = 0; w8 < kThreads / 32; ++w8) amax = max_bits(amax, warp_amax[w8]);
  const float s = p.recipe.scale(amax);

  // Each value quantized once: the rows' bytes go to data, their 8 x 8 transposes to data_t.
  uint2 q[8];
  const detail::Fp8Divisor divisor(s);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float v[8];
    raw.row(i, v);
    q[i] = quantize8(v, divisor);
  }
  if (threadIdx.x == 0) {
    if (p.scales) p.scales[(g * p.row_blocks + nb) * p.col_blocks + kb] = s;
    if (p.scales_t) p.scales_t[(g * p.col_blocks + kb) * p.row_blocks + nb] = s;
  }
  if (p.data && 8 * lane.m < tile.features) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 8 * lane.group + i;
      if (r < tile.rows)
        *reinterpret_cast<uint2*>(p.data + (g * p.N + tile.row0 + r) * p.K + tile.k0 + 8 * lane.m) = q[i];
    }
  }
  if (p.data_t) {
#pragma unroll
    for (int j = 0; j < 8; ++j) transposed.put(8 * lane.m + j, lane.group, byte_column(q, j));
    __syncthreads();
    uint8_t* out = p.data_t + (g * p.K + tile.k0) * p.N + tile.row0;
    transposed.store(tile.features, tile.rows / 16, [&](int f) { return out + f * p.N; });
  }
}

template <bool kRows, bool kColumns, class T, bool kVector>
void launch_tokens(const TokenParams& params, dim3 grid, Stream stream) {
  quantize_tokens_kernel<T, kVector, kRows, kColumns><<<grid, kThreads, 0, stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH("quantize_tokens_kernel");
}

int64_t blocks_of(int64_t n) { return (n + kTile - 1) / kTile; }

// Whether rows of `t` (stride `ld` elements of `bytes`) starting at `p` allow 16-byte loads.
bool vector_aligned(const void* p, int64_t ld, size_t bytes) {
  return is_aligned(p, 16) && (ld * int64_t(bytes)) % 16 == 0;
}

}  // namespace

void quantize_fp8(const TensorView& x, const GroupLayout& groups, const Fp8Rows& rows, const Fp8Columns& columns,
                  const Fp8Recipe& recipe, Stream stream) {
  const bool want_rows = rows.data.defined(), want_columns = columns.data.defined();
  const int64_t T = groups.capacity(), K = x.size(1), G = groups.num_groups();
  TokenParams p{};
  p.x = x.data();
  p.x_ld = x.stride(0);
  p.K = K;
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
  // Columns: one token tile per column block of the columnwise capacity (the offsets are written
  // even when K is 0: one row of blocks at least). Rows only: one per 128 tokens of the capacity.
  const int64_t tiles = want_columns ? fp8_columns_capacity(T, G) / kTile : blocks_of(T);
  const int64_t runs = (blocks_of(K) + kFeatureBlocksPerBlock - 1) / kFeatureBlocksPerBlock;
  const dim3 grid(unsigned(tiles), unsigned(std::max<int64_t>(runs, want_columns ? 1 : 0)));
  if (grid.x == 0 || grid.y == 0) return;
  with_cuda_type(x.dtype(), "quantize_fp8", [&](auto type) {
    using T = decltype(type);
    const bool vector = vector_aligned(x.data(), x.stride(0), sizeof(T));
    auto launch = [&](auto kernel_for) {
      if (vector)
        kernel_for(std::true_type{});
      else
        kernel_for(std::false_type{});
    };
    launch([&](auto vec) {
      constexpr bool kVector = decltype(vec)::value;
      if (want_rows && want_columns)
        launch_tokens<true, true, T, kVector>(p, grid, stream);
      else if (want_rows)
        launch_tokens<true, false, T, kVector>(p, grid, stream);
      else
        launch_tokens<false, true, T, kVector>(p, grid, stream);
    });
  });
}

void quantize_fp8_weight(const GroupedParam& weight, const Fp8Weight& out, const Fp8Recipe& recipe, Stream stream) {
  const int64_t G = weight.num_groups(), N = weight.expert_shape()[0], K = weight.expert_shape()[1];
  if (N == 0 || K == 0) return;
  WeightParams p{};
  p.w = expert_address("quantize_fp8_weight", "weight", weight);
  p.N = N;
  p.K = K;
  p.row_blocks = blocks_of(N);
  p.col_blocks = blocks_of(K);
  p.data = out.data.defined() ? out.data.data_as<uint8_t>() : nullptr;
  p.scales = out.scales.defined() ? out.scales.data_as<float>() : nullptr;
  p.data_t = out.data_t.defined() ? out.data_t.data_as<uint8_t>() : nullptr;
  p.scales_t = out.scales_t.defined() ? out.scales_t.data_as<float>() : nullptr;
  p.recipe = {recipe.pow2_scales, recipe.amax_epsilon};
  bool vector = true;
  for (int64_t g = 0; g < G; ++g) vector = vector && is_aligned(weight.expert(g).data(), 16);
  const dim3 grid(unsigned(G * p.row_blocks), unsigned(p.col_blocks));
  with_cuda_type(weight.dtype(), "quantize_fp8_weight", [&](auto type) {
    using T = decltype(type);
    if (vector)
      quantize_weight_kernel<T, true><<<grid, kThreads, 0, stream>>>(p);
    else
      quantize_weight_kernel<T, false><<<grid, kThreads, 0, stream>>>(p);
    MOE_CUDA_CHECK_LAUNCH("quantize_weight_kernel");
  });
}

}  // namespace moe::cuda
