// What launch shapes need to know of a device (SM count, compute capability), read once per device.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/runtime/check.hpp"
#include "cuda/runtime/per_device.hpp"

namespace moe::cuda {

struct DeviceTraits {
  int sm_count = 0;
  int major = 0, minor = 0;
};

inline const DeviceTraits& device_traits(int device) {
  static PerDevice<DeviceTraits> traits;
  return traits.get(device, [](int d) {
    DeviceTraits t;
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.sm_count, cudaDevAttrMultiProcessorCount, d), "SM count");
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.major, cudaDevAttrComputeCapabilityMajor, d), "compute capability");
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.minor, cudaDevAttrComputeCapabilityMinor, d), "compute capability");
    return t;
  });
}

}  // namespace moe::cuda
