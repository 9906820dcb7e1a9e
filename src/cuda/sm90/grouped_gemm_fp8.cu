// Launcher and instantiations of the Hopper FP8 grouped GEMM (block scaling): the grouped GEMM
// kernel's body with MainloopFp8 / ProducerFp8 and the store epilogue (grouped_gemm_kernel.cuh).
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/runtime/check.hpp"
#include "cuda/sm90/grouped_gemm.hpp"
#include "cuda/sm90/grouped_gemm_kernel.cuh"
#include "cuda/sm90/heuristics.hpp"
#include "cuda/sm90/launch.cuh"
#include "cuda/sm90/tensor_maps.hpp"

namespace moe::cuda::sm90 {
namespace {

using namespace launch_detail;

struct PreparedFp8 {
  CUtensorMap a, b, d;
  GemmParams params;
};

template <Form kForm, class Out, class Pipe>
void launch_fp8(const GroupedGemmProblem& pr, const PreparedFp8& r, Stream stream) {
  cudaLaunchAttribute cluster{};
  const cudaLaunchConfig_t config =
      launch_config(persistent_grid<grouped_gemm_fp8_kernel<kForm, Out, Pipe>, Pipe>(pr.device), Pipe::kSharedBytes,
                    stream, &cluster);
  Probe::before_launch();
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&config, grouped_gemm_fp8_kernel<kForm, Out, Pipe>, r.a, r.b, r.d, r.params),
                 "launching grouped_gemm_fp8_kernel");
  Probe::after_launch(kForm);
}

template <class Pipe>
PreparedFp8 prepare_fp8(const GroupedGemmProblem& pr, Stream stream) {
  using Cfg = typename Pipe::Cfg;
  constexpr uint32_t kBM = Cfg::kBlockM, kBN = Cfg::kBlockN, kBK = Cfg::kBlockK;
  const uint32_t chunk_cols = 128 / uint32_t(dtype_size(pr.out_dtype));
  const int64_t G = pr.num_groups, N = pr.n, K = pr.k;
  PreparedFp8 r{};
  GemmParams& params = r.params;
  params.offsets = pr.offsets;
  params.num_groups = int32_t(G);
  params.bias = pr.bias.base;
  if (pr.bias.table) params.bias = params.bias_table = pr.bias.table;  // per-expert biases: a pointer table
  params.row_scale = pr.row_scale;
  params.reduce_add = pr.accumulate;
  params.multicast = multicast_enabled();
  params.a_scales = pr.a_scales;
  params.a_scale_stride = int32_t(pr.a_scales_stride);
  params.b_scales = pr.b_scales;
  if (pr.form == Form::kWgrad) {
    // D_g [N, K] = dY_g^T X_g: A = dY columns [N, C], B = X columns [K, C].
    params.m_out = int32_t(N);
    params.n_out = int32_t(K);
    r.a = make_tensor_map_3d(pr.a, pr.in_dtype, 1, N, pr.capacity, pr.a_row_stride, N * pr.a_row_stride, kBK, kBM);
    r.b = make_tensor_map_3d(pr.b.base, pr.in_dtype, 1, K, pr.capacity, pr.b_row_stride, K * pr.b_row_stride, kBK,
                             kBN / 2);
    // A per-expert dW: one map per expert (the store epilogue picks it by group); expert 0's map
    // stands in for the packed one.
    const void* d_base = pr.d.table ? pr.d.experts->expert(0).data() : pr.d.base;
    r.d = make_tensor_map_3d(d_base, pr.out_dtype, pr.d.table ? 1 : G, N, K, pr.d_row_stride, N * K, chunk_cols, 64);
    if (pr.d.table)
      params.d_maps = expert_tensor_maps(pr.device, stream, *pr.d.experts, pr.out_dtype, N, K, chunk_cols, 64);
  } else {
    // Y [T, N] = X W_g^T (forward), or dX [T, K] = dY (W_g^T)^T over the transposed copy (dgrad).
    params.n_out = int32_t(N);
    params.k = int32_t(K);
    params.b_scale_rows = int32_t((N + Cfg::kScaleBlock - 1) / Cfg::kScaleBlock);
    params.b_scale_cols = int32_t((K + Cfg::kScaleBlock - 1) / Cfg::kScaleBlock);
    r.a = make_ragged_tensor_map(pr.a, pr.in_dtype, K, pr.a_row_stride, kBK, kBM);
    r.b = make_tensor_map_3d(pr.b.base, pr.in_dtype, G, N, K, pr.b_row_stride, N * K, kBK, kBN / 2);
    r.d = make_ragged_tensor_map(pr.d.base, pr.out_dtype, N, pr.d_row_stride, chunk_cols, 64);
  }
  return r;
}

template <Form kForm, class Out, class Pipe>
void run_with(const GroupedGemmProblem& pr, Stream stream) {
  launch_fp8<kForm, Out, Pipe>(pr, prepare_fp8<Pipe>(pr, stream), stream);
}

}  // namespace

bool fp8_device_supported(int device, std::string* why) {
  const DeviceTraits& t = device_traits(device);
  if (t.major == 9 && t.minor == 0) return true;
  if (why) *why = "the Hopper FP8 kernels need compute capability 9.0";
  return false;
}

bool can_run_fp8(const GroupedGemmProblem& p, std::string* why) {
  using Cfg = Fp8PingPong::Cfg;  // the smallest tiles: the most of them
  auto no = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  if (!fp8_device_supported(p.device, why)) return false;
  if (p.in_dtype != DType::kFloat8E4M3) return no("inputs must be float8_e4m3");
  if (p.form == Form::kDgrad) return no("internal: FP8 dgrad runs as the forward form over the transposed weight");
  if (p.out_dtype != DType::kBFloat16 && p.out_dtype != DType::kFloat32) return no("outputs must be bfloat16 or float32");
  if (p.bias.defined() && (p.form != Form::kForward || p.bias_dtype != DType::kBFloat16))
    return no("the FP8 forward's bias must be bfloat16");
  if (p.accumulate && p.out_dtype != DType::kFloat32) return no("accumulation needs a float32 output");
  if (p.b.table) return no("the FP8 kernels take packed (quantized) weights");
  if (p.d.table && p.form != Form::kWgrad) return no("internal: a per-expert output of an M-grouped FP8 GEMM");
  if (p.d.table) {  // per-expert dW: one TMA map per expert, each 16-byte aligned
    if (!p.d.experts) return no("per-expert gradients without their host-side views");
    for (int64_t g = 0; g < p.d.experts->num_groups(); ++g)
      if (!is_aligned(p.d.experts->expert(g).data(), 16)) return no("TMA needs every per-expert gradient 16-byte aligned");
  }
  if (!is_aligned(p.a, 16) || !is_aligned(p.b.base, 16) || (!p.d.table && !is_aligned(p.d.base, 16)) ||
      !is_aligned(p.a_scales, 4) ||
      !is_aligned(p.b_scales, 4))
    return no("TMA needs 16-byte aligned data pointers (scales: 4-byte aligned)");
  const size_t out = dtype_size(p.out_dtype);
  if (p.a_row_stride % 16 || p.b_row_stride % 16 || (p.d_row_stride * out) % 16 || p.a_scales_stride <= 0)
    return no("TMA needs row strides that are multiples of 16 bytes");
  if (p.n % 16 || p.k % 16) return no("N and K must be multiples of 16");
  if (p.form == Form::kWgrad && p.a_scales_stride != p.n) return no("internal: wgrad's dY scales must be [C / 128, N]");
  if (p.form == Form::kWgrad && (p.capacity % Cfg::kBlockK)) return no("internal: the columns copies' width must be a multiple of 128");
  if (p.capacity >= (int64_t(1) << 30) || p.n >= (int64_t(1) << 31) || p.k >= (int64_t(1) << 31))
    return no("sizes past 2^30 rows or 2^31 columns");
  const int64_t row_tiles = p.form == Form::kWgrad ? p.num_groups * ((p.n + Cfg::kBlockM - 1) / Cfg::kBlockM)
                                                   : p.capacity / Cfg::kBlockM + p.num_groups;
  const int64_t out_cols = p.form == Form::kWgrad ? p.k : p.n;
  if (row_tiles * ((out_cols + Cfg::kBlockN - 1) / Cfg::kBlockN) + p.num_groups >= (int64_t(1) << 31))
    return no("more than 2^31 output tiles");
  return true;
}

void run_fp8(const GroupedGemmProblem& pr, Stream stream) {
  std::string why;
  MOE_CHECK(can_run_fp8(pr, &why), ErrorCode::kInternal, "sm90 FP8 grouped GEMM called for a problem it cannot run: ",
            why);
  // The pipeline heuristics.hpp picks, among the instances built (fp8_instance_exists).
  const bool out32 = pr.out_dtype == DType::kFloat32, wgrad = pr.form == Form::kWgrad;
  switch (fp8_pipeline(pr.form, pr.out_dtype, pr.capacity, pr.num_groups)) {
    case Fp8PipelineShape::kRing:
      if (!wgrad && out32) return run_with<Form::kForward, float, Fp8Ring>(pr, stream);
      if (!wgrad) return run_with<Form::kForward, __nv_bfloat16, Fp8Ring>(pr, stream);
      if (!out32) return run_with<Form::kWgrad, __nv_bfloat16, Fp8Ring>(pr, stream);
      break;
    case Fp8PipelineShape::kWideEpilogue:
      if (wgrad && out32) return run_with<Form::kWgrad, float, Fp8WideEpilogue>(pr, stream);
      break;
    case Fp8PipelineShape::kPingPong:
      if (!wgrad && !out32) return run_with<Form::kForward, __nv_bfloat16, Fp8PingPong>(pr, stream);
      break;
  }
  throw_error(ErrorCode::kInternal, "sm90 FP8 grouped GEMM: heuristics.hpp chose a pipeline with no kernel instance");
}

}  // namespace moe::cuda::sm90
