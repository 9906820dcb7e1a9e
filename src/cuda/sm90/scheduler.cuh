// Persistent tile schedulers for 2-block clusters. Work is handed out in pairs of output tiles,
// one tile per block of a cluster: cluster c processes pairs c, c + clusters, c + 2 clusters, ...
// Where the two tiles of a pair share their B tile (same group, same columns, adjacent row
// tiles), each block loads half of it and multicasts it to both, which cuts the L2 -> SM traffic
// by a third. All state is derived on the device from the group offsets, so the launch shape
// never depends on the routing.
#pragma once

#include <cstdint>

#include "cuda/ptx/cluster.cuh"
#include "cuda/ptx/sync.cuh"
#include "cuda/sm90/config.hpp"

namespace moe::cuda::sm90 {

// Raster of a group's pair_rows x n_tiles paired tiles: bands of up to kRasterBand pair rows
// (2 kRasterBand row tiles), row-fastest within a band. The tiles running at once (one per SM)
// then cover about 2 kRasterBand row tiles x (132 / 2 kRasterBand) column tiles, so the operand
// panels they share stay in L2.
constexpr int32_t kRasterBand = 8;

__device__ __forceinline__ void band_raster(int32_t local, int32_t rows, int32_t cols, int32_t& r,
                                            int32_t& c) {
  const int32_t band_size = kRasterBand * cols;
  const int32_t band = local / band_size;
  const int32_t height = min(kRasterBand, rows - band * kRasterBand);
  const int32_t within = local - band * band_size;
  r = band * kRasterBand + within % height;
  c = within / height;
}

struct Tile {
  int32_t group;
  int32_t m0, n0;      // origin of the output tile (M-grouped: row within the group)
  int32_t k_blocks;    // kBlockK steps of the contraction (the same for both tiles of a pair)
  int64_t row_begin;   // offsets[group]
  int32_t rows;        // rows (tokens) of the group
  bool live;           // false: a ghost (the pair's other tile is the group's last); no loads, no math
  bool multicast;      // the pair shares its B tile: each block loads half of it for both
};

// Coordinates of a tile's rows in a ragged tensor map (tensor_maps.hpp): `row` within the group's
// `rows` rows, and the group's end.
__device__ __forceinline__ int32_t ragged_row(const Tile& t, int32_t row) {
  return int32_t(Config::kRaggedRows) - t.rows + row;
}
__device__ __forceinline__ int32_t ragged_end(const Tile& t) { return int32_t(t.row_begin + t.rows); }

// Pair indices are 32-bit: the host launcher checks that every problem has fewer than 2^31 pairs.
// A group of m_tiles x n_tiles tiles is cut into pairs: first the tiles of rows 2i and 2i + 1 of
// each column (sharing B), then, if m_tiles is odd, the last row in pairs of adjacent columns
// (not sharing B), the very last pair holding a ghost when n_tiles is odd too.
__device__ __forceinline__ int64_t pair_count(int64_t m_tiles, int64_t n_tiles) {
  return (m_tiles / 2) * n_tiles + (m_tiles & 1) * ((n_tiles + 1) / 2);
}

template <class Cfg = Config>
__device__ __forceinline__ void pair_tile(int32_t q, int32_t m_tiles, int32_t n_tiles, Tile& tile) {
  const uint32_t rank = ptx::cluster_rank();
  const int32_t pair_rows = m_tiles / 2;
  const int32_t paired = pair_rows * n_tiles;
  int32_t m, n;
  if (q < paired) {
    int32_t pm;
    band_raster(q, pair_rows, n_tiles, pm, n);
    m = 2 * pm + int32_t(rank);
    tile.live = true;
    tile.multicast = true;
  } else {
    m = m_tiles - 1;
    n = 2 * (q - paired) + int32_t(rank);
    tile.live = n < n_tiles;
    tile.multicast = false;
  }
  tile.m0 = m * Cfg::kBlockM;
  tile.n0 = n * Cfg::kBlockN;
}

// Forward and dgrad: the rows of each group are tiled by kBlockM, its columns by kBlockN. Pair
// indices only grow, so the walk over the groups advances monotonically. Cfg: the tile shape.
template <class Cfg = Config>
class MGroupedScheduler {
 public:
  // `prefix`: shared address of pairs-before-group[0..G] (the kernel's prologue fills it when
  // G + 1 <= Config::kOffsetSlots), or 0: then the scheduler walks the offsets in global memory,
  // which costs ~250 dependent cycles per group (qwen3: ~4 groups per lookup, small batch: ~20).
  __device__ MGroupedScheduler(const int64_t* offsets, uint32_t prefix, int32_t num_groups, int32_t n,
                               int32_t k)
      : offsets_(offsets),
        prefix_(prefix),
        num_groups_(num_groups),
        n_tiles_((n + Cfg::kBlockN - 1) / Cfg::kBlockN),
        k_blocks_((k + Cfg::kBlockK - 1) / Cfg::kBlockK) {}

  __device__ bool get(int32_t pair, Tile& tile) {
    if (prefix_) {
      if (pair >= before(num_groups_)) return false;
      // The last group g >= group_ with before(g) <= pair (pair indices only grow).
      int32_t lo = group_, hi = num_groups_;
      while (hi - lo > 1) {
        const int32_t mid = (lo + hi) / 2;
        if (before(mid) <= pair) lo = mid;
        else hi = mid;
      }
      group_ = lo;
      first_ = before(lo);
    } else {
      for (;; ++group_) {
        if (group_ >= num_groups_) return false;
        const int32_t count = pairs_of(group_);
        if (pair < first_ + count) break;
        first_ += count;
      }
    }
    const int64_t begin = __ldg(offsets_ + group_), end = __ldg(offsets_ + group_ + 1);
    const int32_t m_tiles = int32_t((end - begin + Cfg::kBlockM - 1) / Cfg::kBlockM);
    pair_tile<Cfg>(pair - first_, m_tiles, n_tiles_, tile);
    tile.group = group_;
    tile.k_blocks = k_blocks_;
    tile.row_begin = begin;
    tile.rows = int32_t(end - begin);
    return true;
  }

  // Pairs of group g (from the offsets in global memory).
  __device__ int32_t pairs_of(int32_t g) const {
    const int64_t rows = __ldg(offsets_ + g + 1) - __ldg(offsets_ + g);
    return int32_t(pair_count((rows + Cfg::kBlockM - 1) / Cfg::kBlockM, n_tiles_));
  }

  // Fills the shared prefix (one warp, before any get): lane l sums a run of groups, a warp scan
  // gives each run its start.
  __device__ void fill_prefix(uint32_t lane) const {
    const int32_t per_lane = (num_groups_ + 31) / 32;
    const int32_t g0 = min(num_groups_, int32_t(lane) * per_lane), g1 = min(num_groups_, g0 + per_lane);
    int32_t sum = 0;
    for (int32_t g = g0; g < g1; ++g) sum += pairs_of(g);
    int32_t inclusive = sum;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (int32_t(lane) >= d) inclusive += v;
    }
    int32_t run = inclusive - sum;
    for (int32_t g = g0; g < g1; ++g) {
      ptx::st_shared_b32(prefix_ + 4u * uint32_t(g), uint32_t(run));
      run += pairs_of(g);
    }
    if (lane == 31) ptx::st_shared_b32(prefix_ + 4u * uint32_t(num_groups_), uint32_t(inclusive));
  }

 private:
  __device__ int32_t before(int32_t g) const { return int32_t(ptx::ld_shared_b32(prefix_ + 4u * uint32_t(g))); }

  const int64_t* offsets_;
  uint32_t prefix_;
  int32_t num_groups_, n_tiles_, k_blocks_;
  int32_t group_ = 0;
  int32_t first_ = 0;  // index of the first pair of group_
};

// Wgrad: every group owns the same ceil(M / kBlockM) x ceil(N / kBlockN) output tiles; the
// contraction runs over the group's rows (ceil(R / kBlockK) steps, zero for an empty group).
// Both tiles of a pair belong to one group, so they have the same number of steps.
template <class Cfg = Config>
class KGroupedScheduler {
 public:
  __device__ KGroupedScheduler(const int64_t* offsets, int32_t num_groups, int32_t m, int32_t n)
      : offsets_(offsets),
        m_tiles_((m + Cfg::kBlockM - 1) / Cfg::kBlockM),
        n_tiles_((n + Cfg::kBlockN - 1) / Cfg::kBlockN),
        pairs_per_group_(int32_t(pair_count(m_tiles_, n_tiles_))),
        total_(pairs_per_group_ * num_groups) {}

  __device__ bool get(int32_t pair, Tile& tile) const {
    if (pair >= total_) return false;
    const int32_t g = pair / pairs_per_group_;
    const int64_t begin = __ldg(offsets_ + g), end = __ldg(offsets_ + g + 1);
    pair_tile<Cfg>(pair - g * pairs_per_group_, m_tiles_, n_tiles_, tile);
    tile.group = g;
    tile.rows = int32_t(end - begin);
    tile.k_blocks = (tile.rows + Cfg::kBlockK - 1) / Cfg::kBlockK;
    tile.row_begin = begin;
    return true;
  }

 private:
  const int64_t* offsets_;
  int32_t m_tiles_, n_tiles_;
  int32_t pairs_per_group_, total_;
};

}  // namespace moe::cuda::sm90
