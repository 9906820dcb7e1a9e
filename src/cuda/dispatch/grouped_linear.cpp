// CUDA grouped linear: each op runs on the Hopper grouped GEMM when it can (sm_90a, TMA
// alignment; packed or per-expert tensors), otherwise on the portable kernel (sm80+, anything else).
#include <string>

#include "cuda/backend.hpp"
#include "cuda/kernels/bias_grad.hpp"
#include "cuda/gemm/grouped_gemm_problem.hpp"
#include "cuda/portable/grouped_gemm.hpp"
#include "cuda/sm90/grouped_gemm.hpp"

namespace moe::cuda {

ExpertAddress expert_address(const char* op, const char* name, const GroupedParam& p) {
  if (!p.defined()) return {};
  if (p.is_packed())
    return {p.packed_view().data(),
            int64_t(p.expert_shape().numel() * int64_t(dtype_size(p.dtype()))), nullptr};
  if (!p.pointer_table().defined())
    throw_error(ErrorCode::kInvalidArgument, op, ": ", name,
                " is per-expert; on CUDA the kernels need its device pointer table: "
                "GroupedParam::per_expert(experts, make_pointer_table(experts))");
  return {nullptr, 0, p.pointer_table().data_as<int64_t>(), &p};
}

namespace {

void run(const char* op, const GroupedGemmProblem& p, Stream stream) {
  if (sm90::can_run(p, nullptr)) return sm90::run(p, stream);
  std::string why;
  if (!portable::can_run(p, &why)) throw_error(ErrorCode::kNotImplemented, op, ": ", why);
  if (p.bias.defined() && p.bias_dtype != p.in_dtype)
    throw_error(ErrorCode::kNotImplemented, op, ": the CUDA kernels read the bias in x's dtype ",
                dtype_name(p.in_dtype), ", got ", dtype_name(p.bias_dtype));
  portable::run(p, stream);
}

ExpertAddress plain(const void* data) { return {data, 0, nullptr}; }

}  // namespace

void grouped_linear_forward(const TensorView& x, const GroupedParam& weight,
                            const GroupLayout& groups, const TensorView& y,
                            const BiasEpilogue& bias, Stream stream) {
  const char* op = "grouped_linear_forward";
  GroupedGemmProblem p = problem_for(Form::kForward, groups, x.dtype(), y.dtype());
  p.a = x.data();
  p.a_row_stride = x.stride(0);
  p.b = expert_address(op, "weight", weight);
  p.b_row_stride = weight.expert_shape()[1];
  p.d = plain(y.data());
  p.d_row_stride = y.stride(0);
  p.n = y.size(1);
  p.k = x.size(1);
  p.bias = expert_address(op, "bias", bias.bias);
  if (bias.bias.defined()) p.bias_dtype = bias.bias.dtype();
  if (bias.row_scale.defined()) p.row_scale = bias.row_scale.data_as<float>();
  run(op, p, stream);
}

void grouped_linear_dgrad(const TensorView& dy, const GroupedParam& weight,
                          const GroupLayout& groups, const TensorView& dx, Stream stream) {
  const char* op = "grouped_linear_dgrad";
  GroupedGemmProblem p = problem_for(Form::kDgrad, groups, dy.dtype(), dx.dtype());
  p.a = dy.data();
  p.a_row_stride = dy.stride(0);
  p.b = expert_address(op, "weight", weight);
  p.b_row_stride = weight.expert_shape()[1];
  p.d = plain(dx.data());
  p.d_row_stride = dx.stride(0);
  p.n = dy.size(1);
  p.k = dx.size(1);
  run(op, p, stream);
}

void grouped_linear_wgrad(const TensorView& dy, const TensorView& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode, Stream stream) {
  const char* op = "grouped_linear_wgrad";
  GroupedGemmProblem p = problem_for(Form::kWgrad, groups, dy.dtype(), dweight.dtype());
  p.a = dy.data();
  p.a_row_stride = dy.stride(0);
  p.b = plain(x.data());
  p.b_row_stride = x.stride(0);
  p.d = expert_address(op, "dweight", dweight);
  p.d_row_stride = dweight.expert_shape()[1];
  p.n = dy.size(1);
  p.k = x.size(1);
  p.accumulate = mode == GradMode::kAccumulate;
  run(op, p, stream);
}

void grouped_linear_dbias(const TensorView& dy, const GroupLayout& groups,
                          const GroupedParam& dbias, GradMode mode, const TensorView& row_scale,
                          Stream stream) {
  launch_dbias(dy, groups, expert_address("grouped_linear_dbias", "dbias", dbias), dbias.dtype(),
               mode == GradMode::kAccumulate, row_scale, stream);
}

void grouped_linear_dscales(const TensorView& dy, const GroupedParam& bias,
                            const GroupLayout& groups, const TensorView& dscales, bool accumulate,
                            Stream stream) {
  launch_dscales(dy, expert_address("grouped_linear_dscales", "bias", bias), bias.dtype(), groups,
                 dscales, accumulate, stream);
}

}  // namespace moe::cuda
