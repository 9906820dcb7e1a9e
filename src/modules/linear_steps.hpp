// One grouped linear layer's GEMMs under a module's FP8 recipe: each GEMM in FP8 where the recipe
// names it, in the module's dtype otherwise. GroupedLinear runs its layer with them; GroupedMLP
// runs its two layers with them when its recipe leaves a GEMM unquantized.
#pragma once

#include "moe_engine/modules.hpp"

namespace moe::detail {

// A module's FP8 options, checked at construction (`module`: the name its errors start with): a
// recipe that names a GEMM, a dtype the FP8 GEMMs write, a valid quantizer, and the layer's two
// widths (named `a_name`, `b_name`) multiples of 16.
void check_fp8_module_options(const Fp8ModuleRecipe& fp8, DType dtype, const char* module, const char* a_name,
                              int64_t a, const char* b_name, int64_t b);

// A layer as the steps read it: its weight, the weight's FP8 cache and the module's recipe.
struct LinearLayer {
  const Parameter& weight;
  Fp8WeightCache& cache;
  const Fp8ModuleRecipe& fp8;
};

// y = x W^T + bias, over x's FP8 rows and the weight's FP8 copy where fp8.forward. x_columns,
// when defined (what an FP8 wgrad will read), are made in the same pass over x as the rows.
void linear_forward(const LinearLayer& layer, const Tensor& x, const GroupLayout& groups, const BiasEpilogue& bias,
                    const Fp8ColumnsBuffers& x_columns, const TensorView& y, const ExecContext& exec);

// dy's FP8 copies backward reads, made in one pass: its rows for an FP8 dgrad (`rows`), its
// columns for an FP8 wgrad (`columns`); undefined where not wanted.
struct GradCopies {
  Fp8RowsBuffers rows;
  Fp8ColumnsBuffers columns;
};
GradCopies quantize_gradient(const Tensor& dy, const GroupLayout& groups, int64_t num_groups, bool rows,
                             bool columns, const Fp8Recipe& recipe, const ExecContext& exec);

// dx = dy W, over dy's FP8 rows and the weight's transposed FP8 copy where dy_rows is defined.
void linear_dgrad(const LinearLayer& layer, const Tensor& dy, const Fp8RowsBuffers& dy_rows,
                  const GroupLayout& groups, const TensorView& dx, const ExecContext& exec);

// A weight gradient's operands: dy's FP8 columns where dy8 has them, else dy; x as forward kept it
// (x, or its FP8 columns).
LinearWgradOperands wgrad_operands(const Tensor& dy, const GradCopies& dy8, const Tensor& x,
                                   const Fp8ColumnsBuffers& x_columns, const GroupLayout& groups);

// dW = dy^T x into `target`, over the FP8 columns where the operands hold them.
void linear_wgrad(const LinearWgradOperands& operands, const ParamGrad& target, const ExecContext& exec);

}  // namespace moe::detail
