// Helpers for the GPU suites: moving tensors, poisoned device outputs, skipping without a GPU.
#pragma once

#include <string>

#include "test_support.hpp"

namespace moe::test {

inline Tensor to_gpu(const Tensor& t) { return t.to(Device::cuda(0)); }

inline Tensor to_host(const TensorView& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype());
  copy_tensor(h, t);
  synchronize(nullptr);
  return h;
}

inline Tensor poisoned_gpu(Shape shape, DType dtype) { return to_gpu(poisoned(shape, dtype)); }

// The same routing on the CPU (for the reference) and on the GPU.
struct DualRouting {
  Routing cpu;
  Tensor splits, offsets;
  DeviceErrorFlag flag{Device::cuda(0)};
  GroupLayout gpu;
  DualRouting(std::vector<int64_t> s, int64_t capacity) : cpu(std::move(s), capacity) {
    splits = to_gpu(cpu.splits_tensor);
    offsets = Tensor::empty({cpu.num_groups() + 1}, DType::kInt64, Device::cuda(0));
    gpu = GroupLayout::compute(splits, capacity, offsets, &flag);
  }
};

// Empty when a GPU is visible; otherwise why not (the reason every GPU test skips with).
inline std::string no_gpu_reason() {
  const GpuInventory inv = query_gpus();
  return inv.gpus.empty() ? "no CUDA GPU visible: " + inv.note : std::string();
}

}  // namespace moe::test
