// Times the router's 16-bit kernels (src/cuda/kernels/router_linear_16bit.cu) under every schedule
// they are built with, at the suite's router shapes, to choose logits_config and wgrad_slices
// (src/ops/router.cpp) from measurements. The kernels' file is compiled into this program (its functions
// are internal to the library). Build (from the repository root, after the library's build):
//   nvcc -std=c++20 -O3 -arch=sm_90a -Iinclude -Isrc -Ibuild/include bench/experiments/router_schedules.cu \
//        -Lbuild/src -lmoe_engine -o build/router_schedules
// Run: LD_LIBRARY_PATH=build/src build/router_schedules
#include "cuda/kernels/router_linear_16bit.cu"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <functional>
#include <vector>

using namespace moe;

namespace moe::cuda {
// The library's (src/cuda/runtime/cuda_api.cpp) is internal to it.
std::string describe_cuda_error(cudaError_t status) { return cudaGetErrorName(status); }
}  // namespace moe::cuda

namespace {

float time_us(const std::function<void()>& fn, int reps = 20) {
  for (int i = 0; i < 3; ++i) fn();
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) fn();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return 1000.f * ms / float(reps);
}

Tensor filled(Shape shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt);
  auto* p = static_cast<uint16_t*>(t.data());
  uint32_t s = 12345;
  for (int64_t i = 0; i < t.numel(); ++i) {
    s = s * 1664525u + 1013904223u;
    p[i] = uint16_t(0x3c00 + (s >> 24) - 128);  // bf16 values in [2^-1, 2^1)
  }
  return t.to(Device::cuda(0));
}

}  // namespace

int main() {
  struct Shape3 {
    const char* name;
    int64_t T, E, H;
  };
  const std::vector<Shape3> shapes = {{"mixtral", 8192, 8, 4096},    {"deepseek", 8192, 32, 7168},
                                      {"qwen3", 8192, 128, 2048},    {"gpt-oss", 8192, 16, 2880},
                                      {"small-batch", 512, 128, 2048}};
  const std::vector<cuda::LogitsConfig> configs = {{8, 4}, {2, 2}, {2, 1}};
  for (const Shape3& s : shapes) {
    const Tensor x = filled({s.T, s.H}, DType::kBFloat16), w = filled({s.E, s.H}, DType::kBFloat16);
    const Tensor logits = Tensor::empty({s.T, s.E}, DType::kFloat32, Device::cuda(0));
    const Tensor dx = Tensor::empty({s.T, s.H}, DType::kBFloat16, Device::cuda(0));
    const Tensor dw = Tensor::empty({s.E, s.H}, DType::kFloat32, Device::cuda(0));
    const double gfma = double(s.T) * s.E * s.H / 1e9;
    const cuda::LogitsConfig chosen = cuda::logits_config(s.T, s.E);
    std::printf("== %s T=%lld E=%lld H=%lld (%.2f GFMA per product); logits_config: %d experts x %d tokens\n",
                s.name, (long long)s.T, (long long)s.E, (long long)s.H, gfma, chosen.experts_per_thread,
                chosen.tokens_per_thread);
    for (const cuda::LogitsConfig c : configs) {
      const float us = time_us([&] { cuda::router_logits_16bit(x, w, logits, nullptr, c); });
      std::printf("  logits %d experts x %d tokens: %8.1f us  %6.2f TFMA/s\n", c.experts_per_thread,
                  c.tokens_per_thread, us, gfma / us * 1e3);
    }
    {
      const float us = time_us([&] { cuda::router_dgrad_16bit(logits, w, dx, false, nullptr); });
      std::printf("  dgrad: %8.1f us  %6.2f TFMA/s\n", us, gfma / us * 1e3);
    }
    for (int64_t slices : {1, 2, 4, 8, 16, 32}) {
      if (slices > s.T / 32) break;
      const Tensor partials = Tensor::empty({slices, s.E, s.H}, DType::kFloat32, Device::cuda(0));
      const float us = time_us([&] {
        cuda::router_wgrad_16bit(logits, x, slices > 1 ? TensorView(partials) : TensorView(), dw, false, nullptr);
      });
      std::printf("  wgrad %2lld slices: %8.1f us  %6.2f TFMA/s  (+ adding %.1f MiB of partial sums)\n",
                  (long long)slices, us, gfma / us * 1e3, slices > 1 ? slices * s.E * s.H * 4 / 1048576.0 : 0.0);
    }
  }
  return 0;
}
