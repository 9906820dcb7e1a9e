// Launcher and instantiations of the Hopper grouped GEMM.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <mutex>

#include "cuda/check.hpp"
#include "cuda/sm90/grouped_gemm.hpp"
#include "cuda/sm90/grouped_gemm_kernel.cuh"
#include "cuda/sm90/tensor_maps.hpp"

namespace moe::cuda::sm90 {
namespace {

struct DeviceTraits {
  int sm_count = 0;
  int major = 0, minor = 0;
};

const DeviceTraits& device_traits(int device) {
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

// MOE_ENGINE_SM90_MULTICAST=0 turns the B multicast off (same results, for A/B measurements).
bool multicast_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("MOE_ENGINE_SM90_MULTICAST");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

cudaLaunchConfig_t launch_config(int grid, Stream stream, cudaLaunchAttribute* cluster) {
  cluster->id = cudaLaunchAttributeClusterDimension;
  cluster->val.clusterDim.x = Config::kClusterSize;
  cluster->val.clusterDim.y = 1;
  cluster->val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(grid));
  config.blockDim = dim3(Config::kThreads);
  config.dynamicSmemBytes = Config::kSharedBytes;
  config.stream = stream;
  config.attrs = cluster;
  config.numAttrs = 1;
  return config;
}

// Blocks of one kernel instance on `device`: as many whole clusters as can be resident at once
// (a GPC with an odd number of free SMs leaves one idle), found once per instance and device.
template <Form kForm, class In, class Out>
int persistent_grid(int device) {
  constexpr int kMaxDevices = 64;
  static int grid[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  std::call_once(once[device], [device] {
    auto kernel = grouped_gemm_kernel<kForm, In, Out>;
    MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(Config::kSharedBytes)),
                   "raising the shared-memory limit of the grouped GEMM kernel");
    const int sm_count = device_traits(device).sm_count;
    cudaLaunchAttribute cluster{};
    const cudaLaunchConfig_t config = launch_config(sm_count, nullptr, &cluster);
    int clusters = 0;
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config),
                   "querying how many grouped GEMM clusters fit on the device");
    MOE_CHECK(clusters > 0, ErrorCode::kCuda,
              "the grouped GEMM kernel's clusters do not fit on device ", device);
    grid[device] = std::min(clusters, sm_count / Config::kClusterSize) * Config::kClusterSize;
    if (std::getenv("MOE_ENGINE_VERBOSE"))
      std::fprintf(stderr, "moe-engine: sm90 grouped GEMM (form %d) on device %d: %d clusters of %d (%d SMs)\n",
                   int(kForm), device, grid[device] / Config::kClusterSize, Config::kClusterSize, sm_count);
  });
  return grid[device];
}

template <Form kForm, class In, class Out>
void launch(const GroupedGemmProblem& pr, const CUtensorMap& a, const CUtensorMap& b,
            const CUtensorMap& d, const GemmParams& params, Stream stream) {
  auto kernel = grouped_gemm_kernel<kForm, In, Out>;
  MOE_CHECK(pr.device >= 0 && pr.device < 64, ErrorCode::kDevice, "device index ", pr.device,
            " out of range");
  cudaLaunchAttribute cluster{};
  const cudaLaunchConfig_t config =
      launch_config(persistent_grid<kForm, In, Out>(pr.device), stream, &cluster);
#ifdef MOE_SM90_PROBE
  unsigned long long zero[16] = {};
  MOE_CUDA_CHECK(cudaMemcpyToSymbol(g_probe, zero, sizeof(zero)), "probe reset");
#endif
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, a, b, d, params), "launching grouped_gemm_kernel");
#ifdef MOE_SM90_PROBE
  unsigned long long v[16];
  MOE_CUDA_CHECK(cudaMemcpyFromSymbol(v, g_probe, sizeof(v)), "probe read");
  if (v[3])
    std::fprintf(stderr, "probe form %d: tiles %llu steps/tile %.1f, cycles/tile: mainloop %.0f epilogue %.0f gap %.0f\n",
                 int(kForm), v[3], double(v[4]) / v[3], double(v[0]) / v[3], double(v[1]) / v[3],
                 double(v[2]) / v[3]);
  if (v[3])
    std::fprintf(stderr, "probe epilogue steps/tile: setup %.0f wait %.0f bar %.0f st.shared %.0f fence %.0f bar %.0f issue %.0f\n",
                 double(v[8]) / v[3], double(v[9]) / v[3], double(v[10]) / v[3], double(v[11]) / v[3],
                 double(v[12]) / v[3], double(v[13]) / v[3], double(v[14]) / v[3]);
#endif
}

template <Form kForm, class In>
void launch_out(const GroupedGemmProblem& pr, const CUtensorMap& a, const CUtensorMap& b,
                const CUtensorMap& d, const GemmParams& params, Stream stream) {
  switch (pr.out_dtype) {
    case DType::kBFloat16:
      return launch<kForm, In, __nv_bfloat16>(pr, a, b, d, params, stream);
    case DType::kFloat16:
      return launch<kForm, In, __half>(pr, a, b, d, params, stream);
    case DType::kFloat32:
      return launch<kForm, In, float>(pr, a, b, d, params, stream);
    default:
      throw_error(ErrorCode::kInternal, "grouped GEMM: unsupported output dtype");
  }
}

template <Form kForm>
void launch_in(const GroupedGemmProblem& pr, const CUtensorMap& a, const CUtensorMap& b,
               const CUtensorMap& d, const GemmParams& params, Stream stream) {
  if (pr.in_dtype == DType::kBFloat16)
    launch_out<kForm, __nv_bfloat16>(pr, a, b, d, params, stream);
  else
    launch_out<kForm, __half>(pr, a, b, d, params, stream);
}

}  // namespace

bool can_run(const GroupedGemmProblem& p, std::string* why) {
  auto no = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  const DeviceTraits& t = device_traits(p.device);
  if (t.major != 9 || t.minor != 0) return no("the Hopper kernels need compute capability 9.0");
  if (p.in_dtype != DType::kBFloat16 && p.in_dtype != DType::kFloat16)
    return no("inputs must be bfloat16 or float16");
  if (p.out_dtype != DType::kBFloat16 && p.out_dtype != DType::kFloat16 &&
      p.out_dtype != DType::kFloat32)
    return no("outputs must be bfloat16, float16 or float32");
  if (!p.packed())
    return no("per-expert tensors (pointer tables) are not supported by the Hopper kernel yet");
  if (p.bias.defined() && p.bias_dtype != p.in_dtype)
    return no("the bias must have the input dtype");
  if (p.accumulate && p.out_dtype != DType::kFloat32)
    return no("accumulation needs a float32 output");
  const size_t in = dtype_size(p.in_dtype), out = dtype_size(p.out_dtype);
  if (!aligned16(p.a) || !aligned16(p.b.base) || !aligned16(p.d.base))
    return no("TMA needs 16-byte aligned data pointers");
  if ((p.a_row_stride * in) % 16 || (p.b_row_stride * in) % 16 || (p.d_row_stride * out) % 16)
    return no(
        "TMA needs row strides that are multiples of 16 bytes (K and N multiples of 8 for 16-bit "
        "data)");
  if (p.form == Form::kWgrad && (p.n * p.k * int64_t(out)) % 16)
    return no("TMA needs the per-expert gradient stride to be a multiple of 16 bytes");
  if (p.form != Form::kWgrad && (p.n * p.k * int64_t(in)) % 16)
    return no("TMA needs the per-expert weight stride to be a multiple of 16 bytes");
  if (p.capacity >= (int64_t(1) << 30) || p.n >= (int64_t(1) << 31) || p.k >= (int64_t(1) << 31))
    return no("sizes past 2^30 rows or 2^31 columns");
  // The schedulers count tile pairs in 32 bits (M-grouped: at most capacity / kBlockM + G row
  // tiles; pairs <= tiles + G).
  const int64_t out_cols = p.form == Form::kForward ? p.n : p.k;
  const int64_t row_tiles = p.form == Form::kWgrad
                                ? p.num_groups * ((p.n + Config::kBlockM - 1) / Config::kBlockM)
                                : p.capacity / Config::kBlockM + p.num_groups;
  if (row_tiles * ((out_cols + Config::kBlockN - 1) / Config::kBlockN) + p.num_groups >= (int64_t(1) << 31))
    return no("more than 2^31 output tiles");
  return true;
}

void run(const GroupedGemmProblem& pr, Stream stream) {
  std::string why;
  MOE_CHECK(can_run(pr, &why), ErrorCode::kInternal,
            "sm90 grouped GEMM called for a problem it cannot run: ", why);
  constexpr uint32_t kBM = Config::kBlockM, kBN = Config::kBlockN, kBK = Config::kBlockK;
  const uint32_t chunk_cols = 128 / uint32_t(dtype_size(pr.out_dtype));
  GemmParams params{};
  params.offsets = pr.offsets;
  params.num_groups = int32_t(pr.num_groups);
  params.bias = pr.bias.base;
  params.row_scale = pr.row_scale;
  params.reduce_add = pr.accumulate;
  params.multicast = multicast_enabled();
  const int64_t G = pr.num_groups, N = pr.n, K = pr.k;
  CUtensorMap a, b, d;
  switch (pr.form) {
    case Form::kForward:
      params.n_out = int32_t(N);
      params.k = int32_t(K);
      a = make_ragged_tensor_map(pr.a, pr.in_dtype, K, pr.a_row_stride, kBK, kBM);
      // B in two halves of kBN / 2 rows (one per block of a multicasting cluster).
      b = make_tensor_map_3d(pr.b.base, pr.in_dtype, G, N, K, pr.b_row_stride, N * K, kBK, kBN / 2);
      d = make_ragged_tensor_map(pr.d.base, pr.out_dtype, N, pr.d_row_stride, chunk_cols, 64);
      return launch_in<Form::kForward>(pr, a, b, d, params, stream);
    case Form::kDgrad:
      params.n_out = int32_t(K);
      params.k = int32_t(N);
      a = make_ragged_tensor_map(pr.a, pr.in_dtype, N, pr.a_row_stride, kBK, kBM);
      b = make_tensor_map_3d(pr.b.base, pr.in_dtype, G, N, K, pr.b_row_stride, N * K, 64, kBK);
      d = make_ragged_tensor_map(pr.d.base, pr.out_dtype, K, pr.d_row_stride, chunk_cols, 64);
      return launch_in<Form::kDgrad>(pr, a, b, d, params, stream);
    case Form::kWgrad:
      params.m_out = int32_t(N);
      params.n_out = int32_t(K);
      a = make_ragged_tensor_map(pr.a, pr.in_dtype, N, pr.a_row_stride, 64, kBK);
      b = make_ragged_tensor_map(pr.b.base, pr.in_dtype, K, pr.b_row_stride, 64, kBK);
      d = make_tensor_map_3d(pr.d.base, pr.out_dtype, G, N, K, pr.d_row_stride, N * K, chunk_cols,
                             64);
      return launch_in<Form::kWgrad>(pr, a, b, d, params, stream);
  }
}

}  // namespace moe::cuda::sm90
