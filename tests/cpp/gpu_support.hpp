// Helpers for the GPU suites: moving tensors, poisoned device outputs, the same routing on both
// devices, captured CUDA graphs, skipping without a GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <stdexcept>
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

// The experts of a packed [G, ...] tensor (host or device) as G separate device tensors with their
// pointer table: the per-expert layout (copies complete when constructed).
struct PerExpertCopy {
  std::vector<Tensor> experts;
  Tensor table;
  GroupedParam param;
  explicit PerExpertCopy(const TensorView& packed) {
    std::vector<TensorView> views;
    for (int64_t g = 0; g < packed.size(0); ++g) {
      experts.push_back(Tensor::empty(packed.select(g).shape(), packed.dtype(), Device::cuda(0)));
      copy_tensor(experts.back(), packed.select(g));
      views.push_back(experts.back());
    }
    synchronize(nullptr);
    table = make_pointer_table(views);
    param = GroupedParam::per_expert(views, table);
  }
};

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

// What `record` enqueues on `stream`, captured once (cudaStreamCaptureModeGlobal: any unsafe
// call from any thread fails the capture) and replayed by launch(). Failures throw, which
// GoogleTest reports with the CUDA error.
class CapturedGraph {
 public:
  template <class Record>
  CapturedGraph(cudaStream_t stream, Record&& record) : stream_(stream) {
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
    record();
    check(cudaStreamEndCapture(stream, &graph_), "end capture");
    check(cudaGraphInstantiate(&exec_, graph_, 0), "instantiate");
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  // Replays the graph and waits for it.
  void launch() {
    check(cudaGraphLaunch(exec_, stream_), "launch");
    check(cudaStreamSynchronize(stream_), "synchronize after the replay");
  }

 private:
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA graph ") + what + ": " + cudaGetErrorString(e));
  }
  cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Empty when a GPU is visible; otherwise why not (the reason every GPU test skips with).
inline std::string no_gpu_reason() {
  const GpuInventory inv = query_gpus();
  return inv.gpus.empty() ? "no CUDA GPU visible: " + inv.note : std::string();
}

// Empty when device 0 runs the sm_90a kernels (the FP8 GEMMs, the fused bf16 MLP); otherwise why
// not. The quantizers run on any GPU; a test of an FP8 GEMM, module, MLP or layer skips with this.
inline std::string no_hopper_reason() {
  if (std::string why = no_gpu_reason(); !why.empty()) return why;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cudaGetDeviceProperties failed";
  if (prop.major != 9 || prop.minor != 0)
    return "the FP8 GEMMs and the fused MLP need an sm_90 GPU; device 0 is sm_" + std::to_string(prop.major) +
           std::to_string(prop.minor);
  return {};
}

#define MOE_SKIP_WITHOUT_HOPPER()                                                               \
  if (const std::string moe_no_hopper = ::moe::test::no_hopper_reason(); !moe_no_hopper.empty()) \
  GTEST_SKIP() << moe_no_hopper

// A test's size (layers, steps) under compute-sanitizer, which the GPU runner announces with
// MOE_TEST_UNDER_SANITIZER. racecheck holds shadow state of every block's shared memory for each
// launch it has not analyzed yet, so a step that enqueues many large-shared-memory kernels
// without a sync needs host memory in proportion: a twelve-layer step passed 130 GB and was killed.
inline int smaller_under_sanitizer(int normal, int smaller) {
  const char* tool = std::getenv("MOE_TEST_UNDER_SANITIZER");
  return tool != nullptr && *tool != '\0' ? smaller : normal;
}

}  // namespace moe::test
