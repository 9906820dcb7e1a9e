// The expert a position falls in, from a device array of ascending starts: kernels that walk rows
// or column blocks in one stream over all experts use it to find where an item belongs.
#pragma once

#include <cstdint>

namespace moe::cuda {

// The last g in [0, num_groups) with starts[g] <= position (binary search). Empty groups share
// their start with the next one, so the one returned is never empty when position < starts[G].
__device__ __forceinline__ int64_t group_at(const int64_t* starts, int64_t num_groups, int64_t position) {
  int64_t lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (starts[mid] <= position)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace moe::cuda
