// A routing on a device for the tools: splits copied there, offsets computed there (graph-safe
// kernel on CUDA), bad splits checked once.
#pragma once

#include <cstring>
#include <vector>

#include "moe_engine/moe_engine.hpp"

namespace moe::tools {

class DeviceRouting {
 public:
  DeviceRouting(const std::vector<int64_t>& splits, int64_t capacity, Device device,
                Stream stream = nullptr)
      : errors_(device) {
    const int64_t G = int64_t(splits.size());
    Tensor host = Tensor::empty({G}, DType::kInt64);
    std::memcpy(host.data(), splits.data(), splits.size() * sizeof(int64_t));
    splits_ = device.is_cpu() ? host : host.to(device);
    offsets_ = Tensor::empty({G + 1}, DType::kInt64, device);
    layout_ = GroupLayout::compute(splits_, capacity, offsets_, &errors_, stream);
    errors_.check(stream);
  }

  const GroupLayout& layout() const { return layout_; }
  // Throws if a kernel has reported bad splits since the last check (syncs the stream).
  void check(Stream stream = nullptr) { errors_.check(stream); }

 private:
  Tensor splits_, offsets_;
  DeviceErrorFlag errors_;
  GroupLayout layout_;
};

}  // namespace moe::tools
