// What launch shapes need to know of a device (SM count, compute capability), read once per device.
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>

#include "cuda/runtime/check.hpp"
#include "moe_engine/error.hpp"

namespace moe::cuda {

struct DeviceTraits {
  int sm_count = 0;
  int major = 0, minor = 0;
};

inline const DeviceTraits& device_traits(int device) {
  constexpr int kMaxDevices = 64;
  static DeviceTraits traits[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  MOE_CHECK(device >= 0 && device < kMaxDevices, ErrorCode::kDevice, "device index ", device,
            " out of range");
  std::call_once(once[device], [device] {
    DeviceTraits& t = traits[device];
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.sm_count, cudaDevAttrMultiProcessorCount, device),
                   "SM count");
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.major, cudaDevAttrComputeCapabilityMajor, device),
                   "compute capability");
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.minor, cudaDevAttrComputeCapabilityMinor, device),
                   "compute capability");
  });
  return traits[device];
}

}  // namespace moe::cuda
