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

// Empty when a GPU is visible; otherwise why not (the reason every GPU test skips with).
inline std::string no_gpu_reason() {
  const GpuInventory inv = query_gpus();
  return inv.gpus.empty() ? "no CUDA GPU visible: " + inv.note : std::string();
}

}  // namespace moe::test
