// CUDA grouped linear: maps each op onto the Hopper grouped GEMM.
#include <string>

#include "cuda/backend.hpp"
#include "cuda/bias_grad.hpp"
#include "cuda/sm90/grouped_gemm.hpp"

namespace moe::cuda {
namespace {

[[noreturn]] void no_kernel(const char* op, const std::string& why) {
  throw_error(ErrorCode::kNotImplemented, op, ": no CUDA kernel for this case yet: ", why);
}

void require_packed(const char* op, const char* name, const GroupedParam& p) {
  if (!p.is_packed())
    no_kernel(op, std::string(name) + " is per-expert; the CUDA kernels take packed [G, ...] tensors for now");
}

void run_or_explain(const char* op, const sm90::GroupedGemmProblem& problem, Stream stream) {
  std::string why;
  if (!sm90::can_run(problem, &why)) no_kernel(op, why);
  sm90::run(problem, stream);
}

sm90::GroupedGemmProblem problem_for(const GroupLayout& groups) {
  sm90::GroupedGemmProblem p;
  p.num_groups = groups.num_groups();
  p.capacity = groups.capacity();
  p.offsets = groups.offsets().data_as<int64_t>();
  p.device = groups.device().index;
  return p;
}

}  // namespace

void grouped_linear_forward(const TensorView& x, const GroupedParam& weight,
                            const GroupLayout& groups, const TensorView& y,
                            const BiasEpilogue& bias, Stream stream) {
  const char* op = "grouped_linear_forward";
  require_packed(op, "weight", weight);
  sm90::GroupedGemmProblem p = problem_for(groups);
  p.form = sm90::Form::kForward;
  p.in_dtype = x.dtype();
  p.out_dtype = y.dtype();
  p.a = x.data();
  p.a_row_stride = x.stride(0);
  p.b = weight.packed_view().data();
  p.b_row_stride = weight.expert_shape()[1];
  p.d = y.data();
  p.d_row_stride = y.stride(0);
  p.n = y.size(1);
  p.k = x.size(1);
  if (bias.bias.defined()) {
    require_packed(op, "bias", bias.bias);
    if (bias.bias.dtype() != x.dtype())
      no_kernel(op, std::string("the bias is ") + dtype_name(bias.bias.dtype()) + ", the kernels read it in x's dtype " +
                        dtype_name(x.dtype()));
    p.bias = bias.bias.packed_view().data();
  }
  if (bias.row_scale.defined()) p.row_scale = bias.row_scale.data_as<float>();
  run_or_explain(op, p, stream);
}

void grouped_linear_dgrad(const TensorView& dy, const GroupedParam& weight,
                          const GroupLayout& groups, const TensorView& dx, Stream stream) {
  const char* op = "grouped_linear_dgrad";
  require_packed(op, "weight", weight);
  sm90::GroupedGemmProblem p = problem_for(groups);
  p.form = sm90::Form::kDgrad;
  p.in_dtype = dy.dtype();
  p.out_dtype = dx.dtype();
  p.a = dy.data();
  p.a_row_stride = dy.stride(0);
  p.b = weight.packed_view().data();
  p.b_row_stride = weight.expert_shape()[1];
  p.d = dx.data();
  p.d_row_stride = dx.stride(0);
  p.n = dy.size(1);
  p.k = dx.size(1);
  run_or_explain(op, p, stream);
}

void grouped_linear_wgrad(const TensorView& dy, const TensorView& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode, Stream stream) {
  const char* op = "grouped_linear_wgrad";
  require_packed(op, "dweight", dweight);
  sm90::GroupedGemmProblem p = problem_for(groups);
  p.form = sm90::Form::kWgrad;
  p.in_dtype = dy.dtype();
  p.out_dtype = dweight.dtype();
  p.a = dy.data();
  p.a_row_stride = dy.stride(0);
  p.b = x.data();
  p.b_row_stride = x.stride(0);
  p.d = dweight.packed_view().data();
  p.d_row_stride = dweight.expert_shape()[1];
  p.n = dy.size(1);
  p.k = x.size(1);
  p.reduce_add = mode == GradMode::kAccumulate;
  run_or_explain(op, p, stream);
}

void grouped_linear_dbias(const TensorView& dy, const GroupLayout& groups,
                          const GroupedParam& dbias, GradMode mode, const TensorView& row_scale,
                          Stream stream) {
  require_packed("grouped_linear_dbias", "dbias", dbias);
  launch_dbias(dy, groups, dbias.packed_view(), mode == GradMode::kAccumulate, row_scale, stream);
}

void grouped_linear_dscales(const TensorView& dy, const GroupedParam& bias,
                            const GroupLayout& groups, const TensorView& dscales, bool accumulate,
                            Stream stream) {
  require_packed("grouped_linear_dscales", "bias", bias);
  launch_dscales(dy, bias.packed_view(), groups, dscales, accumulate, stream);
}

}  // namespace moe::cuda
