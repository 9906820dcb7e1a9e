#include "modules/linear_steps.hpp"

#include <cmath>

namespace moe::detail {

void check_fp8_module_options(const Fp8ModuleRecipe& fp8, DType dtype, const char* module, const char* a_name,
                              int64_t a, const char* b_name, int64_t b) {
  MOE_CHECK(fp8.forward || fp8.dgrad || fp8.wgrad, ErrorCode::kInvalidArgument, module,
            ": options.fp8 names no GEMM (forward, dgrad and wgrad are all false); leave fp8 unset for a module "
            "without FP8");
  MOE_CHECK(dtype == DType::kBFloat16 || dtype == DType::kFloat32, ErrorCode::kDType, module,
            ": options.fp8 needs dtype bfloat16 or float32 (the FP8 GEMMs write those), got ", dtype_name(dtype));
  MOE_CHECK(a % 16 == 0 && b % 16 == 0, ErrorCode::kShape, module, ": options.fp8 needs ", a_name, " and ", b_name,
            " multiples of 16 (FP8 rows are read in 16-byte units), got ", a_name, " = ", a, ", ", b_name, " = ", b);
  MOE_CHECK(fp8.quantizer.amax_epsilon >= 0.f && std::isfinite(fp8.quantizer.amax_epsilon),
            ErrorCode::kInvalidArgument, module, ": options.fp8.quantizer.amax_epsilon: expected a finite value >= 0, got ",
            fp8.quantizer.amax_epsilon);
}

void linear_forward(const LinearLayer& layer, const Tensor& x, const GroupLayout& groups, const BiasEpilogue& bias,
                    const Fp8ColumnsBuffers& x_columns, const TensorView& y, const ExecContext& exec) {
  if (layer.fp8.forward) {
    const Fp8RowsBuffers x_rows = Fp8RowsBuffers::empty(x.size(0), x.size(1), x.device(), exec.stream);
    quantize_fp8(x, groups, x_rows.view(), x_columns.view(), layer.fp8.quantizer, exec);
    grouped_linear_forward(x_rows.view(), layer.cache.get(layer.weight, layer.fp8.quantizer, exec), groups, y, bias,
                           exec);
  } else {
    if (x_columns.defined()) quantize_fp8(x, groups, {}, x_columns.view(), layer.fp8.quantizer, exec);
    grouped_linear_forward(x, layer.weight.value(), groups, y, bias, exec);
  }
}

GradCopies quantize_gradient(const Tensor& dy, const GroupLayout& groups, int64_t num_groups, bool rows,
                             bool columns, const Fp8Recipe& recipe, const ExecContext& exec) {
  GradCopies c;
  const int64_t T = dy.size(0), N = dy.size(1);
  if (rows) c.rows = Fp8RowsBuffers::empty(T, N, dy.device(), exec.stream);
  if (columns) c.columns = Fp8ColumnsBuffers::empty(T, num_groups, N, dy.device(), exec.stream);
  if (rows || columns) quantize_fp8(dy, groups, c.rows.view(), c.columns.view(), recipe, exec);
  return c;
}

void linear_dgrad(const LinearLayer& layer, const Tensor& dy, const Fp8RowsBuffers& dy_rows,
                  const GroupLayout& groups, const TensorView& dx, const ExecContext& exec) {
  if (dy_rows.defined())
    grouped_linear_dgrad(dy_rows.view(), layer.cache.get(layer.weight, layer.fp8.quantizer, exec), groups, dx, exec);
  else
    grouped_linear_dgrad(dy, layer.weight.value(), groups, dx, exec);
}

LinearWgradOperands wgrad_operands(const Tensor& dy, const GradCopies& dy8, const Tensor& x,
                                   const Fp8ColumnsBuffers& x_columns, const GroupLayout& groups) {
  return {dy8.columns.defined() ? Tensor() : dy, x, dy8.columns, x_columns, groups};
}

void linear_wgrad(const LinearWgradOperands& operands, const ParamGrad& target, const ExecContext& exec) {
  if (operands.x_columns.defined())
    grouped_linear_wgrad(operands.dy_columns.view(), operands.x_columns.view(), operands.groups, target.grad,
                         target.mode, exec);
  else
    grouped_linear_wgrad(operands.dy, operands.x, operands.groups, target.grad, target.mode, exec);
}

}  // namespace moe::detail
