// Launch machinery shared by the Hopper grouped GEMM's translation units: the
// persistent grid of whole clusters, and one launch of a kernel instance.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cuda/runtime/check.hpp"
#include "cuda/runtime/device_traits.hpp"
#include "cuda/runtime/per_device.hpp"
#include "cuda/gemm/grouped_gemm_problem.hpp"
#include "cuda/sm90/grouped_gemm_kernel.cuh"
#include "cuda/sm90/heuristics.hpp"
#include "cuda/sm90/probe.cuh"

namespace moe::cuda::sm90 {

// A checked problem's tensor maps and kernel parameters (grouped_gemm.cu). `e` is the GLU
// forward's act map (grouped_gemm_glu.cu); elsewhere a copy of `d`, never used. `shape`: the
// pipeline (heuristics.hpp) the maps were made for (its tile rows size the M-grouped A boxes),
// which the launch then runs.
struct Prepared {
  CUtensorMap a, b, d, e;
  GemmParams params;
  PipelineShape shape;
};
Prepared prepare(const GroupedGemmProblem& problem, PipelineShape shape, Stream stream);
// The fused MLP's GEMMs with a non-gated activation's epilogue (grouped_gemm_act.cu): r prepared
// by run_glu (grouped_gemm_glu.cu), which checked the problem.
void launch_elementwise(const GroupedGemmProblem& problem, const Prepared& r, Stream stream);

namespace launch_detail {

// MOE_ENGINE_SM90_MULTICAST=0 turns the B multicast off (same results, for A/B measurements).
inline bool multicast_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("MOE_ENGINE_SM90_MULTICAST");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

inline cudaLaunchConfig_t launch_config(int grid, uint32_t shared_bytes, Stream stream,
                                        cudaLaunchAttribute* cluster) {
  cluster->id = cudaLaunchAttributeClusterDimension;
  cluster->val.clusterDim.x = Config::kClusterSize;
  cluster->val.clusterDim.y = 1;
  cluster->val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(grid));
  config.blockDim = dim3(Config::kThreads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = cluster;
  config.numAttrs = 1;
  return config;
}

// Blocks of one kernel instance (kKernel, with Pipe's shared memory) on `device`: as many whole
// clusters as can be resident at once (a GPC with an odd number of free SMs leaves one idle),
// found once per instance and device.
template <auto kKernel, class Pipe>
int persistent_grid(int device) {
  static PerDevice<int> grid;
  return grid.get(device, [device](int) {
    MOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(Pipe::kSharedBytes)),
                   "raising the shared-memory limit of the grouped GEMM kernel");
    const int sm_count = device_traits(device).sm_count;
    cudaLaunchAttribute cluster{};
    const cudaLaunchConfig_t config = launch_config(sm_count, Pipe::kSharedBytes, nullptr, &cluster);
    int clusters = 0;
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kKernel, &config),
                   "querying how many grouped GEMM clusters fit on the device");
    MOE_CHECK(clusters > 0, ErrorCode::kCuda,
              "the grouped GEMM kernel's clusters do not fit on device ", device);
    const int blocks = std::min(clusters, sm_count / Config::kClusterSize) * Config::kClusterSize;
    if (std::getenv("MOE_ENGINE_VERBOSE"))
      std::fprintf(stderr, "moe-engine: sm90 grouped GEMM kernel on device %d: %d clusters of %d (%d SMs)\n",
                   device, blocks / Config::kClusterSize, Config::kClusterSize, sm_count);
    return blocks;
  });
}

template <Form kForm, class In, class Out, Epilogue kEpi = Epilogue::kStore, class Pipe = DeepRing>
void launch(const GroupedGemmProblem& pr, const Prepared& r, Stream stream) {
  auto kernel = grouped_gemm_kernel<kForm, In, Out, kEpi, Pipe>;
  MOE_CHECK(pr.device >= 0 && pr.device < 64, ErrorCode::kDevice, "device index ", pr.device,
            " out of range");
  cudaLaunchAttribute cluster{};
  const cudaLaunchConfig_t config =
      launch_config(persistent_grid<grouped_gemm_kernel<kForm, In, Out, kEpi, Pipe>, Pipe>(pr.device),
                    Pipe::kSharedBytes, stream, &cluster);
  Probe::before_launch();
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, r.a, r.b, r.d, r.e, r.params), "launching grouped_gemm_kernel");
  Probe::after_launch(kForm);
}

// The fused MLP's two 16-bit GEMMs with activation epilogues: FC1's forward with kForwardEpi, FC2's
// dgrad with kBackwardEpi (the GLU's or the non-gated activations' pair), on the pipeline
// prepare() made the maps for (heuristics.hpp's activation_pipeline: DeepRing, or for FC1's
// forward ActivationPingPong).
template <Epilogue kForwardEpi, Epilogue kBackwardEpi>
void launch_activation(const GroupedGemmProblem& pr, const Prepared& r, Stream stream) {
  const bool fp16 = pr.in_dtype == DType::kFloat16;
  if (pr.form == Form::kForward) {
    auto forward = [&](auto pipe) {
      using Pipe = decltype(pipe);
      if (fp16)
        launch<Form::kForward, __half, __half, kForwardEpi, Pipe>(pr, r, stream);
      else
        launch<Form::kForward, __nv_bfloat16, __nv_bfloat16, kForwardEpi, Pipe>(pr, r, stream);
    };
    switch (r.shape) {
      case PipelineShape::kDeepRing:
        return forward(DeepRing{});
      case PipelineShape::kPingPong:
        return forward(ActivationPingPong{});
      case PipelineShape::kWideEpilogue:
        break;
    }
  } else if (r.shape == PipelineShape::kDeepRing) {
    if (fp16)
      return launch<Form::kDgrad, __half, __half, kBackwardEpi, DeepRing>(pr, r, stream);
    return launch<Form::kDgrad, __nv_bfloat16, __nv_bfloat16, kBackwardEpi, DeepRing>(pr, r, stream);
  }
  throw_error(ErrorCode::kInternal, "sm90 activation GEMM: heuristics.hpp chose a pipeline with no kernel instance");
}

}  // namespace launch_detail
}  // namespace moe::cuda::sm90
