// grouped linear ops: validation, then dispatch by device.
#include "moe_engine/grouped_linear.hpp"

#include "cpu/backend.hpp"
#include "moe_engine/config.hpp"
#if MOE_ENGINE_WITH_CUDA
#include "cuda/backend.hpp"
#endif
#include "ops/validate.hpp"

namespace moe {

void grouped_linear_forward(const TensorView& x, const GroupedParam& weight,
                            const GroupLayout& groups, const TensorView& y,
                            const BiasEpilogue& bias, [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("grouped_linear_forward", groups);
  // The weight sets N and K: an activation of the wrong width is named as the culprit.
  const Shape w = v.expert_shape("weight", weight, 2, "[N, K]");
  const int64_t N = w[0], K = w[1];
  v.matrix("x", x, v.capacity(), K, "[T, K]");
  v.matrix("y", y, v.capacity(), N, "[T, N]");
  v.param("weight", weight, {N, K}, "[N, K]");
  v.same_dtype("weight", weight.dtype(), "x", x.dtype());
  if (bias.bias.defined()) v.param("bias", bias.bias, {N}, "[N]");
  if (bias.row_scale.defined()) {
    if (!bias.bias.defined())
      v.fail(ErrorCode::kInvalidArgument,
             "row_scale (scale_bias) is given but there is no bias to scale");
    v.row_scale("row_scale", bias.row_scale);
  }
  v.no_overlap("y", y, "x", x);
  v.no_overlap("y", y, "weight", weight);
  if (bias.bias.defined()) v.no_overlap("y", y, "bias", bias.bias);
  if (bias.row_scale.defined()) v.no_overlap("y", y, "row_scale", bias.row_scale);
  ops::dispatch(
      v, [&] { cpu::grouped_linear_forward(x, weight, groups, y, bias); },
      [&] { MOE_CUDA_ONLY(cuda::grouped_linear_forward(x, weight, groups, y, bias, ctx.stream)); });
}

void grouped_linear_dgrad(const TensorView& dy, const GroupedParam& weight,
                          const GroupLayout& groups, const TensorView& dx, [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("grouped_linear_dgrad", groups);
  const Shape w = v.expert_shape("weight", weight, 2, "[N, K]");
  const int64_t N = w[0], K = w[1];
  v.matrix("dy", dy, v.capacity(), N, "[T, N]");
  v.matrix("dx", dx, v.capacity(), K, "[T, K]");
  v.param("weight", weight, {N, K}, "[N, K]");
  v.same_dtype("weight", weight.dtype(), "dy", dy.dtype());
  v.no_overlap("dx", dx, "dy", dy);
  v.no_overlap("dx", dx, "weight", weight);
  ops::dispatch(
      v, [&] { cpu::grouped_linear_dgrad(dy, weight, groups, dx); },
      [&] { MOE_CUDA_ONLY(cuda::grouped_linear_dgrad(dy, weight, groups, dx, ctx.stream)); });
}

void grouped_linear_wgrad(const TensorView& dy, const TensorView& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode, [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("grouped_linear_wgrad", groups);
  v.matrix("dy", dy, v.capacity(), -1, "[T, N]");
  v.matrix("x", x, v.capacity(), -1, "[T, K]");
  v.same_dtype("x", x.dtype(), "dy", dy.dtype());
  const int64_t N = dy.size(1), K = x.size(1);
  v.param("dweight", dweight, {N, K}, "[N, K]");
  v.grad_target("dweight", dweight, mode);
  v.no_overlap("dweight", dweight, "dy", dy);
  v.no_overlap("dweight", dweight, "x", x);
  ops::dispatch(
      v, [&] { cpu::grouped_linear_wgrad(dy, x, groups, dweight, mode); },
      [&] { MOE_CUDA_ONLY(cuda::grouped_linear_wgrad(dy, x, groups, dweight, mode, ctx.stream)); });
}

void grouped_linear_dbias(const TensorView& dy, const GroupLayout& groups,
                          const GroupedParam& dbias, GradMode mode, const TensorView& row_scale,
                          [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("grouped_linear_dbias", groups);
  v.matrix("dy", dy, v.capacity(), -1, "[T, N]");
  v.param("dbias", dbias, {dy.size(1)}, "[N]");
  v.grad_target("dbias", dbias, mode);
  v.no_overlap("dbias", dbias, "dy", dy);
  if (row_scale.defined()) {
    v.row_scale("row_scale", row_scale);
    v.no_overlap("dbias", dbias, "row_scale", row_scale);
  }
  ops::dispatch(
      v, [&] { cpu::grouped_linear_dbias(dy, groups, dbias, mode, row_scale); },
      [&] { MOE_CUDA_ONLY(cuda::grouped_linear_dbias(dy, groups, dbias, mode, row_scale, ctx.stream)); });
}

void grouped_linear_dscales(const TensorView& dy, const GroupedParam& bias,
                            const GroupLayout& groups, const TensorView& dscales, bool accumulate,
                            [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("grouped_linear_dscales", groups);
  const int64_t N = v.expert_shape("bias", bias, 1, "[N]")[0];
  v.matrix("dy", dy, v.capacity(), N, "[T, N]");
  v.param("bias", bias, {N}, "[N]");
  v.row_scale("dscales", dscales);
  v.no_overlap("dscales", dscales, "dy", dy);
  v.no_overlap("dscales", dscales, "bias", bias);
  ops::dispatch(
      v, [&] { cpu::grouped_linear_dscales(dy, bias, groups, dscales, accumulate); },
      [&] { MOE_CUDA_ONLY(cuda::grouped_linear_dscales(dy, bias, groups, dscales, accumulate, ctx.stream)); });
}

}  // namespace moe
