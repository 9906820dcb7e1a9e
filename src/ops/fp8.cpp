// FP8 ops (moe_engine/fp8.hpp): the layouts' sizes, validation of every operand, then dispatch by
// device.
#include "moe_engine/fp8.hpp"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include "cpu/backend.hpp"
#include "moe_engine/config.hpp"
#if MOE_ENGINE_WITH_CUDA
#include "cuda/backend.hpp"
#endif
#include "ops/validate.hpp"

namespace moe {

namespace {

using ops::check_outputs;
using ops::check_pair;
using ops::NamedTensor;

int64_t blocks_of(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Rows of [T, K] (K = cols): data [T, K] and scales [ceil(K/128), S], S >= T a multiple of 4.
void check_rows(const ops::Validator& v, const char* data_name, const char* scales_name, const Fp8Rows& rows,
                int64_t cols, const char* data_dims, const char* scales_dims) {
  v.fp8_matrix(data_name, rows.data, v.capacity(), cols, data_dims);
  v.scale_matrix(scales_name, rows.scales, blocks_of(cols), -1, scales_dims);
  const int64_t pitch = rows.scales.size(1);
  if (pitch < v.capacity() || pitch % 4 != 0)
    v.fail(ErrorCode::kShape, scales_name, ": expected a pitch S >= T = ", v.capacity(),
           " and a multiple of 4 (fp8_scales_pitch(T) = ", fp8_scales_pitch(v.capacity()), "), got ",
           rows.scales.describe());
}

// Columns of [T, K] (K = features): data [K, C], scales [C / 128, K], offsets [G + 1] int64.
void check_columns(const ops::Validator& v, const char* data_name, const char* scales_name,
                   const char* offsets_name, const Fp8Columns& columns, int64_t features, const char* data_dims,
                   const char* scales_dims) {
  const int64_t C = fp8_columns_capacity(v.capacity(), v.num_groups());
  v.fp8_matrix(data_name, columns.data, features, C, data_dims);
  v.scale_matrix(scales_name, columns.scales, C / kFp8Block, features, scales_dims);
  v.int64_vector(offsets_name, columns.offsets, v.num_groups() + 1, "[G + 1]");
}

void check_recipe(const ops::Validator& v, const Fp8Recipe& recipe) {
  if (!(recipe.amax_epsilon >= 0.f) || !std::isfinite(recipe.amax_epsilon))
    v.fail(ErrorCode::kInvalidArgument, "recipe.amax_epsilon: expected a finite value >= 0, got ",
           recipe.amax_epsilon);
}

// The N x K weight's blocks: data/scales (forward) or data_t/scales_t (dgrad). Returns {N, K}.
struct WeightExtent {
  int64_t n, k;
};

WeightExtent weight_extent(const ops::Validator& v, const char* name, const TensorView& t, const char* dims) {
  if (!t.defined()) v.fail(ErrorCode::kInvalidArgument, name, ": required tensor ", dims, " is undefined");
  if (t.dim() != 3) v.fail(ErrorCode::kShape, name, ": expected a 3-D ", dims, " tensor, got ", t.describe());
  if (t.size(0) != v.num_groups())
    v.fail(ErrorCode::kGroupMismatch, name, " has G = ", t.size(0), " experts but the group layout has G = ",
           v.num_groups());
  return {t.size(1), t.size(2)};
}

// A weight's blocks (`prefix`.data and .scales, or .data_t and .scales_t when transposed) for
// G x [n, k] values.
void check_weight_blocks(const ops::Validator& v, const char* prefix, const Fp8Weight& w, bool transposed,
                         int64_t n, int64_t k) {
  const int64_t G = v.num_groups();
  const std::string data = std::string(prefix) + (transposed ? ".data_t" : ".data");
  const std::string scales = std::string(prefix) + (transposed ? ".scales_t" : ".scales");
  if (!transposed) {
    v.contiguous(data.c_str(), w.data, {G, n, k}, DType::kFloat8E4M3, "[G, N, K]");
    v.contiguous(scales.c_str(), w.scales, {G, blocks_of(n), blocks_of(k)}, DType::kFloat32,
                 "[G, ceil(N/128), ceil(K/128)]");
  } else {
    v.contiguous(data.c_str(), w.data_t, {G, k, n}, DType::kFloat8E4M3, "[G, K, N]");
    v.contiguous(scales.c_str(), w.scales_t, {G, blocks_of(k), blocks_of(n)}, DType::kFloat32,
                 "[G, ceil(K/128), ceil(N/128)]");
  }
}

// A GEMM output: [T, cols], bfloat16 or float32.
void check_output(const ops::Validator& v, const char* name, const TensorView& t, int64_t cols, const char* dims) {
  v.matrix(name, t, v.capacity(), cols, dims);
  if (t.dtype() != DType::kBFloat16 && t.dtype() != DType::kFloat32)
    v.fail(ErrorCode::kDType, name, ": expected bfloat16 or float32, got ", dtype_name(t.dtype()));
}

// A dequantized output: [T, cols], bfloat16, float16 or float32. The dtype is checked first, so
// that an FP8 tensor given as the output is named as the wrong dtype.
void check_dequantized(const ops::Validator& v, const char* name, const TensorView& t, int64_t cols,
                       const char* dims) {
  if (t.defined()) v.quantizable_dtype(name, t.dtype());
  v.matrix(name, t, v.capacity(), cols, dims);
}

// Forward (y = x W^T, over weight.data) and dgrad (dx = dy W, over weight.data_t) multiply FP8 rows
// by one of the weight's copies. The weight sets the widths, so an activation of the wrong width is
// named as the culprit. Returns the output's width.
struct RowsTimesWeight {
  const char* rows_data;  // the argument names, as the messages give them
  const char* rows_scales;
  const char* rows_dims;
  const char* rows_scale_dims;
  const char* out;
  const char* out_dims;
  bool transposed;  // dgrad: weight.data_t
};

int64_t check_rows_times_weight(const ops::Validator& v, const RowsTimesWeight& g, const Fp8Rows& rows,
                                const Fp8Weight& weight, const TensorView& out) {
  const TensorView& data = g.transposed ? weight.data_t : weight.data;
  const TensorView& scales = g.transposed ? weight.scales_t : weight.scales;
  const char* data_name = g.transposed ? "weight.data_t" : "weight.data";
  const char* scales_name = g.transposed ? "weight.scales_t" : "weight.scales";
  const auto [out_cols, in_cols] = weight_extent(v, data_name, data, g.transposed ? "[G, K, N]" : "[G, N, K]");
  const int64_t N = g.transposed ? in_cols : out_cols, K = g.transposed ? out_cols : in_cols;
  v.multiple_of_16("N", N, "the weight's rows");
  v.multiple_of_16("K", K, "the weight's columns");
  check_weight_blocks(v, "weight", weight, g.transposed, N, K);
  check_rows(v, g.rows_data, g.rows_scales, rows, in_cols, g.rows_dims, g.rows_scale_dims);
  check_output(v, g.out, out, out_cols, g.out_dims);
  for (const NamedTensor& in : {NamedTensor{g.rows_data, rows.data}, NamedTensor{g.rows_scales, rows.scales},
                                NamedTensor{data_name, data}, NamedTensor{scales_name, scales}})
    v.no_overlap(g.out, out, in.name, in.t);
  return out_cols;
}

}  // namespace

int64_t fp8_columns_capacity(int64_t capacity, int64_t num_groups) {
  MOE_CHECK(capacity >= 0, ErrorCode::kInvalidArgument, "fp8_columns_capacity: capacity: expected T >= 0, got ",
            capacity);
  MOE_CHECK(num_groups >= 0, ErrorCode::kInvalidArgument,
            "fp8_columns_capacity: num_groups: expected G >= 0, got ", num_groups);
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max() / 2;
  MOE_CHECK(capacity <= kMax && num_groups <= kMax / (kFp8Block - 1), ErrorCode::kInvalidArgument,
            "fp8_columns_capacity: T = ", capacity, " and G = ", num_groups, " overflow int64");
  return round_up(capacity + (kFp8Block - 1) * num_groups, kFp8Block);
}

int64_t fp8_scales_pitch(int64_t capacity) {
  MOE_CHECK(capacity >= 0, ErrorCode::kInvalidArgument, "fp8_scales_pitch: capacity: expected T >= 0, got ",
            capacity);
  return capacity < 4 ? 4 : round_up(capacity, 4);
}

void quantize_fp8(const TensorView& x, const GroupLayout& groups, const Fp8Rows& rows, const Fp8Columns& columns,
                  const Fp8Recipe& recipe, [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("quantize_fp8", groups);
  v.matrix("x", x, v.capacity(), -1, "[T, K]");
  v.quantizable_dtype("x", x.dtype());
  const int64_t K = x.size(1);
  v.multiple_of_16("K", K, "x's features");
  check_recipe(v, recipe);
  if (!rows.data.defined() && !rows.scales.defined() && !columns.data.defined() && !columns.scales.defined() &&
      !columns.offsets.defined())
    v.fail(ErrorCode::kInvalidArgument,
           "neither rows nor columns are requested (rows.data and columns.data are undefined): the call would do "
           "nothing");
  check_pair(v, "rows.data", rows.data, "rows.scales", rows.scales);
  check_pair(v, "columns.data", columns.data, "columns.scales", columns.scales);
  check_pair(v, "columns.data", columns.data, "columns.offsets", columns.offsets);
  if (rows.data.defined()) check_rows(v, "rows.data", "rows.scales", rows, K, "[T, K]", "[ceil(K/128), S]");
  if (columns.data.defined())
    check_columns(v, "columns.data", "columns.scales", "columns.offsets", columns, K, "[K, C]", "[C/128, K]");
  const NamedTensor outputs[] = {{"rows.data", rows.data},
                                 {"rows.scales", rows.scales},
                                 {"columns.data", columns.data},
                                 {"columns.scales", columns.scales},
                                 {"columns.offsets", columns.offsets}};
  check_outputs(v, outputs, {{"x", x}, {"the routing's offsets", groups.offsets()}});
  ops::dispatch(
      v, [&] { cpu::quantize_fp8(x, groups, rows, columns, recipe); },
      [&] { MOE_CUDA_ONLY(cuda::quantize_fp8(x, groups, rows, columns, recipe, ctx.stream)); });
}

void dequantize_fp8(const Fp8Rows& rows, const GroupLayout& groups, const TensorView& out,
                    [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("dequantize_fp8", groups);
  v.fp8_matrix("rows.data", rows.data, v.capacity(), -1, "[T, K]");  // sets K
  const int64_t K = rows.data.size(1);
  check_rows(v, "rows.data", "rows.scales", rows, K, "[T, K]", "[ceil(K/128), S]");
  check_dequantized(v, "out", out, K, "[T, K]");
  for (const NamedTensor& in : {NamedTensor{"rows.data", rows.data}, NamedTensor{"rows.scales", rows.scales},
                                NamedTensor{"the routing's offsets", groups.offsets()}})
    v.no_overlap("out", out, in.name, in.t);
  ops::dispatch(
      v, [&] { cpu::dequantize_fp8(rows, groups, out); },
      [&] { MOE_CUDA_ONLY(cuda::dequantize_fp8(rows, groups, out, ctx.stream)); });
}

void quantize_fp8_weight(const GroupedParam& weight, const Fp8Weight& out, const Fp8Recipe& recipe,
                         [[maybe_unused]] const ExecContext& ctx) {
  if (!weight.defined())
    throw_error(ErrorCode::kInvalidArgument,
                "quantize_fp8_weight: weight: required per-expert tensor [N, K] is undefined");
  const ops::Validator v("quantize_fp8_weight", weight.device(), weight.num_groups());
  const Shape w = v.expert_shape("weight", weight, 2, "[N, K]");
  const int64_t N = w[0], K = w[1];
  v.param("weight", weight, {N, K}, "[N, K]");
  v.quantizable_dtype("weight", weight.dtype());
  v.multiple_of_16("N", N, "the weight's rows");
  v.multiple_of_16("K", K, "the weight's columns");
  check_recipe(v, recipe);
  if (!out.data.defined() && !out.scales.defined() && !out.data_t.defined() && !out.scales_t.defined())
    v.fail(ErrorCode::kInvalidArgument,
           "neither out.data nor out.data_t is requested (both undefined): the call would do nothing");
  check_pair(v, "out.data", out.data, "out.scales", out.scales);
  check_pair(v, "out.data_t", out.data_t, "out.scales_t", out.scales_t);
  if (out.data.defined()) check_weight_blocks(v, "out", out, false, N, K);
  if (out.data_t.defined()) check_weight_blocks(v, "out", out, true, N, K);
  const NamedTensor outputs[] = {{"out.data", out.data},
                                 {"out.scales", out.scales},
                                 {"out.data_t", out.data_t},
                                 {"out.scales_t", out.scales_t}};
  check_outputs(v, outputs, {});
  for (const NamedTensor& o : outputs)
    if (o.t.defined()) v.no_overlap(o.name, o.t, "weight", weight);
  ops::dispatch(
      v, [&] { cpu::quantize_fp8_weight(weight, out, recipe); },
      [&] { MOE_CUDA_ONLY(cuda::quantize_fp8_weight(weight, out, recipe, ctx.stream)); });
}

void grouped_linear_forward(const Fp8Rows& x, const Fp8Weight& weight, const GroupLayout& groups,
                            const TensorView& y, const BiasEpilogue& bias, [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("grouped_linear_forward", groups);
  const int64_t N = check_rows_times_weight(
      v, {"x.data", "x.scales", "[T, K]", "[ceil(K/128), S]", "y", "[T, N]", false}, x, weight, y);
  if (bias.bias.defined()) v.param("bias", bias.bias, {N}, "[N]");
  if (bias.row_scale.defined()) {
    if (!bias.bias.defined())
      v.fail(ErrorCode::kInvalidArgument, "row_scale (scale_bias) is given but there is no bias to scale");
    v.row_scale("row_scale", bias.row_scale);
  }
  if (bias.bias.defined()) v.no_overlap("y", y, "bias", bias.bias);
  if (bias.row_scale.defined()) v.no_overlap("y", y, "row_scale", bias.row_scale);
  ops::dispatch(
      v, [&] { cpu::grouped_linear_forward(x, weight, groups, y, bias); },
      [&] { MOE_CUDA_ONLY(cuda::grouped_linear_forward(x, weight, groups, y, bias, ctx.stream)); });
}

void grouped_linear_dgrad(const Fp8Rows& dy, const Fp8Weight& weight, const GroupLayout& groups,
                          const TensorView& dx, [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("grouped_linear_dgrad", groups);
  check_rows_times_weight(v, {"dy.data", "dy.scales", "[T, N]", "[ceil(N/128), S]", "dx", "[T, K]", true}, dy, weight,
                          dx);
  ops::dispatch(
      v, [&] { cpu::grouped_linear_dgrad(dy, weight, groups, dx); },
      [&] { MOE_CUDA_ONLY(cuda::grouped_linear_dgrad(dy, weight, groups, dx, ctx.stream)); });
}

void grouped_linear_wgrad(const Fp8Columns& dy, const Fp8Columns& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode, [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("grouped_linear_wgrad", groups);
  // dweight sets N and K.
  const Shape w = v.expert_shape("dweight", dweight, 2, "[N, K]");
  const int64_t N = w[0], K = w[1];
  v.multiple_of_16("N", N, "dweight's rows");
  v.multiple_of_16("K", K, "dweight's columns");
  v.param("dweight", dweight, {N, K}, "[N, K]");
  v.grad_target("dweight", dweight, mode);
  check_columns(v, "dy.data", "dy.scales", "dy.offsets", dy, N, "[N, C]", "[C/128, N]");
  check_columns(v, "x.data", "x.scales", "x.offsets", x, K, "[K, C]", "[C/128, K]");
  for (const auto& [name, in] : {std::pair<const char*, TensorView>{"dy.data", dy.data},
                                 {"dy.scales", dy.scales},
                                 {"dy.offsets", dy.offsets},
                                 {"x.data", x.data},
                                 {"x.scales", x.scales},
                                 {"x.offsets", x.offsets}})
    v.no_overlap("dweight", dweight, name, in);
  ops::dispatch(
      v, [&] { cpu::grouped_linear_wgrad(dy, x, groups, dweight, mode); },
      [&] { MOE_CUDA_ONLY(cuda::grouped_linear_wgrad(dy, x, groups, dweight, mode, ctx.stream)); });
}

}  // namespace moe
