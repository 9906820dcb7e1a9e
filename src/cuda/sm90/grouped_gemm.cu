// Launcher and instantiations of the Hopper grouped GEMM.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

#include "cuda/runtime/check.hpp"
#include "cuda/sm90/grouped_gemm.hpp"
#include "cuda/sm90/grouped_gemm_kernel.cuh"
#include "cuda/sm90/heuristics.hpp"
#include "cuda/sm90/launch.cuh"
#include "cuda/sm90/tensor_maps.hpp"

namespace moe::cuda::sm90 {
namespace {

using namespace launch_detail;

// One output dtype: the shared-memory split prepare() made the maps for, among the instances that exist
// (store_instance_exists: WideEpilogue for 16-bit wgrads, PingPong for fp32 wgrads and 16-bit
// forward / dgrad, DeepRing for all).
template <Form kForm, class In, class Out>
void launch_store(const GroupedGemmProblem& pr, const Prepared& r, Stream stream) {
  constexpr bool kOut32 = std::is_same_v<Out, float>;
  switch (r.shape) {
    case PipelineShape::kDeepRing:
      return launch<kForm, In, Out, Epilogue::kStore, DeepRing>(pr, r, stream);
    case PipelineShape::kWideEpilogue:
      if constexpr (store_instance_exists(PipelineShape::kWideEpilogue, kForm, kOut32))
        return launch<kForm, In, Out, Epilogue::kStore, WideEpilogue>(pr, r, stream);
      break;
    case PipelineShape::kPingPong:
      if constexpr (store_instance_exists(PipelineShape::kPingPong, kForm, kOut32))
        return launch<kForm, In, Out, Epilogue::kStore, PingPong>(pr, r, stream);
      break;
  }
  throw_error(ErrorCode::kInternal, "sm90 grouped GEMM: heuristics.hpp chose a pipeline with no kernel instance");
}

template <Form kForm, class In>
void launch_out(const GroupedGemmProblem& pr, const Prepared& r, Stream stream) {
  switch (pr.out_dtype) {
    case DType::kBFloat16:
      return launch_store<kForm, In, __nv_bfloat16>(pr, r, stream);
    case DType::kFloat16:
      return launch_store<kForm, In, __half>(pr, r, stream);
    case DType::kFloat32:
      return launch_store<kForm, In, float>(pr, r, stream);
    default:
      throw_error(ErrorCode::kInternal, "grouped GEMM: unsupported output dtype");
  }
}

template <Form kForm>
void launch_in(const GroupedGemmProblem& pr, const Prepared& r, Stream stream) {
  if (pr.in_dtype == DType::kBFloat16)
    launch_out<kForm, __nv_bfloat16>(pr, r, stream);
  else
    launch_out<kForm, __half>(pr, r, stream);
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
  if (p.bias.defined() && p.bias_dtype != p.in_dtype)
    return no("the bias must have the input dtype");
  if (p.accumulate && p.form == Form::kForward) return no("the forward does not accumulate");
  if (p.accumulate && p.form == Form::kWgrad && p.out_dtype != DType::kFloat32)
    return no("the weight gradient accumulates into a float32 output only");
  const size_t in = dtype_size(p.in_dtype), out = dtype_size(p.out_dtype);
  // Per-expert tensors: the weights (forward/dgrad) or dW (wgrad) through one TMA map per expert,
  // which needs every expert 16-byte aligned; the bias through its pointer table.
  const ExpertAddress& per_expert = p.form == Form::kWgrad ? p.d : p.b;
  const ExpertAddress& single = p.form == Form::kWgrad ? p.b : p.d;
  if (single.table) return no("internal: a per-expert tensor where one tensor is expected");
  if (per_expert.table) {
    if (!per_expert.experts) return no("per-expert tensors without their host-side views");
    for (int64_t g = 0; g < per_expert.experts->num_groups(); ++g)
      if (!is_aligned(per_expert.experts->expert(g).data(), 16))
        return no("TMA needs every per-expert tensor 16-byte aligned");
  }
  if (!is_aligned(p.a, 16) || (!p.b.table && !is_aligned(p.b.base, 16)) || (!p.d.table && !is_aligned(p.d.base, 16)))
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
  // (counted for the ping-pong's 64-row tiles, the shortest any instance takes).
  constexpr int64_t kRows = PingPong::Cfg::kBlockM;
  const int64_t row_tiles = p.form == Form::kWgrad ? p.num_groups * ((p.n + kRows - 1) / kRows)
                                                   : p.capacity / kRows + p.num_groups;
  if (row_tiles * ((out_cols + Config::kBlockN - 1) / Config::kBlockN) + p.num_groups >= (int64_t(1) << 31))
    return no("more than 2^31 output tiles");
  return true;
}

namespace {

// A per-expert operand: the kernel's packed-map parameter must still be a valid map; expert 0's
// stands in (the kernel reads the per-expert maps instead).
const void* first_expert(const ExpertAddress& a) { return a.table ? a.experts->expert(0).data() : a.base; }

}  // namespace

Prepared prepare(const GroupedGemmProblem& pr, PipelineShape shape, Stream stream) {
  std::string why;
  MOE_CHECK(can_run(pr, &why), ErrorCode::kInternal,
            "sm90 grouped GEMM called for a problem it cannot run: ", why);
  constexpr uint32_t kBN = Config::kBlockN, kBK = Config::kBlockK;
  // The M-grouped A boxes: one tile's rows (a ping-pong tile has 64).
  const uint32_t tile_rows = uint32_t(shape == PipelineShape::kPingPong ? PingPong::Cfg::kBlockM : Config::kBlockM);
  const uint32_t chunk_cols = 128 / uint32_t(dtype_size(pr.out_dtype));
  Prepared r{};
  r.shape = shape;
  GemmParams& params = r.params;
  params.offsets = pr.offsets;
  params.num_groups = int32_t(pr.num_groups);
  params.bias = pr.bias.base;
  params.row_scale = pr.row_scale;
  params.reduce_add = pr.accumulate;
  params.multicast = multicast_enabled();
  if (pr.bias.table) params.bias = params.bias_table = pr.bias.table;
  const int64_t G = pr.num_groups, N = pr.n, K = pr.k;
  // Per-expert weights (forward/dgrad) or dW (wgrad): the maps of the packed case, one per expert.
  auto expert_maps = [&](const ExpertAddress& a, DType dtype, uint32_t box_cols, uint32_t box_rows) {
    return a.table ? expert_tensor_maps(pr.device, stream, *a.experts, dtype, N, K, box_cols, box_rows) : nullptr;
  };
  const int64_t groups_b = pr.b.table ? 1 : G, groups_d = pr.d.table ? 1 : G;
  switch (pr.form) {
    case Form::kForward:
      params.n_out = int32_t(N);
      params.k = int32_t(K);
      r.a = make_ragged_tensor_map(pr.a, pr.in_dtype, K, pr.a_row_stride, kBK, tile_rows);
      // B in two halves of kBN / 2 rows (one per block of a multicasting cluster).
      r.b = make_tensor_map_3d(first_expert(pr.b), pr.in_dtype, groups_b, N, K, pr.b_row_stride, N * K, kBK, kBN / 2);
      params.b_maps = expert_maps(pr.b, pr.in_dtype, kBK, kBN / 2);
      r.d = make_ragged_tensor_map(pr.d.base, pr.out_dtype, N, pr.d_row_stride, chunk_cols, 64);
      break;
    case Form::kDgrad:
      params.n_out = int32_t(K);
      params.k = int32_t(N);
      r.a = make_ragged_tensor_map(pr.a, pr.in_dtype, N, pr.a_row_stride, kBK, tile_rows);
      r.b = make_tensor_map_3d(first_expert(pr.b), pr.in_dtype, groups_b, N, K, pr.b_row_stride, N * K, 64, kBK);
      params.b_maps = expert_maps(pr.b, pr.in_dtype, 64, kBK);
      r.d = make_ragged_tensor_map(pr.d.base, pr.out_dtype, K, pr.d_row_stride, chunk_cols, 64);
      break;
    case Form::kWgrad:
      params.m_out = int32_t(N);
      params.n_out = int32_t(K);
      r.a = make_ragged_tensor_map(pr.a, pr.in_dtype, N, pr.a_row_stride, 64, kBK);
      r.b = make_ragged_tensor_map(pr.b.base, pr.in_dtype, K, pr.b_row_stride, 64, kBK);
      r.d = make_tensor_map_3d(first_expert(pr.d), pr.out_dtype, groups_d, N, K, pr.d_row_stride, N * K,
                               chunk_cols, 64);
      params.d_maps = expert_maps(pr.d, pr.out_dtype, chunk_cols, 64);
      break;
  }
  r.e = r.d;
  return r;
}

void run(const GroupedGemmProblem& pr, Stream stream) {
  const Prepared r = prepare(pr, store_pipeline(pr.form, pr.capacity, pr.num_groups, pr.out_dtype), stream);
  switch (pr.form) {
    case Form::kForward:
      return launch_in<Form::kForward>(pr, r, stream);
    case Form::kDgrad:
      return launch_in<Form::kDgrad>(pr, r, stream);
    case Form::kWgrad:
      return launch_in<Form::kWgrad>(pr, r, stream);
  }
}

}  // namespace moe::cuda::sm90
