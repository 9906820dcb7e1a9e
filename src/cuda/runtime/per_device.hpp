// A value per device, computed on first use and kept: the launch shapes' caches (SM count, grids
// from occupancy queries).
#pragma once

#include <atomic>
#include <mutex>

#include "moe_engine/error.hpp"

namespace moe::cuda {

// Declared static where used: `static PerDevice<int> grid; return grid.get(device, fill);`.
// Not std::call_once: its callable's instantiation is a weak symbol of default visibility, so a
// program that links the library and compiles these headers has its own instantiation run for the
// library's call, filling the program's cache and leaving the library's empty.
template <class T>
class PerDevice {
 public:
  // fill(device) -> T runs once per device; if it throws, the next call runs it again.
  template <class Fill>
  const T& get(int device, Fill&& fill) {
    MOE_CHECK(device >= 0 && device < kMaxDevices, ErrorCode::kDevice, "device index ", device, " out of range");
    if (!ready_[device].load(std::memory_order_acquire)) {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!ready_[device].load(std::memory_order_relaxed)) {
        values_[device] = fill(device);
        ready_[device].store(true, std::memory_order_release);
      }
    }
    return values_[device];
  }

 private:
  static constexpr int kMaxDevices = 64;
  T values_[kMaxDevices]{};
  std::atomic<bool> ready_[kMaxDevices]{};
  std::mutex mutex_;
};

}  // namespace moe::cuda
