// The grid of a grid-stride kernel: as many blocks as are resident at once on a device (every SM
// full), found once per kernel and device, so that no block waits for a second wave. Launch shapes
// come from the device only (graph safe: the same grid at every replay).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/runtime/check.hpp"
#include "cuda/runtime/device_traits.hpp"
#include "cuda/runtime/per_device.hpp"
#include "moe_engine/error.hpp"

namespace moe::cuda {

// `threads` per block and `shared_bytes` of dynamic shared memory (the kernel's limit is raised to
// it first when it exceeds the default 48 KiB).
template <auto kKernel>
int resident_blocks(int device, int threads, size_t shared_bytes, const char* what) {
  static PerDevice<int> blocks;
  return blocks.get(device, [&](int) {
    if (shared_bytes > 48 * 1024)
      MOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes)),
                     "raising the shared-memory limit of ", what);
    int per_sm = 0;
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, shared_bytes),
                   "occupancy of ", what);
    MOE_CHECK(per_sm > 0, ErrorCode::kCuda, what, " does not fit on device ", device);
    return device_traits(device).sm_count * per_sm;
  });
}

}  // namespace moe::cuda
