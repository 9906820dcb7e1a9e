// Persistent tile schedulers: block b processes tiles b, b + grid, b + 2 grid, ... All state is
// derived on the device from the group offsets, so the launch shape never depends on the routing.
#pragma once

#include <cstdint>

#include "cuda/sm90/config.hpp"

namespace moe::cuda::sm90 {

// Raster of a group's m_tiles x n_tiles output tiles: bands of up to kBand M-tiles, M-fastest
// within a band. The tiles running at once (one per SM) then cover about kBand M-tiles x
// (132 / kBand) N-tiles, so the operand panels they share stay in L2.
constexpr int32_t kRasterBand = 16;

__device__ __forceinline__ void band_raster(int64_t local, int32_t m_tiles, int32_t n_tiles,
                                            int32_t& m, int32_t& n) {
  const int64_t band_size = int64_t(kRasterBand) * n_tiles;
  const int32_t band = int32_t(local / band_size);
  const int32_t height = min(kRasterBand, m_tiles - band * kRasterBand);
  const int32_t within = int32_t(local - band * band_size);
  m = band * kRasterBand + within % height;
  n = within / height;
}

struct Tile {
  int32_t group;
  int32_t m0, n0;      // origin of the output tile (M-grouped: row within the group)
  int32_t k_blocks;    // kBlockK steps of the contraction
  int64_t row_begin;   // offsets[group]
  int32_t rows;        // rows (tokens) of the group
};

// Forward and dgrad: the rows of each group are tiled by kBlockM; a group of R rows has
// ceil(R / kBlockM) * ceil(N / kBlockN) tiles in band raster order. Tile indices only grow, so
// the walk over the groups advances monotonically.
class MGroupedScheduler {
 public:
  __device__ MGroupedScheduler(const int64_t* offsets, int32_t num_groups, int32_t n, int32_t k)
      : offsets_(offsets),
        num_groups_(num_groups),
        n_tiles_((n + Config::kBlockN - 1) / Config::kBlockN),
        k_blocks_((k + Config::kBlockK - 1) / Config::kBlockK) {}

  __device__ bool get(int64_t t, Tile& tile) {
    while (group_ < num_groups_) {
      const int64_t begin = __ldg(offsets_ + group_), end = __ldg(offsets_ + group_ + 1);
      const int64_t m_tiles = (end - begin + Config::kBlockM - 1) / Config::kBlockM;
      const int64_t count = m_tiles * n_tiles_;
      if (t < first_ + count) {
        int32_t m, n;
        band_raster(t - first_, int32_t(m_tiles), n_tiles_, m, n);
        tile.group = group_;
        tile.m0 = m * Config::kBlockM;
        tile.n0 = n * Config::kBlockN;
        tile.k_blocks = k_blocks_;
        tile.row_begin = begin;
        tile.rows = int32_t(end - begin);
        return true;
      }
      first_ += count;
      ++group_;
    }
    return false;
  }

 private:
  const int64_t* offsets_;
  int32_t num_groups_, n_tiles_, k_blocks_;
  int32_t group_ = 0;
  int64_t first_ = 0;  // index of the first tile of group_
};

// Wgrad: every group owns the same ceil(M / kBlockM) * ceil(N / kBlockN) output tiles; the
// contraction runs over the group's rows (ceil(R / kBlockK) steps, zero for an empty group).
class KGroupedScheduler {
 public:
  __device__ KGroupedScheduler(const int64_t* offsets, int32_t num_groups, int32_t m, int32_t n)
      : offsets_(offsets),
        m_tiles_((m + Config::kBlockM - 1) / Config::kBlockM),
        n_tiles_((n + Config::kBlockN - 1) / Config::kBlockN),
        tiles_per_group_(int64_t(m_tiles_) * n_tiles_),
        total_(tiles_per_group_ * num_groups) {}

  __device__ bool get(int64_t t, Tile& tile) const {
    if (t >= total_) return false;
    const int32_t g = int32_t(t / tiles_per_group_);
    const int64_t begin = __ldg(offsets_ + g), end = __ldg(offsets_ + g + 1);
    int32_t m, n;
    band_raster(t % tiles_per_group_, m_tiles_, n_tiles_, m, n);
    tile.group = g;
    tile.m0 = m * Config::kBlockM;
    tile.n0 = n * Config::kBlockN;
    tile.rows = int32_t(end - begin);
    tile.k_blocks = (tile.rows + Config::kBlockK - 1) / Config::kBlockK;
    tile.row_begin = begin;
    return true;
  }

 private:
  const int64_t* offsets_;
  int32_t m_tiles_, n_tiles_;
  int64_t tiles_per_group_, total_;
};

}  // namespace moe::cuda::sm90
