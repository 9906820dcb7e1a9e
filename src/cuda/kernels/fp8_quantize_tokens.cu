// The FP8 token quantizers (moe_engine/fp8.hpp): activations and gradients in tiles of 128 tokens
// x 128 features, on the tile stream of fp8_tile_stream.cuh. Rows: one scale per token. Columns:
// the tile never mixes experts (tiles restart at each expert's first token, so token tile j is
// column block j of the columnwise layout); one scale per feature, the bytes stored transposed
// (tokens contiguous). With both wanted, one kernel writes both from one read of x. 16-bit x with
// aligned rows skips the tile stream: quantize_rows_direct_kernel (rows alone) and
// quantize_columns_direct_kernel (columns, alone or with the rows) hold a thread's values in
// registers, without the stream's ring and its barriers (H200: rows 0.85-0.87 of a device copy's
// rate against the stream's 0.74-0.75; columns 0.79-0.87 against 0.67-0.73; rows + columns
// 0.74-0.80).
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <type_traits>

#include "cuda/backend.hpp"
#include "cuda/kernels/fp8_tile_stream.cuh"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"
#include "cuda/runtime/resident_blocks.cuh"

namespace moe::cuda {
namespace {

using namespace fp8_tiles;

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

// Rows alone, 16-bit x with 16-byte aligned rows: straight from registers, no shared memory and no
// barrier. A half-warp holds one row's 128 features of a block (8 a lane, one 16-byte load), a
// warp 8 rows of one block (4 loads in flight a lane); its lanes compute the 8 rows' scales in
// one pass (the divisions of one row per lane) and hand the multipliers out by shuffles. Items are
// (8 rows, feature block), feature blocks fastest, taken by the warps of a grid of as many blocks
// as fit, in turn; the rows to quantize are read on the device (graph safe).
constexpr int kDirectRows = 8;  // rows of a warp's item: 4 slots of 2 rows (one per half-warp)

template <class T>
__global__ void __launch_bounds__(kThreads, 4) quantize_rows_direct_kernel(const TokenParams p) {
  static_assert(sizeof(T) == 2, "16-bit values: 8 of a row per 16-byte load");
  constexpr int kSlots = kDirectRows / 2;
  const int64_t rows_total = p.offsets[p.num_groups];
  const int64_t items = (rows_total + kDirectRows - 1) / kDirectRows * p.k_blocks;
  const int lane = int(threadIdx.x) % 32, half = lane / 16, m = lane % 16;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  const T* x = static_cast<const T*>(p.x);
#pragma unroll 1
  for (int64_t item = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32; item < items; item += warps) {
    const int64_t group = item / p.k_blocks, kb = item - group * p.k_blocks;
    const int64_t k = kb * kTile + 8 * m, row0 = group * kDirectRows + half;
    const bool feature_in = k < p.K;  // K is a multiple of 8: a lane's 8 features are all in or out
    uint32_t words[kSlots][4];
    const T* src = x + row0 * p.x_ld + k;  // one 64-bit address an item, then steps
#pragma unroll
    for (int s = 0; s < kSlots; ++s, src += 2 * p.x_ld) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (feature_in && row0 + 2 * s < rows_total) v = __ldcs(reinterpret_cast<const uint4*>(src));
      words[s][0] = v.x, words[s][1] = v.y, words[s][2] = v.z, words[s][3] = v.w;
    }
    quantize_row_slots<T>(
        p.recipe, words, p.rows_data + row0 * p.rows_ld + k, 2 * p.rows_ld, p.rows_scales + kb * p.rows_scales_ld + row0, 2,
        [&](int s) { return row0 + 2 * s < rows_total; }, feature_in, lane);
  }
}

template <class T>
void launch_rows_direct(const TokenParams& params, int device, Stream stream) {
  constexpr auto kernel = quantize_rows_direct_kernel<T>;
  kernel<<<resident_blocks<kernel>(device, kThreads, 0, "quantize_rows_direct_kernel"), kThreads, 0, stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH("quantize_rows_direct_kernel");
}

// Columns, alone or with the rows, 16-bit x with aligned rows: a block of 512 threads holds one 128-token column block
// x 128 features in registers (no block-wide staging ring): warp w rows 8 w .. 8 w + 7, half-warp h rows 8 w + 4 h .. +
// 3, lane m % 16 features 8 m .. 8 m + 7. Row amaxes are half-warp shuffles (as quantize_rows_direct_kernel); column
// amaxes fold the thread's 4 rows, then the two half-warps, then the 16 warps through shared memory; the column bytes
// (4 tokens of a feature: one word) go through a swizzled transposed tile and out as whole 128-token feature rows.
// Items are (column block, feature block), feature blocks fastest, interleaved over a resident grid; each block
// finds its column blocks' experts with warp-wide scans (32 experts a step, no block-wide scan) of a table of the
// experts' first columns in shared memory (of the offsets in global memory past kTableExperts), block 0's warp 0
// writing the columns' offsets. Three block barriers a tile; the next tiles' loads are in flight through
// them (see kColumnStages below). The same bytes as the tiled kernel.
constexpr int kColumnThreads = 512;
constexpr int kColumnWarps = kColumnThreads / 32;

// Up to this many experts a block keeps each expert's first column and row in shared memory, where
// finding an item's expert costs a shared load a lane; with more, the search reads the offsets in
// global memory: a round trip for most items once they are interleaved, which the small batch's
// short kernels (128 experts of ~32 tokens) felt: its FP8 MLP +0.6% without the table.
constexpr int kTableExperts = 1024;

struct ColumnShared {
  uint32_t transposed[kTile * kTile / 4];       // [feature][token word], word index swizzled
  uint32_t col_partial[kColumnWarps][kTile / 2];  // per warp: packed 16-bit column magnitudes
  float col_multiplier[kTile];
  int64_t first_col[kTableExperts + 1];  // expert g's first column; [G]: all experts' columns
  int64_t first_row[kTableExperts + 1];  // the routing's offsets
};

// Where a column block's tokens are: the expert whose columns hold column `col`.
struct ExpertCursor {
  int64_t g = -1, first_col = 0, row_begin = 0, rows = 0;  // -1: before the first expert; G: past the last
};

// Inclusive warp scan of a 64-bit value.
__device__ __forceinline__ int64_t warp_inclusive_sum(int64_t v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int64_t o = __shfl_up_sync(~0u, v, d);
    if (lane >= d) v += o;
  }
  return v;
}

// The total of the experts' column spans; with `write`, every expert's first column and the total
// to cols_offsets; with `table` (G <= kTableExperts), the experts' first columns and rows to it.
// Warp-uniform result.
__device__ int64_t column_total(const TokenParams& p, bool write, ColumnShared* table, int lane) {
  int64_t carry = 0;
  for (int64_t base = 0; base < p.num_groups; base += 32) {
    const int64_t g = base + lane;
    const int64_t begin = g < p.num_groups ? p.offsets[g] : 0;
    const int64_t span = g < p.num_groups ? detail::fp8_column_span(p.offsets[g + 1] - begin) : 0;
    const int64_t inclusive = warp_inclusive_sum(span, lane);
    if (g < p.num_groups) {
      if (write) p.cols_offsets[g] = carry + inclusive - span;
      if (table) table->first_col[g] = carry + inclusive - span, table->first_row[g] = begin;
    }
    carry += __shfl_sync(~0u, inclusive, 31);
  }
  if (lane == 0) {
    if (write) p.cols_offsets[p.num_groups] = carry;
    if (table) table->first_col[p.num_groups] = carry, table->first_row[p.num_groups] = p.offsets[p.num_groups];
  }
  return carry;
}

// seek_column through the shared table of column_total: 32 experts a step, a shared load each.
__device__ void seek_column_in_table(const ColumnShared& table, int64_t num_groups, int64_t col, ExpertCursor& cur,
                                     int lane) {
  for (int64_t base = cur.g < num_groups ? cur.g + 1 : cur.g; base < num_groups; base += 32) {
    const int64_t g = base + lane;
    // The first expert whose columns end past col (an empty expert's end is its start: never).
    const unsigned hit = __ballot_sync(~0u, g < num_groups && table.first_col[g + 1] > col);
    if (hit != 0) {
      cur.g = base + __ffs(hit) - 1;
      cur.first_col = table.first_col[cur.g];
      cur.row_begin = table.first_row[cur.g];
      cur.rows = table.first_row[cur.g + 1] - cur.row_begin;
      return;
    }
  }
  cur.g = num_groups;
  cur.first_col = table.first_col[num_groups];
  cur.rows = 0;
}

// Moves `cur` forward to the expert holding column `col` (col at or past cur.first_col), 32
// experts a step, through `table` when there is one. Warp-uniform.
__device__ void seek_column(const TokenParams& p, const ColumnShared* table, int64_t col, ExpertCursor& cur,
                            int lane) {
  if (cur.g < p.num_groups && col < cur.first_col + detail::fp8_column_span(cur.rows)) return;
  if (table) return seek_column_in_table(*table, p.num_groups, col, cur, lane);
  int64_t carry = cur.g < p.num_groups ? cur.first_col + detail::fp8_column_span(cur.rows) : cur.first_col;
  int64_t base = cur.g < p.num_groups ? cur.g + 1 : cur.g;
  for (; base < p.num_groups; base += 32) {
    const int64_t g = base + lane;
    const int64_t begin = g < p.num_groups ? p.offsets[g] : 0;
    const int64_t rows = g < p.num_groups ? p.offsets[g + 1] - begin : 0;
    const int64_t span = detail::fp8_column_span(rows);
    const int64_t inclusive = warp_inclusive_sum(span, lane);
    const unsigned hit = __ballot_sync(~0u, g < p.num_groups && carry + inclusive > col);
    if (hit != 0) {
      const int l = __ffs(hit) - 1;
      cur.g = base + l;
      cur.first_col = carry + __shfl_sync(~0u, inclusive - span, l);
      cur.row_begin = __shfl_sync(~0u, begin, l);
      cur.rows = __shfl_sync(~0u, rows, l);
      return;
    }
    carry += __shfl_sync(~0u, inclusive, 31);
  }
  cur.g = p.num_groups;
  cur.first_col = carry;
  cur.rows = 0;
}

// Two blocks per SM at <= 64 registers; before sm_89 (E4M3 conversion in software) the rows +
// columns kernel needs more (it spilled at 64): one block there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define MOE_FP8_COLUMN_BLOCKS_PER_SM 1
#else
#define MOE_FP8_COLUMN_BLOCKS_PER_SM 2
#endif

// Columns alone keep the next two tiles in flight: each thread's 4 x 16 bytes of them go by
// cp.async into its own slots of shared memory (dynamic, kColumnStages x 32 KiB) and are read back
// when their tile comes up (H200: 0.83-0.84 of a copy's rate against 0.81, 256 small experts 0.74
// against 0.71). With the rows the next tile's loads go into registers late in the current tile:
// staging measured 0.74-0.77 there against 0.76-0.77.
constexpr int kColumnStages = 2;
constexpr size_t kColumnStagedBytes = size_t(kColumnStages) * 4 * kColumnThreads * sizeof(uint4);

template <class T, bool kRows>
__global__ void __launch_bounds__(kColumnThreads, MOE_FP8_COLUMN_BLOCKS_PER_SM)
    quantize_columns_direct_kernel(const TokenParams p) {
  static_assert(sizeof(T) == 2, "16-bit values: 8 of a row per 16-byte load");
  using V = Words<T>;
  constexpr bool kStaged = !kRows;
  __shared__ __align__(16) ColumnShared shared;
  // 1 KiB-aligned: 16 bytes past a 128-byte line (where the static storage would put it) the columns
  // ran at 0.75-0.81 of a copy's rate against 0.79-0.87.
  extern __shared__ __align__(1024) uint4 staged[];  // [stage][slot][thread]: columns alone
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32, h = lane / 16, m = lane % 16;
  // Items interleaved over the blocks (block b takes b, b + grid, ...): the blocks at work at any
  // moment hold neighbouring items, so that x's rows, the rows' bytes and the columns' feature rows
  // are read and written in nearby DRAM pages rather than one distant stretch per block (H200,
  // against a contiguous share per block: rows + columns 0.79-0.80 of a copy's rate against
  // 0.76-0.77, 0.74 against 0.70 with 256 experts; 256 experts' columns 0.79-0.80 against 0.74).
  ColumnShared* const table = p.num_groups <= kTableExperts ? &shared : nullptr;
  const int64_t items = column_total(p, blockIdx.x == 0 && warp == 0, warp == 0 ? table : nullptr, lane) / kTile * p.k_blocks;
  __syncthreads();  // the table complete
  const int64_t first = blockIdx.x, stride = gridDim.x;
  if (first >= items) return;  // block-uniform
  const T* x = static_cast<const T*>(p.x);
  const int first_row = 8 * warp + 4 * h;  // this thread's 4 rows of the tile: first_row .. + 3
  ExpertCursor cur;
  // An item: column block j (its first row and rows) x feature block kb.
  struct Item {
    int64_t j, kb, row0;
    int rows;
  };
  // Column block it.j's first row and rows, the cursor at its expert.
  auto read_cursor = [&](Item& it) {
    const int64_t offset = it.j * kTile - cur.first_col;
    it.row0 = cur.row_begin + offset;
    it.rows = int(std::min<int64_t>(kTile, cur.rows - offset));
  };
  auto locate = [&](Item& it) {
    seek_column(p, table, it.j * kTile, cur, lane);
    read_cursor(it);
  };
  // The block's item after `it` (items are numbered feature blocks fastest).
  auto advance = [&](Item it) {
    const int64_t index = it.j * p.k_blocks + it.kb + stride, j = index / p.k_blocks;
    it.kb = index - j * p.k_blocks;
    if (j != it.j) it.j = j, locate(it);
    return it;
  };
  // This thread's 4 rows x 8 features of item (column block at `first` with `count` rows, feature
  // block fb); zeros past the rows and K.
  auto load = [&](int64_t first, int count, int64_t fb, uint32_t(&w)[4][4]) {
    const int64_t k = fb * kTile + 8 * m;
    const T* src = x + (first + first_row) * p.x_ld + k;
#pragma unroll
    for (int s = 0; s < 4; ++s, src += p.x_ld) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (k < p.K && first_row + s < count) v = __ldcs(reinterpret_cast<const uint4*>(src));
      w[s][0] = v.x, w[s][1] = v.y, w[s][2] = v.z, w[s][3] = v.w;
    }
  };
  // Columns alone: the copies of a tile at (first, count, fb) into stage `stage`; this thread reads
  // back only what it copied, so its own wait_group orders them (no barrier).
  auto issue = [&](int64_t first, int count, int64_t fb, int stage) {
    const int64_t k = fb * kTile + 8 * m;
    const T* src = x + (first + first_row) * p.x_ld + k;
#pragma unroll
    for (int s = 0; s < 4; ++s, src += p.x_ld) {
      const bool valid = k < p.K && first_row + s < count;
      const void* slot = &staged[(stage * 4 + s) * kColumnThreads + tid];
      ptx::cp_async_16(static_cast<uint32_t>(__cvta_generic_to_shared(slot)), valid ? src : x, valid);
    }
    ptx::cp_async_commit_group();
  };
  auto read_back = [&](int stage, uint32_t(&w)[4][4]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint4 v = staged[(stage * 4 + s) * kColumnThreads + tid];
      w[s][0] = v.x, w[s][1] = v.y, w[s][2] = v.z, w[s][3] = v.w;
    }
  };
  Item now{first / p.k_blocks, first % p.k_blocks, 0, 0};
  locate(now);
  uint32_t words[4][4];
  // Columns alone: the item after the current one, whose copies are in flight.
  Item ahead = now;
  int stage = 0;
  if constexpr (kStaged) {
    issue(now.row0, now.rows, now.kb, 0);
    if (first + stride < items) {
      ahead = advance(now);
      issue(ahead.row0, ahead.rows, ahead.kb, 1);
    } else {
      ptx::cp_async_commit_group();  // an empty group: one group per item
    }
  } else {
    load(now.row0, now.rows, now.kb, words);
  }
#pragma unroll 1
  for (int64_t item = first; item < items; item += stride) {
    if constexpr (kStaged) {
      ptx::cp_async_wait_group<1>();
      read_back(stage, words);
    }
    const int64_t j = now.j, kb = now.kb, row0 = now.row0;
    const int rows = now.rows;
    // With the rows: the cursor moves to the next item's expert now, before this tile's math rather
    // than in front of the next item's loads at its end (256 experts: 0.72 against 0.66 of a copy's
    // rate, before the table); the item is read off the cursor there.
    if (!kStaged && item + stride < items) seek_column(p, table, (item + stride) / p.k_blocks * kTile, cur, lane);
    const int64_t k0 = kb * kTile, k = k0 + 8 * m;
    const int features = int(std::min<int64_t>(kTile, p.K - k0));
    const bool feature_in = k < p.K;  // K is a multiple of 8: a lane's 8 features are all in or out
    // A warp whose 8 rows are all past the expert's end (the last column block of an expert) holds
    // zeros: it skips the math and contributes zero amaxes and zero bytes.
    const bool live = 8 * warp < rows;
    if (kRows && live)
      quantize_row_slots<T>(
          p.recipe, words, p.rows_data + (row0 + first_row) * p.rows_ld + k, p.rows_ld,
          p.rows_scales + kb * p.rows_scales_ld + row0 + first_row, 1, [&](int s) { return first_row + s < rows; },
          feature_in, lane);
    // Column amaxes: this thread's 4 rows, the warp's 8, then every warp's.
    uint32_t c[4] = {0, 0, 0, 0};
    // (Columns alone fold a dead warp's zeros too: skipping them there spilled at 64 registers.)
    if (kStaged || live) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        c[w] = V::max(V::max(V::magnitude(words[0][w]), V::magnitude(words[1][w])),
                      V::max(V::magnitude(words[2][w]), V::magnitude(words[3][w])));
        c[w] = V::max(c[w], __shfl_xor_sync(~0u, c[w], 16));
      }
    }
    if (h == 0) reinterpret_cast<uint4*>(shared.col_partial[warp])[m] = make_uint4(c[0], c[1], c[2], c[3]);
    // Columns alone: the stage just read is free (its values are used above): the item after next
    // goes in.
    Item after = ahead;
    if constexpr (kStaged) {
      if (item + 2 * stride < items) {
        after = advance(ahead);
        issue(after.row0, after.rows, after.kb, stage);
      } else {
        ptx::cp_async_commit_group();
      }
    }
    __syncthreads();  // partials complete (and the previous tile's transposed bytes stored)
    if (tid < kTile) {
      uint32_t amax = shared.col_partial[0][tid / 2];
#pragma unroll
      for (int w = 1; w < kColumnWarps; ++w) amax = V::max(amax, shared.col_partial[w][tid / 2]);
      const detail::Fp8TileScale cs = p.recipe.scale(V::value_bits(amax, tid % 2));
      shared.col_multiplier[tid] = cs.multiplier;
      if (tid < features) p.cols_scales[j * p.cols_scales_ld + k0 + tid] = cs.scale;
    }
    __syncthreads();  // multipliers complete; every partial read
    // Lane m's features 8 m .. 8 m + 7: unit m of the transposed tile.
    using Columns = TransposedTokens<8>;
    uint32_t* transposed = shared.transposed + Columns::index(8 * m, m, first_row / 4);
    if (live) {
      float mult[8];
      {
        const float4 lo = reinterpret_cast<const float4*>(shared.col_multiplier)[2 * m];
        const float4 hi = reinterpret_cast<const float4*>(shared.col_multiplier)[2 * m + 1];
        mult[0] = lo.x, mult[1] = lo.y, mult[2] = lo.z, mult[3] = lo.w;
        mult[4] = hi.x, mult[5] = hi.y, mult[6] = hi.z, mult[7] = hi.w;
      }
      const uint32_t keep = tokens_kept(rows - first_row);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const float mj = mult[jj];
        const uint32_t q = e4m3x4(V::value(words[0], jj) * mj, V::value(words[1], jj) * mj,
                                  V::value(words[2], jj) * mj, V::value(words[3], jj) * mj);
        transposed[jj * (kTile / 4)] = q & keep;
      }
    } else {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) transposed[jj * (kTile / 4)] = 0;
    }
    // With the rows: the next item's loads go out now, in flight through the barrier and the stores.
    Item next = now;
    if constexpr (kStaged) {
      next = ahead, ahead = after;
      stage ^= 1;
    } else if (item + stride < items) {
      next.j = (item + stride) / p.k_blocks;
      next.kb = item + stride - next.j * p.k_blocks;
      read_cursor(next);
      load(next.row0, next.rows, next.kb, words);
    }
    __syncthreads();  // the transposed tile complete
    Columns::store<kTile, kColumnThreads>(shared.transposed, features, p.cols_data + k0 * p.cols_ld + j * kTile,
                                          p.cols_ld);
    now = next;
  }
}

template <class T, bool kRows>
void launch_columns_direct(const TokenParams& params, int device, Stream stream) {
  constexpr auto kernel = quantize_columns_direct_kernel<T, kRows>;
  constexpr size_t bytes = kRows ? 0 : kColumnStagedBytes;
  const int grid = resident_blocks<kernel>(device, kColumnThreads, bytes, "quantize_columns_direct_kernel");
  kernel<<<grid, kColumnThreads, bytes, stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH("quantize_columns_direct_kernel");
}

template <bool kRows, bool kColumns, class T, bool kVector>
void launch_tokens(TokenParams params, int device, Stream stream) {
  constexpr auto kernel = quantize_tokens_kernel<T, kVector, kRows, kColumns>;
  const LaunchPlan& plan = launch_plan<kernel>(device, Stage<T, false>::kBytes, "quantize_tokens_kernel");
  params.stages = plan.stages;
  kernel<<<plan.grid, kThreads, plan.shared_bytes, stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH("quantize_tokens_kernel");
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
      if constexpr (kVector && sizeof(T) == 2) {
        if (want_columns && K % 8 == 0)
          return want_rows ? launch_columns_direct<T, true>(p, device, stream)
                           : launch_columns_direct<T, false>(p, device, stream);
      }
      if (want_rows && want_columns)
        launch_tokens<true, true, T, kVector>(p, device, stream);
      else if (want_rows) {
        if constexpr (kVector && sizeof(T) == 2) {
          if (K % 8 == 0) return launch_rows_direct<T>(p, device, stream);
        }
        launch_tokens<true, false, T, kVector>(p, device, stream);
      }
      else
        launch_tokens<false, true, T, kVector>(p, device, stream);
    };
    if (vector)
      launch(std::true_type{});
    else
      launch(std::false_type{});
  });
}

}  // namespace moe::cuda
