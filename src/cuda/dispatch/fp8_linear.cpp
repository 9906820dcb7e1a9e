// CUDA FP8 grouped linear: the Hopper FP8 grouped GEMM (sm90/grouped_gemm_fp8.cu), a float32
// forward's non-bfloat16 bias added after it. There is no portable FP8 kernel: where the Hopper
// kernel cannot run a problem the op says why.
#include <string>

#include "cuda/backend.hpp"
#include "cuda/gemm/grouped_gemm_problem.hpp"
#include "cuda/kernels/bias_grad.hpp"
#include "cuda/sm90/grouped_gemm.hpp"
#include "moe_engine/error.hpp"

namespace moe::cuda {
namespace {

void run_fp8(const char* op, const GroupedGemmProblem& p, Stream stream) {
  std::string why;
  if (!sm90::can_run_fp8(p, &why)) throw_error(ErrorCode::kNotImplemented, op, ": ", why);
  sm90::run_fp8(p, stream);
}

ExpertAddress plain(const void* data) { return {data, 0, nullptr}; }

// Forward and dgrad: rows [T, K] x a packed weight copy [G, N, K] with its block scales.
GroupedGemmProblem row_problem(const Fp8Rows& a, const TensorView& w, const TensorView& w_scales,
                               const GroupLayout& groups, const TensorView& out) {
  GroupedGemmProblem p = problem_for(Form::kForward, groups, DType::kFloat8E4M3, out.dtype());
  p.a = a.data.data();
  p.a_row_stride = a.data.stride(0);
  p.a_scales = a.scales.data_as<float>();
  p.a_scales_stride = a.scales.stride(0);
  p.b = plain(w.data());
  p.b_row_stride = w.stride(1);
  p.b_scales = w_scales.data_as<float>();
  p.d = plain(out.data());
  p.d_row_stride = out.stride(0);
  p.n = out.size(1);
  p.k = a.data.size(1);
  return p;
}

}  // namespace

bool fp8_gemms_supported(int device, std::string* why) { return sm90::fp8_device_supported(device, why); }

void grouped_linear_forward(const Fp8Rows& x, const Fp8Weight& weight, const GroupLayout& groups,
                            const TensorView& y, const BiasEpilogue& bias, Stream stream) {
  const char* op = "grouped_linear_forward";
  GroupedGemmProblem p = row_problem(x, weight.data, weight.scales, groups, y);
  // The FP8 kernel's bias epilogue reads bfloat16 biases; another bias dtype on a float32 y (a
  // float32 module's) is added after the GEMM, in float32 as the epilogue would.
  const bool bias_after = bias.bias.defined() && bias.bias.dtype() != DType::kBFloat16 && y.dtype() == DType::kFloat32;
  if (!bias_after) {
    p.bias = expert_address(op, "bias", bias.bias);
    if (bias.bias.defined()) p.bias_dtype = bias.bias.dtype();
    if (bias.row_scale.defined()) p.row_scale = bias.row_scale.data_as<float>();
  }
  run_fp8(op, p, stream);
  if (bias_after)
    launch_add_bias(y, expert_address(op, "bias", bias.bias), bias.bias.dtype(), groups, bias.row_scale, stream);
}

void grouped_linear_dgrad(const Fp8Rows& dy, const Fp8Weight& weight, const GroupLayout& groups,
                          const TensorView& dx, Stream stream) {
  run_fp8("grouped_linear_dgrad", row_problem(dy, weight.data_t, weight.scales_t, groups, dx), stream);
}

void grouped_linear_wgrad(const Fp8Columns& dy, const Fp8Columns& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode, Stream stream) {
  const char* op = "grouped_linear_wgrad";
  GroupedGemmProblem p = problem_for(Form::kWgrad, groups, DType::kFloat8E4M3, dweight.dtype());
  p.offsets = dy.offsets.data_as<int64_t>();  // the columns copies' expert offsets
  p.capacity = dy.data.size(1);
  p.a = dy.data.data();
  p.a_row_stride = dy.data.stride(0);
  p.a_scales = dy.scales.data_as<float>();
  p.a_scales_stride = dy.scales.stride(0);
  p.b = plain(x.data.data());
  p.b_row_stride = x.data.stride(0);
  p.b_scales = x.scales.data_as<float>();
  p.d = expert_address(op, "dweight", dweight);
  p.d_row_stride = dweight.expert_shape()[1];
  p.n = dy.data.size(0);
  p.k = x.data.size(0);
  p.accumulate = mode == GradMode::kAccumulate;
  run_fp8(op, p, stream);
}

}  // namespace moe::cuda
