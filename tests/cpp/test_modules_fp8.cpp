// GroupedLinear and GroupedMLP with options.fp8 (CPU backend): bit-identical to the FP8 ops called
// directly (each GroupedLinear GEMM in FP8 or not, as the recipe says), within FP8's error of the
// float64 oracle, packed = per-expert, the six-row gradient contract (tests/data/grad_contract.json),
// delayed = immediate, main_grad accumulate / overwrite, what forward keeps and its bytes (the MLP:
// x's rows or its columns by the op's rule, expert_mlp_fp8_keeps_x_rows), the FP8
// weight cache (reused across micro-batches, refreshed by invalidate_fp8_weights, load_state_dict and
// a replaced Parameter), activation offload of the FP8 tensors, bad options, odd routings.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "fp8_mlp_support.hpp"
#include "fp8_module_support.hpp"
#include "grad_contract_rows.hpp"
#include "moe_engine/modules.hpp"
#include "moe_engine/offload.hpp"

namespace moe::test {
namespace {

// ---- GroupedLinear ----

constexpr int64_t kG = 5, kIn = 48, kOut = 144, kT = 40;  // 144: a partial second 128-block
const std::vector<int64_t> kSplits{7, 0, 1, 13, 9};       // empty and 1-row experts, 10 rows past the end

GroupedLinearOptions linear_options(DType dt = DType::kBFloat16, ExpertLayout layout = ExpertLayout::kPacked,
                                    Fp8ModuleRecipe fp8 = {}) {
  GroupedLinearOptions o;
  o.dtype = dt;
  o.layout = layout;
  o.bias = o.scale_bias = true;
  o.seed = 42;
  o.fp8 = fp8;
  return o;
}

// What the ops give for the module's parameters on this batch, each GEMM in FP8 where the module's
// recipe says so; the weight gradient written as `wdtype`.
struct LinearReference {
  Tensor y, dx, dw, db, dscales;
  OwnedColumns x_columns;
};

LinearReference linear_reference(GroupedLinear& m, const Batch& b, DType wdtype) {
  const Fp8ModuleRecipe& fp8 = *m.options().fp8;
  const int64_t G = m.num_groups(), N = m.out_features(), K = m.in_features(), T = b.T();
  const DType dt = m.options().dtype;
  const GroupLayout& groups = b.groups();
  const OwnedWeight w = quantized_weight(m.weight().value(), fp8.quantizer);
  OwnedRows x_rows(T, K), dy_rows(T, N);
  OwnedColumns dy_columns(T, G, N);
  LinearReference r;
  r.x_columns = OwnedColumns(T, G, K);
  quantize_fp8(b.x, groups, x_rows.view(), r.x_columns.view(), fp8.quantizer);
  quantize_fp8(b.dy, groups, dy_rows.view(), dy_columns.view(), fp8.quantizer);
  BiasEpilogue bias;
  if (m.has_bias()) bias = {m.bias().value(), m.options().scale_bias ? TensorView(b.scales) : TensorView()};
  r.y = Tensor::zeros({T, N}, dt);
  if (fp8.forward)
    grouped_linear_forward(x_rows.view(), w.view(), groups, r.y, bias);
  else
    grouped_linear_forward(b.x, m.weight().value(), groups, r.y, bias);
  r.dx = Tensor::zeros({T, K}, dt);
  if (fp8.dgrad)
    grouped_linear_dgrad(dy_rows.view(), w.view(), groups, r.dx);
  else
    grouped_linear_dgrad(b.dy, m.weight().value(), groups, r.dx);
  r.dw = Tensor::zeros({G, N, K}, wdtype);
  if (fp8.wgrad)
    grouped_linear_wgrad(dy_columns.view(), r.x_columns.view(), groups, GroupedParam::packed(r.dw), GradMode::kWrite);
  else
    grouped_linear_wgrad(b.dy, b.x, groups, GroupedParam::packed(r.dw), GradMode::kWrite);
  if (m.has_bias()) {
    r.db = Tensor::zeros({G, N}, dt);
    const TensorView scales = m.options().scale_bias ? TensorView(b.scales) : TensorView();
    grouped_linear_dbias(b.dy, groups, GroupedParam::packed(r.db), GradMode::kWrite, scales);
    if (m.options().scale_bias) {
      r.dscales = Tensor::zeros({T}, DType::kFloat32);
      grouped_linear_dscales(b.dy, m.bias().value(), groups, r.dscales);
    }
  }
  return r;
}

class Fp8GroupedLinear : public ::testing::TestWithParam<DType> {};

TEST_P(Fp8GroupedLinear, EqualsTheFp8OpsAndLayoutsAreBitIdentical) {
  const DType dt = GetParam();
  Rng rng;
  const Batch b(rng, kSplits, kT, kIn, kOut, dt);
  GroupedLinear packed(kG, kIn, kOut, linear_options(dt));
  GroupedLinear per(kG, kIn, kOut, linear_options(dt, ExpertLayout::kPerExpert));
  ASSERT_TRUE(bitwise_equal(packed.weight().value(), per.weight().value()));
  const LinearReference ref = linear_reference(packed, b, dt);
  for (GroupedLinear* m : {&packed, &per}) {
    SCOPED_TRACE(layout_name(m->options().layout));
    LinearForwardResult f = m->forward(b.x, b.groups(), b.scales);
    EXPECT_TRUE(bitwise_equal(f.y, ref.y));
    // Forward keeps x's FP8 columns (and the row scales), no copy of x in its dtype.
    EXPECT_TRUE(f.ctx.saves_input());
    EXPECT_TRUE(same_columns(f.ctx.saved_x_columns(), ref.x_columns.view()));
    EXPECT_EQ(f.ctx.saved_bytes(), columns_bytes(kT, kG, kIn) + 4 * kT);
    LinearBackwardResult r = m->backward(f.ctx, b.dy);
    EXPECT_TRUE(bitwise_equal(r.dx, ref.dx));
    EXPECT_EQ(r.weight.kind, GradKind::kGrad);
    EXPECT_EQ(r.weight.grad.layout(), m->options().layout);
    EXPECT_TRUE(bitwise_equal(packed_of(r.weight.grad.view()), ref.dw));
    EXPECT_TRUE(bitwise_equal(packed_of(r.bias.grad.view()), ref.db)) << "the bias gradient reads dy unquantized";
    EXPECT_TRUE(bitwise_equal(r.dscales, ref.dscales));
    EXPECT_EQ(m->fp8_weight_quantizations(), 1u) << "forward and dgrad share one quantization of the weight";
  }
}

// Against the float64 GEMMs of the unquantized inputs: each output within FP8's error.
TEST_P(Fp8GroupedLinear, MatchesTheFloat64OracleWithinFp8Error) {
  const DType dt = GetParam();
  Rng rng;
  const Batch b(rng, kSplits, kT, kIn, kOut, dt);
  GroupedLinear m(kG, kIn, kOut, linear_options(dt));
  LinearForwardResult f = m.forward(b.x, b.groups(), b.scales);
  LinearBackwardResult r = m.backward(f.ctx, b.dy);
  const int64_t rows = b.routing.rows();
  const auto w = oracle::to_matrices(m.weight().value());
  const oracle::Matrix x = rows_of(b.x, rows), dy = rows_of(b.dy, rows);
  const oracle::Vector scales = head_of(b.scales, rows);
  const oracle::Matrix bias = oracle::to_matrix(packed_of(m.bias().value()));
  const oracle::Matrix y = oracle::linear_forward(x, w, b.routing.splits, bias, scales);
  EXPECT_LE(oracle::similarity_diff(rows_of(f.y, rows), y), kFp8MlpSimilarityBound);
  EXPECT_LE(oracle::similarity_diff(rows_of(r.dx, rows), oracle::linear_dgrad(dy, w, b.routing.splits)),
            kFp8MlpSimilarityBound);
  EXPECT_LE(
      oracle::similarity_diff(oracle::to_matrices(r.weight.grad.view()), oracle::linear_wgrad(dy, x, b.routing.splits)),
      kFp8MlpSimilarityBound);
  // The check can fail: another module's weights are far off.
  GroupedLinearOptions other = linear_options(dt);
  other.seed = 43;
  const auto w_other = oracle::to_matrices(GroupedLinear(kG, kIn, kOut, other).weight().value());
  EXPECT_GT(
      oracle::similarity_diff(rows_of(f.y, rows), oracle::linear_forward(x, w_other, b.routing.splits, bias, scales)),
      0.1);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Fp8GroupedLinear, ::testing::Values(DType::kBFloat16, DType::kFloat32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// TransformerEngine's override_linear_precision: each GEMM runs in FP8 or in the module's dtype as
// the recipe names it, and forward keeps x or its FP8 columns accordingly.
TEST(Fp8GroupedLinearRecipe, EachGemmRunsInFp8OnlyWhenNamed) {
  Rng rng;
  const Batch b(rng, kSplits, kT, kIn, kOut, DType::kBFloat16);
  for (int mask = 1; mask < 8; ++mask) {
    const bool forward = mask & 1, dgrad = mask & 2, wgrad = mask & 4;
    SCOPED_TRACE("forward " + std::to_string(forward) + ", dgrad " + std::to_string(dgrad) + ", wgrad " +
                 std::to_string(wgrad));
    for (ExpertLayout layout : {ExpertLayout::kPacked, ExpertLayout::kPerExpert}) {
      GroupedLinear m(kG, kIn, kOut, linear_options(DType::kBFloat16, layout, gemms(forward, dgrad, wgrad)));
      const LinearReference ref = linear_reference(m, b, DType::kBFloat16);
      LinearForwardResult f = m.forward(b.x, b.groups(), b.scales);
      EXPECT_EQ(f.ctx.saved_x_columns().data.defined(), wgrad);
      EXPECT_EQ(f.ctx.saved_bytes(), (wgrad ? columns_bytes(kT, kG, kIn) : kT * kIn * 2) + 4 * kT);
      LinearBackwardResult r = m.backward(f.ctx, b.dy);
      EXPECT_TRUE(bitwise_equal(f.y, ref.y));
      EXPECT_TRUE(bitwise_equal(r.dx, ref.dx));
      EXPECT_TRUE(bitwise_equal(packed_of(r.weight.grad.view()), ref.dw));
      EXPECT_EQ(m.fp8_weight_quantizations(), forward || dgrad ? 1u : 0u)
          << "a wgrad-only recipe never quantizes the weight";
    }
  }
  // The check can fail: the bf16 and FP8 forwards differ.
  GroupedLinear fp8_forward(kG, kIn, kOut,
                            linear_options(DType::kBFloat16, ExpertLayout::kPacked, gemms(true, false, false)));
  GroupedLinear bf16_forward(kG, kIn, kOut,
                             linear_options(DType::kBFloat16, ExpertLayout::kPacked, gemms(false, true, false)));
  EXPECT_FALSE(bitwise_equal(fp8_forward.forward(b.x, b.groups(), b.scales).y,
                             bf16_forward.forward(b.x, b.groups(), b.scales).y));
}

// The rows of docs/design.md section 6, with the FP8 wgrad writing / accumulating into float32.
class Fp8LinearGradientContract : public ::testing::TestWithParam<std::tuple<Row, ExpertLayout>> {};

TEST_P(Fp8LinearGradientContract, Row) {
  const auto& [row, layout] = GetParam();
  Rng rng;
  const Batch b(rng, kSplits, kT, kIn, kOut, DType::kBFloat16);
  GroupedLinearOptions o = linear_options(DType::kBFloat16, layout);
  apply_row(o, row);
  GroupedLinear m(kG, kIn, kOut, o);
  Tensor main_grad;
  if (row.main_grad) main_grad = main_grad_for(m.weight());
  if (row.flag) m.weight().grad_added_to_main_grad = false;
  int hook_calls = 0;
  m.register_wgrad_hook([&] { ++hook_calls; });

  std::optional<LinearForwardResult> f = m.forward(b.x, b.groups(), b.scales);
  LinearBackwardResult r = m.backward(f->ctx, b.dy);
  f.reset();  // a queued job keeps its own FP8 tensors
  expect_contract_steps(m, {{&r.weight, &m.weight()}}, row, hook_calls);

  const Tensor exact32 = linear_reference(m, b, DType::kFloat32).dw;
  if (row.main_grad) {
    EXPECT_TRUE(bitwise_equal(main_grad, exact32)) << "main_grad";
    EXPECT_FALSE(m.weight().grad().defined());
  } else if (row.delay) {
    EXPECT_TRUE(bitwise_equal(packed_of(m.weight().grad().view()), exact32)) << ".grad after backward_dw";
  } else {
    EXPECT_TRUE(bitwise_equal(packed_of(r.weight.grad.view()), linear_reference(m, b, DType::kBFloat16).dw));
  }
  if (row.backward_kind == GradKind::kDummy)
    EXPECT_TRUE(bitwise_equal(packed_of(r.weight.grad.view()), Tensor::zeros({kG, kOut, kIn}, DType::kBFloat16)));
}

INSTANTIATE_TEST_SUITE_P(TableRows, Fp8LinearGradientContract, all_rows_and_layouts(), row_and_layout_name);

TEST(Fp8GroupedLinearModule, DelayedEqualsImmediateTwiceIsDoubleOverwriteReplaces) {
  Rng rng;
  const Batch b(rng, kSplits, kT, kIn, kOut, DType::kBFloat16);
  GroupedLinearOptions o = linear_options(DType::kBFloat16, ExpertLayout::kPerExpert);
  o.accumulate_into_main_grad = true;
  GroupedLinear now(kG, kIn, kOut, o);
  o.delay_wgrad_compute = true;
  GroupedLinear later(kG, kIn, kOut, o);
  const Tensor mg_now = main_grad_for(now.weight()), mg_later = main_grad_for(later.weight());
  int hooks = 0;
  later.register_wgrad_hook([&] { ++hooks; });
  later.backward_dw();
  EXPECT_EQ(hooks, 0);
  for (int step = 0; step < 2; ++step) {
    LinearForwardResult f = now.forward(b.x, b.groups(), b.scales);
    now.backward(f.ctx, b.dy);
    LinearForwardResult g = later.forward(b.x, b.groups(), b.scales);
    later.backward(g.ctx, b.dy);
  }
  EXPECT_EQ(later.queued_wgrads(), 2u);
  EXPECT_TRUE(bitwise_equal(mg_later, Tensor::zeros({kG, kOut, kIn}, DType::kFloat32)));
  later.backward_dw();
  EXPECT_EQ(hooks, 1);
  EXPECT_TRUE(bitwise_equal(mg_later, mg_now)) << "delayed != immediate";
  const Tensor once = linear_reference(now, b, DType::kFloat32).dw;
  EXPECT_TRUE(bitwise_equal(mg_now, doubled(once))) << "accumulating twice is not 2x";

  o.delay_wgrad_compute = false;
  o.overwrite_main_grad = true;
  GroupedLinear over(kG, kIn, kOut, o);
  const Tensor mg_over = main_grad_for(over.weight());
  fill_uniform(mg_over, 7, -1, 1);
  for (int step = 0; step < 2; ++step) {
    LinearForwardResult f = over.forward(b.x, b.groups(), b.scales);
    over.backward(f.ctx, b.dy);
  }
  EXPECT_TRUE(bitwise_equal(mg_over, once)) << "overwrite";
}

TEST(Fp8GroupedLinearModule, KeepsOnlyWhatBackwardNeeds) {
  Rng rng;
  const Batch b(rng, kSplits, kT, kIn, kOut, DType::kBFloat16);
  GroupedLinearOptions o = linear_options();
  o.bias = o.scale_bias = false;
  GroupedLinear m(kG, kIn, kOut, o);
  LinearForwardResult f = m.forward(b.x, b.groups(), {}, /*input_requires_grad=*/false);
  EXPECT_EQ(f.ctx.saved_bytes(), columns_bytes(kT, kG, kIn));
  LinearBackwardResult r = m.backward(f.ctx, b.dy);
  EXPECT_FALSE(r.dx.defined());
  EXPECT_EQ(r.weight.kind, GradKind::kGrad);
  m.weight().requires_grad = false;  // frozen: nothing kept; dgrad only
  f = m.forward(b.x, b.groups());
  EXPECT_FALSE(f.ctx.saves_input());
  EXPECT_EQ(f.ctx.saved_bytes(), 0);
  r = m.backward(f.ctx, b.dy);
  EXPECT_TRUE(r.dx.defined());
  EXPECT_EQ(r.weight.kind, GradKind::kNone);
  // A weight unfrozen between forward and backward finds no input: a clear error.
  f = m.forward(b.x, b.groups());
  m.weight().requires_grad = true;
  EXPECT_MOE_ERROR(m.backward(f.ctx, b.dy), ErrorCode::kInvalidArgument, "forward kept no input");
}

// The weight's FP8 copies are made once and serve every micro-batch (forward and dgrad) until
// invalidated; a change of the master weight is not seen before.
TEST(Fp8GroupedLinearModule, WeightCacheIsReusedUntilInvalidated) {
  Rng rng;
  const Batch b(rng, kSplits, kT, kIn, kOut, DType::kBFloat16);
  GroupedLinear m(kG, kIn, kOut, linear_options(DType::kBFloat16, ExpertLayout::kPerExpert));
  EXPECT_EQ(m.fp8_weight_quantizations(), 0u);
  const LinearReference before = linear_reference(m, b, DType::kBFloat16);
  LinearForwardResult f1 = m.forward(b.x, b.groups(), b.scales);
  LinearForwardResult f2 = m.forward(b.x, b.groups(), b.scales);  // a second micro-batch
  EXPECT_EQ(m.fp8_weight_quantizations(), 1u);
  EXPECT_TRUE(bitwise_equal(f2.y, before.y));

  // The optimizer writes the master weight in place (here through state_dict's shared tensors).
  for (const auto& [key, t] : m.state_dict())
    if (key.starts_with("weight")) fill_uniform(t, 1234 + key.size(), -0.2f, 0.2f);
  LinearForwardResult stale = m.forward(b.x, b.groups(), b.scales);
  EXPECT_TRUE(bitwise_equal(stale.y, before.y)) << "the cached copy serves until invalidated";
  EXPECT_TRUE(bitwise_equal(m.backward(f1.ctx, b.dy).dx, before.dx)) << "dgrad reads the same cached copy";
  EXPECT_EQ(m.fp8_weight_quantizations(), 1u);

  m.invalidate_fp8_weights();
  const LinearReference after = linear_reference(m, b, DType::kBFloat16);
  ASSERT_FALSE(bitwise_equal(after.y, before.y));
  LinearForwardResult fresh = m.forward(b.x, b.groups(), b.scales);
  EXPECT_TRUE(bitwise_equal(fresh.y, after.y));
  EXPECT_TRUE(bitwise_equal(m.backward(f2.ctx, b.dy).dx, after.dx));
  EXPECT_EQ(m.fp8_weight_quantizations(), 2u);

  // load_state_dict refreshes the copies itself.
  GroupedLinearOptions other_options = linear_options();
  other_options.seed = 77;
  GroupedLinear other(kG, kIn, kOut, other_options);
  m.load_state_dict(other.state_dict());
  EXPECT_TRUE(bitwise_equal(m.forward(b.x, b.groups(), b.scales).y, linear_reference(other, b, DType::kBFloat16).y));
  EXPECT_EQ(m.fp8_weight_quantizations(), 3u);

  // So does replacing the Parameter (another storage).
  other_options.seed = 78;
  other_options.layout = ExpertLayout::kPerExpert;
  m.weight() = GroupedLinear(kG, kIn, kOut, other_options).weight();
  EXPECT_TRUE(bitwise_equal(m.forward(b.x, b.groups(), b.scales).y, linear_reference(m, b, DType::kBFloat16).y));
  EXPECT_EQ(m.fp8_weight_quantizations(), 4u);
  m.forward(b.x, b.groups(), b.scales);
  EXPECT_EQ(m.fp8_weight_quantizations(), 4u);
}

TEST(Fp8GroupedLinearModule, BadOptionsAreClearErrors) {
  EXPECT_MOE_ERROR(
      (GroupedLinear(kG, kIn, kOut, linear_options(DType::kFloat16))), ErrorCode::kDType,
      "GroupedLinear: options.fp8 needs dtype bfloat16 or float32 (the FP8 GEMMs write those), got float16");
  EXPECT_MOE_ERROR((GroupedLinear(kG, 24, kOut, linear_options())), ErrorCode::kShape,
                   "multiples of 16 (FP8 rows are read in 16-byte units), got in_features = 24, out_features = 144");
  EXPECT_MOE_ERROR((GroupedLinear(kG, kIn, 40 + 1, linear_options())), ErrorCode::kShape, "out_features = 41");
  EXPECT_MOE_ERROR((GroupedLinear(kG, kIn, kOut,
                                  linear_options(DType::kBFloat16, ExpertLayout::kPacked, gemms(false, false, false)))),
                   ErrorCode::kInvalidArgument, "options.fp8 names no GEMM");
  Fp8ModuleRecipe bad_epsilon;
  bad_epsilon.quantizer.amax_epsilon = -1.f;
  EXPECT_MOE_ERROR((GroupedLinear(kG, kIn, kOut, linear_options(DType::kBFloat16, ExpertLayout::kPacked, bad_epsilon))),
                   ErrorCode::kInvalidArgument, "amax_epsilon: expected a finite value >= 0, got -1");
  // Without fp8 the same shapes and dtype are fine.
  GroupedLinearOptions plain = linear_options(DType::kFloat16);
  plain.fp8.reset();
  EXPECT_NO_THROW(GroupedLinear(kG, 24, kOut, plain));
}

// ---- GroupedMLP ----

constexpr int64_t kH = 144, kF = 80, kMlpT = 50;

GroupedMLPOptions mlp_options(DType dt = DType::kBFloat16, ExpertLayout layout = ExpertLayout::kPacked) {
  GroupedMLPOptions o;
  o.dtype = dt;
  o.layout = layout;
  o.bias = true;
  o.glu.activation = Activation::kClampedQGeGLU;
  o.glu.limit = 1.5f;  // the initialized pre-activation reaches past it
  o.glu.layout = GluLayout::pairs();
  o.seed = 7;
  o.fp8 = Fp8ModuleRecipe{};
  return o;
}

// The FP8 MLP op on the module's parameters (weights quantized here), every gradient written,
// the weight gradients as `wdtype`. x kept as the op's rule says (expert_mlp_fp8_keeps_x_rows), or
// in the form `x_rows` names.
MlpReference mlp_reference(GroupedMLP& m, const Batch& b, DType wdtype, bool probs = true,
                           std::optional<bool> x_rows = std::nullopt) {
  const int64_t G = m.num_groups(), H = m.hidden(), F = m.ffn(), T = b.T(), W = fc1_width(m.options().glu, F);
  const DType dt = m.options().dtype;
  const Fp8Recipe& recipe = m.options().fp8->quantizer;
  const OwnedWeight w1 = quantized_weight(m.fc1_weight().value(), recipe);
  const OwnedWeight w2 = quantized_weight(m.fc2_weight().value(), recipe);
  ExpertMlpFp8Weights w{w1.view(), w2.view(), {}, {}};
  if (m.has_bias()) w.fc1_bias = m.fc1_bias().value(), w.fc2_bias = m.fc2_bias().value();
  MlpReference r;
  const bool rows = x_rows.value_or(expert_mlp_fp8_keeps_x_rows(T, G));
  if (rows) r.x_rows = OwnedRows(T, H);
  else r.x_columns = OwnedColumns(T, G, H);
  r.h_rows = OwnedRows(T, W);
  const ExpertMlpFp8Saved saved{r.x_columns.view(), r.h_rows.view(), r.x_rows.view()};
  const ExpertMlpSpec spec{m.options().glu};
  const TensorView p = probs ? TensorView(b.scales) : TensorView();
  Tensor fws = Tensor::empty({int64_t(expert_mlp_fp8_forward_workspace_size(T, H, F, dt, spec))}, DType::kUInt8);
  Tensor bws = Tensor::empty({int64_t(expert_mlp_fp8_backward_workspace_size(T, G, H, F, dt, spec, rows))},
                             DType::kUInt8);
  r.y = Tensor::zeros({T, H}, dt);
  expert_mlp_forward(b.x, p, w, b.groups(), r.y, saved, spec, recipe,
                     {nullptr, {fws.data(), fws.nbytes(), Device::cpu()}});
  r.dx = Tensor::zeros({T, H}, dt);
  r.dw1 = Tensor::zeros({G, W, H}, wdtype);
  r.dw2 = Tensor::zeros({G, H, F}, wdtype);
  ExpertMlpGrads g;
  g.dx = r.dx;
  if (probs) g.dprobs = r.dprobs = Tensor::zeros({T}, DType::kFloat32);
  g.fc1_weight = {GroupedParam::packed(r.dw1), GradMode::kWrite};
  g.fc2_weight = {GroupedParam::packed(r.dw2), GradMode::kWrite};
  if (m.has_bias()) {
    r.db1 = Tensor::zeros({G, W}, dt);
    r.db2 = Tensor::zeros({G, H}, dt);
    g.fc1_bias = {GroupedParam::packed(r.db1), GradMode::kWrite};
    g.fc2_bias = {GroupedParam::packed(r.db2), GradMode::kWrite};
  }
  expert_mlp_backward(b.dy, saved, p, w, b.groups(), g, spec, recipe,
                      {nullptr, {bws.data(), bws.nbytes(), Device::cpu()}});
  return r;
}

// What an FP8 GroupedMLP keeps: x (`x_kept`) in the form of the op's rule, its columns or its rows;
// the pre-activation's rows; the probs.
int64_t mlp_saved_bytes(int64_t T, int64_t G, int64_t H, int64_t F, bool x_kept, bool probs) {
  const int64_t x = !x_kept ? 0 : expert_mlp_fp8_keeps_x_rows(T, G) ? rows_bytes(T, H) : columns_bytes(T, G, H);
  return x + rows_bytes(T, 2 * F) + (probs ? 4 * T : 0);
}

// Routings of the MLP tests, by the form in which the module keeps x: kSplits (5 experts of 50
// tokens: the columns pad each expert to 128, 768 columns > 2 x 50, so rows), 32 experts of
// 0-4 tokens each (64 tokens: rows, its columns ~66x their bytes), and 2 experts of 130 and 120
// tokens (256: 512 columns, exactly 2T, so columns).
struct MlpRouting {
  const char* name;
  std::vector<int64_t> splits;
  int64_t capacity;
  bool x_rows;
  int64_t G() const { return int64_t(splits.size()); }
};
void PrintTo(const MlpRouting& r, std::ostream* os) { *os << r.name; }

std::vector<int64_t> many_small_splits() {  // 32 experts of 0, 2, 4, 1, 3, ... tokens (62 of 64)
  std::vector<int64_t> s;
  for (int64_t g = 0; g < 32; ++g) s.push_back(g * 7 % 5);
  return s;
}

std::vector<MlpRouting> mlp_routings() {
  return {{"five_experts", kSplits, kMlpT, true},
          {"many_small_experts", many_small_splits(), 64, true},
          {"few_large_experts", {130, 120}, 256, false}};
}

// The FP8 tensors an MLP context keeps of x match the reference's, in the form the rule names.
void expect_same_x(const MlpContext& ctx, const MlpReference& ref, int64_t rows) {
  const ExpertMlpFp8Saved s = ctx.fp8_saved();
  if (ref.x_rows.data.defined()) {
    EXPECT_FALSE(s.x.data.defined()) << "x's rows kept instead of its columns, not both";
    EXPECT_TRUE(same_rows(s.x_rows, ref.x_rows.view(), rows)) << "x's rows";
  } else {
    EXPECT_FALSE(s.x_rows.data.defined()) << "x's columns kept instead of its rows, not both";
    EXPECT_TRUE(same_columns(s.x, ref.x_columns.view())) << "x's columns";
  }
}

class Fp8GroupedMlp : public ::testing::TestWithParam<DType> {};

// Each routing of mlp_routings: x kept as rows or as columns as the op's rule says, and every
// output and gradient the bits of the op called directly with that form.
TEST_P(Fp8GroupedMlp, EqualsTheFp8OpAndLayoutsAreBitIdentical) {
  const DType dt = GetParam();
  Rng rng;
  for (const MlpRouting& mr : mlp_routings()) {
    SCOPED_TRACE(mr.name);
    const int64_t G = mr.G(), T = mr.capacity;
    ASSERT_EQ(expert_mlp_fp8_keeps_x_rows(T, G), mr.x_rows);
    const Batch b(rng, mr.splits, T, kH, kH, dt);
    GroupedMLP packed(G, kH, kF, mlp_options(dt));
    GroupedMLP per(G, kH, kF, mlp_options(dt, ExpertLayout::kPerExpert));
    ASSERT_TRUE(bitwise_equal(packed.fc1_weight().value(), per.fc1_weight().value()));
    const MlpReference ref = mlp_reference(packed, b, dt);
    ASSERT_EQ(ref.x_rows.data.defined(), mr.x_rows);
    const int64_t rows = b.routing.rows();
    for (GroupedMLP* m : {&packed, &per}) {
      SCOPED_TRACE(layout_name(m->options().layout));
      MlpForwardResult f = m->forward(b.x, b.groups(), b.scales);
      EXPECT_TRUE(bitwise_equal(f.y, ref.y));
      // Forward keeps what the op keeps, FP8 only.
      EXPECT_TRUE(f.ctx.saves_input());
      EXPECT_TRUE(f.ctx.saves_fc1_out());
      expect_same_x(f.ctx, ref, rows);
      EXPECT_TRUE(same_rows(f.ctx.fp8_saved().fc1_out, ref.h_rows.view(), rows));
      EXPECT_EQ(f.ctx.saved_bytes(), mlp_saved_bytes(T, G, kH, kF, true, true));
      MlpBackwardResult r = m->backward(f.ctx, b.dy);
      expect_backward_equals(r, ref);
      EXPECT_EQ(r.fc1_weight.grad.layout(), m->options().layout);
      EXPECT_EQ(m->fp8_weight_quantizations(), 2u) << "each weight once, for forward and backward";
    }
  }
}

// srelu and gelu_tanh: FC1 of F rows, the pre-activation's FP8 rows [T, F]; the module gives the
// op's bits.
TEST_P(Fp8GroupedMlp, NonGatedActivationsEqualTheFp8Op) {
  const DType dt = GetParam();
  Rng rng;
  const MlpRouting mr = mlp_routings()[2];  // x kept as columns
  const Batch b(rng, mr.splits, mr.capacity, kH, kH, dt);
  for (Activation act : kElementwiseActivations) {
    SCOPED_TRACE(activation_name(act));
    GroupedMLPOptions o = mlp_options(dt);
    o.glu = spec_of(act);
    GroupedMLP m(mr.G(), kH, kF, o);
    EXPECT_EQ(m.fc1_weight().expert_shape(), (Shape{kF, kH}));
    const MlpReference ref = mlp_reference(m, b, dt);
    MlpForwardResult f = m.forward(b.x, b.groups(), b.scales);
    EXPECT_TRUE(bitwise_equal(f.y, ref.y));
    EXPECT_EQ(f.ctx.fp8_saved().fc1_out.data.shape(), (Shape{mr.capacity, kF}));
    EXPECT_TRUE(same_rows(f.ctx.fp8_saved().fc1_out, ref.h_rows.view(), b.routing.rows()));
    MlpBackwardResult r = m.backward(f.ctx, b.dy);
    EXPECT_TRUE(bitwise_equal(r.dx, ref.dx));
    EXPECT_TRUE(bitwise_equal(r.dprobs, ref.dprobs));
    EXPECT_TRUE(bitwise_equal(packed_of(r.fc1_weight.grad.view()), ref.dw1));
    EXPECT_TRUE(bitwise_equal(packed_of(r.fc1_bias.grad.view()), ref.db1));
  }
}

// The module against the float64 MLP of the unquantized inputs (fp8_mlp_support.hpp's bound).
TEST_P(Fp8GroupedMlp, MatchesTheFloat64MlpWithinFp8Error) {
  const DType dt = GetParam();
  Rng rng;
  const Routing r(kSplits, kMlpT);
  // The activation's default clamp (7): the other tests' 1.5 puts many pre-activations at the clamp,
  // where FP8's rounding of the kept pre-activation moves the derivative's jump (more than the bound).
  GroupedMLPOptions o = mlp_options(dt, ExpertLayout::kPerExpert);
  o.glu = spec_of(Activation::kClampedQGeGLU, GluLayout::pairs());
  const Fp8MlpCase c(rng, kMlpT, kG, kH, kF, dt, o.glu, /*bias=*/true, /*probs=*/true);
  GroupedMLP m(kG, kH, kF, o);
  m.load_state_dict({{"fc1.weight", c.w1}, {"fc1.bias", c.b1}, {"fc2.weight", c.w2}, {"fc2.bias", c.b2}});
  MlpForwardResult f = m.forward(c.x, r.layout, c.p);
  MlpBackwardResult g = m.backward(f.ctx, c.dy);
  oracle::Matrix y;
  const oracle::MlpGrads want = fp8_mlp_oracle(c, r, y);
  const int64_t rows = r.rows();
  EXPECT_LE(oracle::similarity_diff(rows_of(f.y, rows), y), kFp8MlpSimilarityBound) << "y";
  EXPECT_LE(oracle::similarity_diff(rows_of(g.dx, rows), want.dx), kFp8MlpSimilarityBound) << "dx";
  EXPECT_LE(oracle::similarity_diff(head_of(g.dprobs, rows), want.dprobs), kFp8MlpSimilarityBound) << "dprobs";
  EXPECT_LE(oracle::similarity_diff(oracle::to_matrices(g.fc1_weight.grad.view()), want.dw1), kFp8MlpSimilarityBound);
  EXPECT_LE(oracle::similarity_diff(oracle::to_matrices(g.fc2_weight.grad.view()), want.dw2), kFp8MlpSimilarityBound);
  EXPECT_LE(oracle::similarity_diff(oracle::to_matrix(packed_of(g.fc1_bias.grad.view())), want.db1),
            kFp8MlpSimilarityBound);
  EXPECT_LE(oracle::similarity_diff(oracle::to_matrix(packed_of(g.fc2_bias.grad.view())), want.db2),
            kFp8MlpSimilarityBound);
  // The check can fail: the loaded weights are the oracle's, another module's are not.
  GroupedMLP unloaded(kG, kH, kF, o);
  EXPECT_GT(oracle::similarity_diff(rows_of(unloaded.forward(c.x, r.layout, c.p).y, rows), y), 0.1);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Fp8GroupedMlp, ::testing::Values(DType::kBFloat16, DType::kFloat32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// The recipes of the module-contract tests: all six GEMMs in FP8 (the FP8 MLP op), FP8 forward and
// dgrad with unquantized wgrads, FP8 wgrads alone (the last two: the two layers' form).
const Fp8ModuleRecipe kMlpRecipes[] = {gemms(true, true, true), gemms(true, true, false), gemms(false, false, true)};

std::string recipe_name(const Fp8ModuleRecipe& r) {
  return std::string("forward ") + (r.forward ? "fp8" : "16-bit") + ", dgrad " + (r.dgrad ? "fp8" : "16-bit") +
         ", wgrad " + (r.wgrad ? "fp8" : "16-bit");
}

// The module's results from the ops, in the form its recipe runs: the FP8 MLP op, or the two layers.
MlpReference reference_for(GroupedMLP& m, const Batch& b, DType wdtype) {
  const Fp8ModuleRecipe& r = *m.options().fp8;
  return r.forward && r.dgrad && r.wgrad ? mlp_reference(m, b, wdtype) : mlp_layers_reference(m, b, wdtype);
}

class Fp8MlpGradientContract : public ::testing::TestWithParam<std::tuple<Row, ExpertLayout>> {};

TEST_P(Fp8MlpGradientContract, Row) {
  const auto& [row, layout] = GetParam();
  for (const Fp8ModuleRecipe& recipe : kMlpRecipes) {
    SCOPED_TRACE(recipe_name(recipe));
    Rng rng;
    const Batch b(rng, kSplits, kMlpT, kH, kH, DType::kBFloat16);
    GroupedMLPOptions o = mlp_options(DType::kBFloat16, layout);
    o.fp8 = recipe;
    apply_row(o, row);
    GroupedMLP m(kG, kH, kF, o);
    Tensor mg1, mg2;
    if (row.main_grad) mg1 = main_grad_for(m.fc1_weight()), mg2 = main_grad_for(m.fc2_weight());
    if (row.flag) m.fc1_weight().grad_added_to_main_grad = m.fc2_weight().grad_added_to_main_grad = false;
    int hook_calls = 0;
    m.register_wgrad_hook([&] { ++hook_calls; });

    std::optional<MlpForwardResult> f = m.forward(b.x, b.groups(), b.scales);
    MlpBackwardResult r = m.backward(f->ctx, b.dy);
    f.reset();  // a queued job keeps its own tensors
    EXPECT_EQ(r.fc1_bias.kind, GradKind::kGrad) << "bias gradients are never delayed";
    expect_contract_steps(m, {{&r.fc1_weight, &m.fc1_weight()}, {&r.fc2_weight, &m.fc2_weight()}}, row, hook_calls);
    const MlpReference exact32 = reference_for(m, b, DType::kFloat32);
    EXPECT_TRUE(bitwise_equal(r.dx, exact32.dx));
    EXPECT_TRUE(bitwise_equal(r.dprobs, exact32.dprobs));
    if (row.main_grad) {
      EXPECT_TRUE(bitwise_equal(mg1, exact32.dw1)) << "fc1 main_grad";
      EXPECT_TRUE(bitwise_equal(mg2, exact32.dw2)) << "fc2 main_grad";
    } else if (row.delay) {
      EXPECT_TRUE(bitwise_equal(packed_of(m.fc1_weight().grad().view()), exact32.dw1)) << "fc1 .grad";
      EXPECT_TRUE(bitwise_equal(packed_of(m.fc2_weight().grad().view()), exact32.dw2)) << "fc2 .grad";
    } else {
      const MlpReference exact = reference_for(m, b, DType::kBFloat16);
      EXPECT_TRUE(bitwise_equal(packed_of(r.fc1_weight.grad.view()), exact.dw1));
      EXPECT_TRUE(bitwise_equal(packed_of(r.fc2_weight.grad.view()), exact.dw2));
    }
    if (row.backward_kind == GradKind::kDummy) {
      EXPECT_TRUE(
          bitwise_equal(packed_of(r.fc1_weight.grad.view()), Tensor::zeros({kG, 2 * kF, kH}, DType::kBFloat16)));
      EXPECT_NE(r.fc1_weight.grad.view().expert(0).data(), r.fc2_weight.grad.view().expert(0).data());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TableRows, Fp8MlpGradientContract, all_rows_and_layouts(), row_and_layout_name);

TEST(Fp8GroupedMlpModule, DelayedEqualsImmediateTwiceIsDoubleOverwriteReplaces) {
  for (const Fp8ModuleRecipe& recipe : kMlpRecipes) {
    SCOPED_TRACE(recipe_name(recipe));
    Rng rng;
    const Batch b(rng, kSplits, kMlpT, kH, kH, DType::kBFloat16);
    GroupedMLPOptions o = mlp_options(DType::kBFloat16, ExpertLayout::kPerExpert);
    o.fp8 = recipe;
    o.accumulate_into_main_grad = true;
    GroupedMLP now(kG, kH, kF, o);
    o.delay_wgrad_compute = true;
    GroupedMLP later(kG, kH, kF, o);
    const Tensor now1 = main_grad_for(now.fc1_weight()), now2 = main_grad_for(now.fc2_weight());
    const Tensor later1 = main_grad_for(later.fc1_weight()), later2 = main_grad_for(later.fc2_weight());
    int hooks = 0;
    later.register_wgrad_hook([&] { ++hooks; });
    for (int step = 0; step < 2; ++step) {
      MlpForwardResult f = now.forward(b.x, b.groups(), b.scales);
      MlpBackwardResult rn = now.backward(f.ctx, b.dy);
      MlpForwardResult g = later.forward(b.x, b.groups(), b.scales);
      MlpBackwardResult rl = later.backward(g.ctx, b.dy);
      EXPECT_TRUE(bitwise_equal(rl.dx, rn.dx));
      EXPECT_TRUE(bitwise_equal(rl.dprobs, rn.dprobs));
    }
    EXPECT_EQ(later.queued_wgrads(), 2u);
    EXPECT_TRUE(bitwise_equal(later1, Tensor::zeros({kG, 2 * kF, kH}, DType::kFloat32)));
    later.backward_dw();
    EXPECT_EQ(hooks, 1);
    EXPECT_TRUE(bitwise_equal(later1, now1)) << "delayed != immediate";
    EXPECT_TRUE(bitwise_equal(later2, now2)) << "delayed != immediate";
    const MlpReference once = reference_for(now, b, DType::kFloat32);
    EXPECT_TRUE(bitwise_equal(now1, doubled(once.dw1))) << "accumulating twice is not 2x";
    EXPECT_TRUE(bitwise_equal(now2, doubled(once.dw2))) << "accumulating twice is not 2x";

    o.delay_wgrad_compute = false;
    o.overwrite_main_grad = true;
    GroupedMLP over(kG, kH, kF, o);
    const Tensor over1 = main_grad_for(over.fc1_weight()), over2 = main_grad_for(over.fc2_weight());
    fill_uniform(over1, 3, -1, 1);
    fill_uniform(over2, 4, -1, 1);
    for (int step = 0; step < 2; ++step) {
      MlpForwardResult f = over.forward(b.x, b.groups(), b.scales);
      over.backward(f.ctx, b.dy);
    }
    EXPECT_TRUE(bitwise_equal(over1, once.dw1)) << "overwrite";
    EXPECT_TRUE(bitwise_equal(over2, once.dw2)) << "overwrite";
  }
}

TEST(Fp8GroupedMlpModule, KeepsOnlyWhatBackwardNeeds) {
  Rng rng;
  const Batch b(rng, kSplits, kMlpT, kH, kH, DType::kBFloat16);
  GroupedMLPOptions o = mlp_options();
  o.bias = false;
  GroupedMLP m(kG, kH, kF, o);
  // Input without grad, no probs: the FP8 rows of h and x's rows (5 experts of 50 tokens).
  MlpForwardResult f = m.forward(b.x, b.groups(), {}, /*input_requires_grad=*/false);
  EXPECT_TRUE(f.ctx.fp8_saved().x_rows.data.defined());
  EXPECT_EQ(f.ctx.saved_bytes(), mlp_saved_bytes(kMlpT, kG, kH, kF, true, false));
  MlpBackwardResult r = m.backward(f.ctx, b.dy);
  EXPECT_FALSE(r.dx.defined());
  EXPECT_EQ(r.fc1_weight.kind, GradKind::kGrad);
  // FC1 frozen: neither columns nor rows of x.
  m.fc1_weight().requires_grad = false;
  f = m.forward(b.x, b.groups(), b.scales);
  EXPECT_FALSE(f.ctx.saves_input());
  EXPECT_FALSE(f.ctx.fp8_saved().x.data.defined());
  EXPECT_FALSE(f.ctx.fp8_saved().x_rows.data.defined());
  EXPECT_EQ(f.ctx.saved_bytes(), mlp_saved_bytes(kMlpT, kG, kH, kF, false, true));
  r = m.backward(f.ctx, b.dy);
  EXPECT_TRUE(r.dx.defined());
  EXPECT_EQ(r.fc1_weight.kind, GradKind::kNone);
  EXPECT_EQ(r.fc2_weight.kind, GradKind::kGrad);
  // Nothing wants a gradient: nothing kept.
  m.fc2_weight().requires_grad = false;
  f = m.forward(b.x, b.groups(), {}, false);
  EXPECT_FALSE(f.ctx.saves_fc1_out());
  EXPECT_EQ(f.ctx.saved_bytes(), 0);
  r = m.backward(f.ctx, b.dy);
  EXPECT_FALSE(r.dx.defined());
}

// Many experts of few tokens (32 experts, 64 tokens): x's columns would pad every expert to 128
// tokens, so the module keeps x's FP8 rows (the op's rule) and backward makes the columns from
// them. saved_bytes() is the rows' formula, far below the columns'; every output and gradient is
// the op's with x_rows, bit for bit, also delayed; FC1's weight gradient is not the columns' bits
// (x is rounded a second time) but within FP8's error of them.
TEST(Fp8GroupedMlpModule, ManySmallExpertsKeepTheRowsOfX) {
  Rng rng;
  const std::vector<int64_t> splits = many_small_splits();
  const int64_t G = int64_t(splits.size()), T = 64;
  ASSERT_EQ(G, 32);
  ASSERT_TRUE(expert_mlp_fp8_keeps_x_rows(T, G));
  const Batch b(rng, splits, T, kH, kH, DType::kBFloat16);
  GroupedMLPOptions o = mlp_options(DType::kBFloat16, ExpertLayout::kPerExpert);
  o.accumulate_into_main_grad = true;
  GroupedMLP now(G, kH, kF, o);
  o.delay_wgrad_compute = true;
  GroupedMLP later(G, kH, kF, o);
  const Tensor now1 = main_grad_for(now.fc1_weight()), now2 = main_grad_for(now.fc2_weight());
  const Tensor later1 = main_grad_for(later.fc1_weight()), later2 = main_grad_for(later.fc2_weight());
  const MlpReference ref = mlp_reference(now, b, DType::kFloat32);
  ASSERT_TRUE(ref.x_rows.data.defined());
  const MlpReference by_columns = mlp_reference(now, b, DType::kFloat32, true, /*x_rows=*/false);

  MlpForwardResult f = now.forward(b.x, b.groups(), b.scales);
  MlpForwardResult g = later.forward(b.x, b.groups(), b.scales);
  const int64_t rows_saved = rows_bytes(T, kH) + rows_bytes(T, 2 * kF) + 4 * T;
  const int64_t columns_saved = columns_bytes(T, G, kH) + rows_bytes(T, 2 * kF) + 4 * T;
  for (const MlpContext* c : {&f.ctx, &g.ctx}) {
    EXPECT_TRUE(c->saves_input());
    expect_same_x(*c, ref, b.routing.rows());
    EXPECT_EQ(c->fp8_saved().x_rows.data.shape(), (Shape{T, kH}));
    EXPECT_EQ(c->saved_bytes(), rows_saved);
  }
  EXPECT_EQ(mlp_saved_bytes(T, G, kH, kF, true, true), rows_saved);
  EXPECT_LT(4 * rows_saved, columns_saved) << "the columns of 32 experts of 0-4 tokens: 4224 tokens' worth";
  EXPECT_TRUE(bitwise_equal(f.y, ref.y));
  EXPECT_TRUE(bitwise_equal(g.y, ref.y));
  MlpBackwardResult rn = now.backward(f.ctx, b.dy);
  MlpBackwardResult rl = later.backward(g.ctx, b.dy);
  EXPECT_FALSE(f.ctx.saves_input()) << "backward releases what the context kept";
  for (const MlpBackwardResult* r : {&rn, &rl}) {
    EXPECT_TRUE(bitwise_equal(r->dx, ref.dx));
    EXPECT_TRUE(bitwise_equal(r->dprobs, ref.dprobs));
    EXPECT_TRUE(bitwise_equal(packed_of(r->fc1_bias.grad.view()), ref.db1));
    EXPECT_TRUE(bitwise_equal(packed_of(r->fc2_bias.grad.view()), ref.db2));
  }
  EXPECT_EQ(later.queued_wgrads(), 1u);
  EXPECT_TRUE(bitwise_equal(later1, Tensor::zeros({G, 2 * kF, kH}, DType::kFloat32)));
  later.backward_dw();
  EXPECT_TRUE(bitwise_equal(now1, ref.dw1)) << "fc1 main_grad";
  EXPECT_TRUE(bitwise_equal(now2, ref.dw2)) << "fc2 main_grad";
  EXPECT_TRUE(bitwise_equal(later1, now1)) << "delayed != immediate";
  EXPECT_TRUE(bitwise_equal(later2, now2)) << "delayed != immediate";
  // Only FC1's weight gradient reads x: the rest are the columns' bits too.
  EXPECT_FALSE(bitwise_equal(now1, by_columns.dw1)) << "the reference kept columns: x rounded once";
  EXPECT_LE(oracle::similarity_diff(experts_of(now1), experts_of(by_columns.dw1)), 1e-3);
  for (auto [a, c] : {std::pair{&now2, &by_columns.dw2}, {&ref.dx, &by_columns.dx}, {&ref.y, &by_columns.y},
                      {&ref.dprobs, &by_columns.dprobs}})
    EXPECT_TRUE(bitwise_equal(*a, *c));
}

TEST(Fp8GroupedMlpModule, WeightCacheIsReusedUntilInvalidated) {
  Rng rng;
  const Batch b(rng, kSplits, kMlpT, kH, kH, DType::kBFloat16);
  GroupedMLP m(kG, kH, kF, mlp_options());
  const MlpReference before = mlp_reference(m, b, DType::kBFloat16);
  MlpForwardResult f1 = m.forward(b.x, b.groups(), b.scales);
  MlpForwardResult f2 = m.forward(b.x, b.groups(), b.scales);
  EXPECT_EQ(m.fp8_weight_quantizations(), 2u);
  for (const auto& [key, t] : m.state_dict())
    if (key.find("weight") != std::string::npos) fill_uniform(t, 99 + key.size(), -0.1f, 0.1f);
  EXPECT_TRUE(bitwise_equal(m.forward(b.x, b.groups(), b.scales).y, before.y))
      << "stale copies serve until invalidated";
  EXPECT_TRUE(bitwise_equal(m.backward(f1.ctx, b.dy).dx, before.dx));
  EXPECT_EQ(m.fp8_weight_quantizations(), 2u);
  m.invalidate_fp8_weights();
  const MlpReference after = mlp_reference(m, b, DType::kBFloat16);
  ASSERT_FALSE(bitwise_equal(after.y, before.y));
  EXPECT_TRUE(bitwise_equal(m.forward(b.x, b.groups(), b.scales).y, after.y));
  EXPECT_EQ(m.fp8_weight_quantizations(), 4u);

  GroupedMLPOptions other_options = mlp_options(DType::kBFloat16, ExpertLayout::kPerExpert);
  other_options.seed = 31;
  GroupedMLP other(kG, kH, kF, other_options);
  m.load_state_dict(other.state_dict());
  EXPECT_TRUE(bitwise_equal(m.forward(b.x, b.groups(), b.scales).y, mlp_reference(other, b, DType::kBFloat16).y));
  EXPECT_EQ(m.fp8_weight_quantizations(), 6u);
  // Replacing one weight refreshes that weight's copies only.
  other_options.seed = 32;
  other_options.layout = ExpertLayout::kPacked;
  m.fc2_weight() = GroupedMLP(kG, kH, kF, other_options).fc2_weight();
  EXPECT_TRUE(bitwise_equal(m.forward(b.x, b.groups(), b.scales).y, mlp_reference(m, b, DType::kBFloat16).y));
  EXPECT_EQ(m.fp8_weight_quantizations(), 7u);
}

TEST(Fp8GroupedMlpModule, BadOptionsAreClearErrors) {
  GroupedMLPOptions o = mlp_options();
  o.fp8 = gemms(false, false, false);
  EXPECT_MOE_ERROR((GroupedMLP(kG, kH, kF, o)), ErrorCode::kInvalidArgument,
                   "GroupedMLP: options.fp8 names no GEMM (forward, dgrad and wgrad are all false)");
  o = mlp_options(DType::kFloat16);
  EXPECT_MOE_ERROR((GroupedMLP(kG, kH, kF, o)), ErrorCode::kDType, "needs dtype bfloat16 or float32");
  EXPECT_MOE_ERROR((GroupedMLP(kG, kH, 40, mlp_options())), ErrorCode::kShape, "got hidden = 144, ffn = 40");
  EXPECT_MOE_ERROR((GroupedMLP(kG, 24, kF, mlp_options())), ErrorCode::kShape, "got hidden = 24, ffn = 80");
  o = mlp_options();
  o.recompute_fc1 = true;
  EXPECT_MOE_ERROR((GroupedMLP(kG, kH, kF, o)), ErrorCode::kInvalidArgument, "expected recompute_fc1 = false");
  o = mlp_options();
  o.fp8->quantizer.amax_epsilon = std::numeric_limits<float>::infinity();
  EXPECT_MOE_ERROR((GroupedMLP(kG, kH, kF, o)), ErrorCode::kInvalidArgument, "amax_epsilon: expected a finite value");
}

// ---- activation offload of the FP8 tensors ----

// Copies of a context's FP8 tensors (whole buffers: offload moves every byte).
std::vector<Tensor> snapshot(const std::vector<TensorView>& views) {
  std::vector<Tensor> out;
  for (const TensorView& v : views) {
    Tensor t = Tensor::empty(v.shape(), v.dtype());
    copy_tensor(t, v);
    out.push_back(t);
  }
  return out;
}
std::vector<TensorView> fp8_views(const LinearContext& c) {
  const Fp8Columns x = c.saved_x_columns();
  return {x.data, x.scales, x.offsets};
}
std::vector<TensorView> fp8_views(const MlpContext& c) {  // x's columns or rows, h's rows
  const ExpertMlpFp8Saved s = c.fp8_saved();
  std::vector<TensorView> out;
  for (const TensorView& v : {s.x.data, s.x.scales, s.x.offsets, s.x_rows.data, s.x_rows.scales, s.fc1_out.data,
                              s.fc1_out.scales})
    if (v.defined()) out.push_back(v);
  return out;
}
bool same_bytes(const std::vector<Tensor>& a, const std::vector<TensorView>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!b[i].defined() || a[i].dtype() != b[i].dtype() || !bitwise_equal(a[i], b[i])) return false;
  return true;
}

// Three layers, each an FP8 GroupedLinear [H -> H] with a probs-scaled bias followed by an FP8
// GroupedMLP, weights into float32 main_grad: with offload the same bits as without, and every FP8
// tensor comes back byte for byte; for each routing of mlp_routings (the MLPs keep x's rows, or its
// columns).
class Fp8ModulesOffload : public ::testing::TestWithParam<MlpRouting> {};

TEST_P(Fp8ModulesOffload, FP8SavedTensorsRoundTripBitExactly) {
  constexpr int kLayers = 3;
  const MlpRouting& mr = GetParam();
  const int64_t G = mr.G();
  Rng rng;
  const Batch b(rng, mr.splits, mr.capacity, kH, kH, DType::kBFloat16);
  struct Stack {
    std::vector<std::unique_ptr<GroupedLinear>> linears;
    std::vector<std::unique_ptr<GroupedMLP>> mlps;
    std::vector<Tensor> main_grads;
    explicit Stack(int64_t G) {
      for (int i = 0; i < kLayers; ++i) {
        GroupedLinearOptions lo = linear_options();
        lo.seed = 200 + uint64_t(i);
        lo.accumulate_into_main_grad = true;
        linears.push_back(std::make_unique<GroupedLinear>(G, kH, kH, lo));
        GroupedMLPOptions mo = mlp_options(DType::kBFloat16, i % 2 ? ExpertLayout::kPerExpert : ExpertLayout::kPacked);
        mo.seed = 100 + uint64_t(i);
        mo.accumulate_into_main_grad = true;
        mlps.push_back(std::make_unique<GroupedMLP>(G, kH, kF, mo));
        for (Parameter* p : {&linears.back()->weight(), &mlps.back()->fc1_weight(), &mlps.back()->fc2_weight()})
          main_grads.push_back(main_grad_for(*p));
      }
    }
  };
  struct StepOut {
    Tensor y, dx;
    std::vector<Tensor> dprobs;
  };
  auto step = [&](Stack& s, ActivationOffload* offload) {
    std::vector<LinearContext> lctx(kLayers);
    std::vector<MlpContext> mctx(kLayers);
    std::vector<std::vector<Tensor>> lsnap(kLayers), msnap(kLayers);
    Tensor x = b.x;
    int64_t offloaded = 0;
    for (int i = 0; i < kLayers; ++i) {
      if (offload) offload->begin_layer(i, nullptr);
      LinearForwardResult lf = s.linears[size_t(i)]->forward(x, b.groups(), b.scales);
      lsnap[size_t(i)] = snapshot(fp8_views(lf.ctx));
      if (i < kLayers - 1) offloaded += lf.ctx.saved_bytes();
      if (offload) offload->offload(lf.ctx, nullptr);
      lctx[size_t(i)] = std::move(lf.ctx);
      MlpForwardResult mf = s.mlps[size_t(i)]->forward(lf.y, b.groups(), b.scales);
      EXPECT_EQ(mf.ctx.fp8_saved().x_rows.data.defined(), mr.x_rows);
      EXPECT_EQ(mf.ctx.fp8_saved().x.data.defined(), !mr.x_rows);
      msnap[size_t(i)] = snapshot(fp8_views(mf.ctx));
      EXPECT_EQ(msnap[size_t(i)].size(), mr.x_rows ? 4u : 5u);
      if (i < kLayers - 1) offloaded += mf.ctx.saved_bytes();
      if (offload) offload->offload(mf.ctx, nullptr);
      EXPECT_EQ(mf.ctx.offloaded(), offload != nullptr && i < kLayers - 1) << "layer " << i;
      mctx[size_t(i)] = std::move(mf.ctx);
      x = mf.y;
    }
    if (offload) EXPECT_EQ(offload->offloaded_bytes(), offloaded) << "every saved byte of layers 0..L-2 went";
    StepOut out;
    out.y = x;
    Tensor dy = b.dy;
    for (int i = kLayers - 1; i >= 0; --i) {
      if (offload) offload->restore(mctx[size_t(i)], nullptr);
      EXPECT_TRUE(same_bytes(msnap[size_t(i)], fp8_views(mctx[size_t(i)]))) << "MLP layer " << i;
      MlpBackwardResult mb = s.mlps[size_t(i)]->backward(mctx[size_t(i)], dy);
      if (offload) offload->restore(lctx[size_t(i)], nullptr);
      EXPECT_TRUE(same_bytes(lsnap[size_t(i)], fp8_views(lctx[size_t(i)]))) << "linear layer " << i;
      LinearBackwardResult lb = s.linears[size_t(i)]->backward(lctx[size_t(i)], mb.dx);
      out.dprobs.push_back(mb.dprobs);
      out.dprobs.push_back(lb.dscales);
      dy = lb.dx;
    }
    out.dx = dy;
    return out;
  };
  Stack plain(G), offloaded(G);
  ActivationOffload offload(Device::cpu(), kLayers, -1, {.min_bytes = 0});
  for (int s = 0; s < 2; ++s) {
    const StepOut a = step(plain, nullptr);
    const StepOut c = step(offloaded, &offload);
    EXPECT_TRUE(bitwise_equal(a.y, c.y));
    EXPECT_TRUE(bitwise_equal(a.dx, c.dx));
    ASSERT_EQ(a.dprobs.size(), c.dprobs.size());
    for (size_t i = 0; i < a.dprobs.size(); ++i) EXPECT_TRUE(bitwise_equal(a.dprobs[i], c.dprobs[i])) << i;
    EXPECT_GT(offload.reloaded_bytes(), 0);
  }
  for (size_t i = 0; i < plain.main_grads.size(); ++i)
    EXPECT_TRUE(bitwise_equal(plain.main_grads[i], offloaded.main_grads[i])) << "main_grad " << i;
}

INSTANTIATE_TEST_SUITE_P(Routings, Fp8ModulesOffload, ::testing::ValuesIn(mlp_routings()),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- odd routings ----

struct OddRouting {
  const char* name;
  std::vector<int64_t> splits;
  int64_t capacity;
};

const OddRouting kOddRoutings[] = {
    {"single_expert", {37}, 40},          {"one_expert_takes_all", {0, 0, 45, 0}, 48},
    {"one_row_experts", {1, 1, 0, 1}, 8}, {"more_than_a_block_per_expert", {130, 0, 3}, 140},
    {"no_rows", {0, 0, 0}, 16},
    // The MLP keeps x's columns here (384 columns <= 2 x 256), its rows in all the others.
    {"one_expert_of_many_rows", {250}, 256},
};

TEST(Fp8ModulesOddRoutings, BothModulesEqualTheOpsPackedEqualsPerExpert) {
  Rng rng;
  for (const OddRouting& oc : kOddRoutings) {
    SCOPED_TRACE(oc.name);
    const int64_t G = int64_t(oc.splits.size());
    const Batch lb(rng, oc.splits, oc.capacity, kIn, kOut, DType::kBFloat16);
    const Batch mb(rng, oc.splits, oc.capacity, kH, kH, DType::kBFloat16);
    for (ExpertLayout layout : {ExpertLayout::kPacked, ExpertLayout::kPerExpert}) {
      SCOPED_TRACE(layout_name(layout));
      GroupedLinear lin(G, kIn, kOut, linear_options(DType::kBFloat16, layout));
      const LinearReference lref = linear_reference(lin, lb, DType::kBFloat16);
      LinearForwardResult lf = lin.forward(lb.x, lb.groups(), lb.scales);
      LinearBackwardResult lr = lin.backward(lf.ctx, lb.dy);
      EXPECT_TRUE(bitwise_equal(lf.y, lref.y));
      EXPECT_TRUE(bitwise_equal(lr.dx, lref.dx));
      EXPECT_TRUE(bitwise_equal(packed_of(lr.weight.grad.view()), lref.dw)) << "empty experts get zeros";
      EXPECT_TRUE(bitwise_equal(lr.dscales, lref.dscales));

      GroupedMLP mlp(G, kH, kF, mlp_options(DType::kBFloat16, layout));
      const MlpReference mref = mlp_reference(mlp, mb, DType::kBFloat16);
      MlpForwardResult mf = mlp.forward(mb.x, mb.groups(), mb.scales);
      EXPECT_EQ(mref.x_rows.data.defined(), std::string(oc.name) != "one_expert_of_many_rows");
      expect_same_x(mf.ctx, mref, mb.routing.rows());
      MlpBackwardResult mr = mlp.backward(mf.ctx, mb.dy);
      EXPECT_TRUE(bitwise_equal(mf.y, mref.y));
      EXPECT_TRUE(bitwise_equal(mr.dx, mref.dx));
      EXPECT_TRUE(bitwise_equal(mr.dprobs, mref.dprobs));
      EXPECT_TRUE(bitwise_equal(packed_of(mr.fc1_weight.grad.view()), mref.dw1));
      EXPECT_TRUE(bitwise_equal(packed_of(mr.fc2_weight.grad.view()), mref.dw2));
      EXPECT_TRUE(bitwise_equal(packed_of(mr.fc1_bias.grad.view()), mref.db1));
      EXPECT_TRUE(bitwise_equal(packed_of(mr.fc2_bias.grad.view()), mref.db2));
      const int64_t rows = lb.routing.rows();
      if (rows == 0) {
        EXPECT_TRUE(bitwise_equal(lf.y, Tensor::zeros({oc.capacity, kOut}, DType::kBFloat16)));
        EXPECT_TRUE(bitwise_equal(mf.y, Tensor::zeros({oc.capacity, kH}, DType::kBFloat16)));
        continue;
      }
      const oracle::Matrix y =
          oracle::linear_forward(rows_of(lb.x, rows), oracle::to_matrices(lin.weight().value()), lb.routing.splits,
                                 oracle::to_matrix(packed_of(lin.bias().value())), head_of(lb.scales, rows));
      EXPECT_LE(oracle::similarity_diff(rows_of(lf.y, rows), y), kFp8MlpSimilarityBound);
    }
  }
}

}  // namespace
}  // namespace moe::test
