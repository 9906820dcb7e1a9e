// The device-side offsets/validation kernel behind GroupLayout::compute.
#pragma once

#include <cstdint>

#include "moe_engine/device.hpp"
#include "moe_engine/group_layout.hpp"

namespace moe::cuda {

// offsets[g] = min(sum_{h<g} max(splits[h], 0), capacity) for g = 0..G; reports negative splits
// and sum > capacity in *record. One block, fixed shape: graph safe for any G.
void launch_group_offsets(const void* splits, bool splits_are_int32, int64_t num_groups,
                          int64_t capacity, int64_t* offsets, DeviceErrorRecord* record,
                          Stream stream);

// Zeroes bytes [offsets[G] * row_bytes, rows * row_bytes) of data (rows past the routed ones).
// Fixed grid; row_bytes need not be a multiple of anything.
void launch_zero_unrouted_rows(void* data, int64_t rows, int64_t row_bytes, const int64_t* end_offset,
                               Stream stream);

}  // namespace moe::cuda
