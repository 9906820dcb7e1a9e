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

}  // namespace moe::cuda
