// What launch shapes need to know of a device (SM count, compute capability), read once per device.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>

#include "cuda/runtime/check.hpp"
#include "moe_engine/error.hpp"

namespace moe::cuda {

struct DeviceTraits {
  int sm_count = 0;
  int major = 0, minor = 0;
};

// Not std::call_once: its callable's instantiation is a weak symbol of default visibility, so a
// program linking the library and compiling this header would have its own instantiation run for
// the library's call, filling the program's table and leaving the library's at zero.
inline const DeviceTraits& device_traits(int device) {
  constexpr int kMaxDevices = 64;
  static DeviceTraits traits[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  static std::mutex mutex;
  MOE_CHECK(device >= 0 && device < kMaxDevices, ErrorCode::kDevice, "device index ", device,
            " out of range");
  if (!ready[device].load(std::memory_order_acquire)) {
    const std::lock_guard<std::mutex> lock(mutex);
    if (!ready[device].load(std::memory_order_relaxed)) {
      DeviceTraits t;
      MOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.sm_count, cudaDevAttrMultiProcessorCount, device),
                     "SM count");
      MOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.major, cudaDevAttrComputeCapabilityMajor, device),
                     "compute capability");
      MOE_CUDA_CHECK(cudaDeviceGetAttribute(&t.minor, cudaDevAttrComputeCapabilityMinor, device),
                     "compute capability");
      traits[device] = t;
      ready[device].store(true, std::memory_order_release);
    }
  }
  return traits[device];
}

}  // namespace moe::cuda
