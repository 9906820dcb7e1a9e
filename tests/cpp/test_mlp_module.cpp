// GroupedMLP module (CPU backend): equal to the expert MLP op, packed and per-expert bit-identical,
// what forward keeps, the six-row gradient contract for both weights, delayed = immediate,
// accumulate / overwrite main_grad, hooks, state dicts across layouts and GLU layouts.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>

#include "moe_engine/modules.hpp"
#include "grad_contract_rows.hpp"
#include "test_support.hpp"

namespace moe::test {
namespace {

constexpr int64_t kG = 5, kH = 24, kF = 16, kT = 36;

struct Batch {
  Routing routing{{7, 0, 1, 13, 9}, kT};  // empty and 1-row experts, 6 rows past the end
  Tensor x, dy, probs;
  explicit Batch(Rng& rng)
      : x(random_tensor({kT, kH}, DType::kBFloat16, rng)),
        dy(random_tensor({kT, kH}, DType::kBFloat16, rng)),
        probs(uniform_tensor({kT}, DType::kFloat32, rng, 0.05, 1.0)) {}
};

GroupedMLPOptions options(ExpertLayout layout = ExpertLayout::kPacked) {
  GroupedMLPOptions o;
  o.layout = layout;
  o.bias = true;
  o.glu.activation = Activation::kClampedQGeGLU;
  o.glu.limit = 1.5f;  // the initialized pre-activation reaches past it
  o.glu.layout = GluLayout::pairs();
  o.seed = 7;
  return o;
}

Tensor packed_of(const GroupedParam& p) {  // a packed CPU copy of any grouped parameter
  Shape s{p.num_groups()};
  for (int64_t d : p.expert_shape()) s.push_back(d);
  Tensor out = Tensor::zeros(s, p.dtype());
  for (int64_t g = 0; g < p.num_groups(); ++g) copy_tensor(out.view().select(g), p.expert(g));
  return out;
}

struct MainGrads {
  Tensor fc1, fc2;
  explicit MainGrads(GroupedMLP& m)
      : fc1(Tensor::zeros({kG, 2 * kF, kH}, DType::kFloat32)), fc2(Tensor::zeros({kG, kH, kF}, DType::kFloat32)) {
    m.fc1_weight().set_main_grad(GroupedParam::packed(fc1));
    m.fc2_weight().set_main_grad(GroupedParam::packed(fc2));
  }
};

// What the op gives for the module's parameters on this batch: dx, dprobs and every gradient
// written (weights as `wdtype`).
struct Reference {
  Tensor y, dx, dprobs, dw1, dw2, db1, db2;
};
Reference reference(GroupedMLP& m, const Batch& b, DType wdtype) {
  const ExpertMlpWeights w{m.fc1_weight().value(), m.fc1_bias().value(), m.fc2_weight().value(),
                           m.fc2_bias().value()};
  const ExpertMlpSpec spec{m.options().glu};
  const int64_t W = fc1_width(spec.glu, kF);
  Reference r;
  r.y = Tensor::zeros({kT, kH}, DType::kBFloat16);
  Tensor h = Tensor::zeros({kT, W}, DType::kBFloat16);
  Tensor fws = Tensor::empty({int64_t(expert_mlp_forward_workspace_size(kT, kH, kF, DType::kBFloat16, true, spec)) + 1},
                             DType::kUInt8);
  expert_mlp_forward(b.x, b.probs, w, b.routing.layout, r.y, h, spec, {nullptr, {fws.data(), fws.nbytes(), Device::cpu()}});
  r.dx = Tensor::zeros({kT, kH}, DType::kBFloat16);
  r.dprobs = Tensor::zeros({kT}, DType::kFloat32);
  r.dw1 = Tensor::zeros({kG, W, kH}, wdtype);
  r.dw2 = Tensor::zeros({kG, kH, kF}, wdtype);
  r.db1 = Tensor::zeros({kG, W}, DType::kBFloat16);
  r.db2 = Tensor::zeros({kG, kH}, DType::kBFloat16);
  ExpertMlpGrads g;
  g.dx = r.dx;
  g.dprobs = r.dprobs;
  g.fc1_weight = {GroupedParam::packed(r.dw1), GradMode::kWrite};
  g.fc2_weight = {GroupedParam::packed(r.dw2), GradMode::kWrite};
  g.fc1_bias = {GroupedParam::packed(r.db1), GradMode::kWrite};
  g.fc2_bias = {GroupedParam::packed(r.db2), GradMode::kWrite};
  Tensor bws = Tensor::empty({int64_t(expert_mlp_backward_workspace_size(kT, kH, kF, DType::kBFloat16, false, spec)) + 1},
                             DType::kUInt8);
  expert_mlp_backward(b.dy, b.x, b.probs, w, b.routing.layout, h, g, spec, {nullptr, {bws.data(), bws.nbytes(), Device::cpu()}});
  return r;
}

TEST(GroupedMlpModule, EqualsTheOpAndLayoutsAreBitIdentical) {
  Rng rng;
  Batch b(rng);
  GroupedMLP packed(kG, kH, kF, options());
  GroupedMLP per(kG, kH, kF, options(ExpertLayout::kPerExpert));
  ASSERT_TRUE(bitwise_equal(packed.fc1_weight().value(), per.fc1_weight().value()));
  ASSERT_TRUE(bitwise_equal(packed.fc2_bias().value(), per.fc2_bias().value()));
  const Reference ref = reference(packed, b, DType::kBFloat16);
  for (GroupedMLP* m : {&packed, &per}) {
    SCOPED_TRACE(m == &packed ? "packed" : "per-expert");
    MlpForwardResult f = m->forward(b.x, b.routing.layout, b.probs);
    EXPECT_TRUE(bitwise_equal(f.y, ref.y));
    EXPECT_TRUE(f.ctx.saves_fc1_out());
    MlpBackwardResult r = m->backward(f.ctx, b.dy);
    EXPECT_TRUE(bitwise_equal(r.dx, ref.dx));
    EXPECT_TRUE(bitwise_equal(r.dprobs, ref.dprobs));
    for (auto [got, want, name] : {std::tuple{&r.fc1_weight, &ref.dw1, "dw1"}, {&r.fc2_weight, &ref.dw2, "dw2"},
                                   {&r.fc1_bias, &ref.db1, "db1"}, {&r.fc2_bias, &ref.db2, "db2"}}) {
      EXPECT_EQ(got->kind, GradKind::kGrad) << name;
      EXPECT_TRUE(bitwise_equal(packed_of(got->grad.view()), *want)) << name;
    }
    EXPECT_EQ(r.fc1_weight.grad.layout(), m->options().layout);
  }
}

// srelu and gelu_tanh: FC1 of F rows; the module equals the op in both expert layouts, keeps
// 2 (H + F) + 4 bytes per token, delays its weight gradients bit for bit, round-trips its state
// dict and refuses a GLU layout conversion.
TEST(GroupedMlpModule, NonGatedActivationsEqualTheOpAndKeepFColumns) {
  Rng rng;
  Batch b(rng);
  for (Activation act : kElementwiseActivations) {
    SCOPED_TRACE(activation_name(act));
    GroupedMLPOptions o = options();
    o.glu = spec_of(act);
    GroupedMLPOptions o_per = o, o_delay = o;
    o_per.layout = ExpertLayout::kPerExpert;
    o_delay.delay_wgrad_compute = true;
    GroupedMLP packed(kG, kH, kF, o), per(kG, kH, kF, o_per), delayed(kG, kH, kF, o_delay);
    EXPECT_EQ(packed.fc1_weight().expert_shape(), (Shape{kF, kH}));
    EXPECT_EQ(packed.fc1_bias().expert_shape(), (Shape{kF}));
    const Reference ref = reference(packed, b, DType::kBFloat16);
    for (GroupedMLP* m : {&packed, &per, &delayed}) {
      SCOPED_TRACE(m == &packed ? "packed" : m == &per ? "per-expert" : "delayed wgrad");
      MlpForwardResult f = m->forward(b.x, b.routing.layout, b.probs);
      EXPECT_TRUE(bitwise_equal(f.y, ref.y));
      EXPECT_EQ(f.ctx.saved_bytes(), kT * (2 * (kH + kF) + 4));
      MlpBackwardResult r = m->backward(f.ctx, b.dy);
      EXPECT_TRUE(bitwise_equal(r.dx, ref.dx));
      EXPECT_TRUE(bitwise_equal(r.dprobs, ref.dprobs));
      EXPECT_TRUE(bitwise_equal(packed_of(r.fc1_bias.grad.view()), ref.db1));
      if (m == &delayed) {
        EXPECT_EQ(r.fc1_weight.kind, GradKind::kNone);
        m->backward_dw();
        continue;
      }
      EXPECT_TRUE(bitwise_equal(packed_of(r.fc1_weight.grad.view()), ref.dw1));
      EXPECT_TRUE(bitwise_equal(packed_of(r.fc2_weight.grad.view()), ref.dw2));
    }
    // The state dict round-trips across expert layouts; a GLU layout conversion is refused.
    const std::map<std::string, Tensor> sd = packed.state_dict("mlp.");
    EXPECT_EQ(sd.at("mlp.fc1.weight").shape(), (Shape{kG, kF, kH}));
    GroupedMLPOptions o_other = o_per;
    o_other.seed = 99;
    GroupedMLP other(kG, kH, kF, o_other);
    other.load_state_dict(sd, "mlp.");
    EXPECT_TRUE(bitwise_equal(other.fc1_weight().value(), packed.fc1_weight().value()));
    EXPECT_MOE_ERROR(other.load_state_dict(sd, "mlp.", GluLayout::halves()), ErrorCode::kInvalidArgument,
                     "GroupedMLP.load_state_dict: glu_from = halves given, but the module's activation " +
                         std::string(activation_name(act)) + " is not gated (FC1's rows have no GLU layout)");
    // A GLU-sized checkpoint (2F rows) does not load.
    GroupedMLP glu_module(kG, kH, kF, options());
    EXPECT_MOE_ERROR(other.load_state_dict(glu_module.state_dict("mlp."), "mlp."), ErrorCode::kShape, "fc1.weight");
  }
}

TEST(GroupedMlpModule, RecomputeEqualsSavedAndKeepsOnlyX) {
  Rng rng;
  Batch b(rng);
  GroupedMLP saved(kG, kH, kF, options());
  GroupedMLPOptions o = options();
  o.recompute_fc1 = true;
  GroupedMLP recompute(kG, kH, kF, o);
  MlpForwardResult fs = saved.forward(b.x, b.routing.layout, b.probs);
  MlpForwardResult fr = recompute.forward(b.x, b.routing.layout, b.probs);
  EXPECT_FALSE(fr.ctx.saves_fc1_out());
  EXPECT_TRUE(fr.ctx.saves_input());
  // docs/design.md section 4's memory bound: 2 (H + 2F) bytes per token + the prob; recompute:
  // x + prob.
  const int64_t T = b.x.size(0);
  EXPECT_EQ(fs.ctx.saved_bytes(), T * (2 * (kH + 2 * kF) + 4));
  EXPECT_EQ(fr.ctx.saved_bytes(), T * (2 * kH + 4));
  EXPECT_TRUE(bitwise_equal(fs.y, fr.y));
  MlpBackwardResult rs = saved.backward(fs.ctx, b.dy), rr = recompute.backward(fr.ctx, b.dy);
  EXPECT_TRUE(bitwise_equal(rs.dx, rr.dx));
  EXPECT_TRUE(bitwise_equal(rs.dprobs, rr.dprobs));
  EXPECT_TRUE(bitwise_equal(rs.fc1_weight.grad.view(), rr.fc1_weight.grad.view()));
  EXPECT_TRUE(bitwise_equal(rs.fc2_weight.grad.view(), rr.fc2_weight.grad.view()));
}

TEST(GroupedMlpModule, KeepsOnlyWhatBackwardNeeds) {
  Rng rng;
  Batch b(rng);
  GroupedMLPOptions o = options();
  o.bias = false;
  GroupedMLP m(kG, kH, kF, o);
  // Input without grad, weights with: weight gradients, no dgrad.
  MlpForwardResult f = m.forward(b.x, b.routing.layout, {}, /*input_requires_grad=*/false);
  EXPECT_TRUE(f.ctx.saves_input());
  EXPECT_TRUE(f.ctx.saves_fc1_out());
  MlpBackwardResult r = m.backward(f.ctx, b.dy);
  EXPECT_FALSE(r.dx.defined());
  EXPECT_FALSE(r.dprobs.defined());
  EXPECT_EQ(r.fc1_weight.kind, GradKind::kGrad);
  EXPECT_EQ(r.fc2_weight.kind, GradKind::kGrad);
  // Frozen weights: x not kept (the pre-activation is: dgrad goes through the activation).
  m.fc1_weight().requires_grad = m.fc2_weight().requires_grad = false;
  f = m.forward(b.x, b.routing.layout);
  EXPECT_FALSE(f.ctx.saves_input());
  EXPECT_TRUE(f.ctx.saves_fc1_out());
  r = m.backward(f.ctx, b.dy);
  EXPECT_TRUE(r.dx.defined());
  EXPECT_EQ(r.fc1_weight.kind, GradKind::kNone);
  EXPECT_EQ(r.fc2_weight.kind, GradKind::kNone);
  // Neither (and no probs): nothing kept, nothing computed.
  f = m.forward(b.x, b.routing.layout, {}, false);
  EXPECT_FALSE(f.ctx.saves_input());
  EXPECT_FALSE(f.ctx.saves_fc1_out());
  EXPECT_FALSE(f.ctx.computes_dgrad());
  r = m.backward(f.ctx, b.dy);
  EXPECT_FALSE(r.dx.defined());
  EXPECT_MOE_ERROR(m.backward(f.ctx, b.dy), ErrorCode::kInvalidArgument, "already used");
}

// The rows of docs/design.md section 6 (tests/data/grad_contract.json), for both weights at once
// and both layouts.

class MlpGradientContract : public ::testing::TestWithParam<std::tuple<Row, ExpertLayout>> {};

TEST_P(MlpGradientContract, Row) {
  const auto& [row, layout] = GetParam();
  Rng rng;
  Batch b(rng);
  GroupedMLPOptions o = options(layout);
  apply_row(o, row);
  GroupedMLP m(kG, kH, kF, o);
  std::optional<MainGrads> mg;
  if (row.main_grad) mg.emplace(m);
  if (row.flag) m.fc1_weight().grad_added_to_main_grad = m.fc2_weight().grad_added_to_main_grad = false;
  int hook_calls = 0;
  m.register_wgrad_hook([&] { ++hook_calls; });

  MlpForwardResult f = m.forward(b.x, b.routing.layout, b.probs);
  MlpBackwardResult r = m.backward(f.ctx, b.dy);
  EXPECT_EQ(r.fc1_bias.kind, GradKind::kGrad) << "bias gradients are never delayed";
  expect_contract_steps(m, {{&r.fc1_weight, &m.fc1_weight()}, {&r.fc2_weight, &m.fc2_weight()}}, row, hook_calls);
  // Where the gradients ended up, bit for bit.
  const Reference exact32 = reference(m, b, DType::kFloat32);
  if (row.main_grad) {
    EXPECT_TRUE(bitwise_equal(mg->fc1, exact32.dw1)) << "fc1 main_grad";
    EXPECT_TRUE(bitwise_equal(mg->fc2, exact32.dw2)) << "fc2 main_grad";
  } else if (row.delay) {
    EXPECT_TRUE(bitwise_equal(packed_of(m.fc1_weight().grad().view()), exact32.dw1)) << "fc1 .grad";
    EXPECT_TRUE(bitwise_equal(packed_of(m.fc2_weight().grad().view()), exact32.dw2)) << "fc2 .grad";
  } else {
    const Reference exact = reference(m, b, DType::kBFloat16);
    EXPECT_TRUE(bitwise_equal(packed_of(r.fc1_weight.grad.view()), exact.dw1));
    EXPECT_TRUE(bitwise_equal(packed_of(r.fc2_weight.grad.view()), exact.dw2));
  }
  if (row.backward_kind == GradKind::kDummy) {
    EXPECT_TRUE(bitwise_equal(packed_of(r.fc1_weight.grad.view()), Tensor::zeros({kG, 2 * kF, kH}, DType::kBFloat16)));
    EXPECT_NE(r.fc1_weight.grad.view().expert(0).data(), r.fc2_weight.grad.view().expert(0).data())
        << "each weight has its own dummy";
  }
}

INSTANTIATE_TEST_SUITE_P(TableRows, MlpGradientContract, all_rows_and_layouts(), row_and_layout_name);

TEST(GroupedMlpModule, DelayedEqualsImmediateTwiceIsDoubleOverwriteReplacesHooksOnce) {
  Rng rng;
  Batch b(rng);
  GroupedMLPOptions o = options();
  o.accumulate_into_main_grad = true;
  GroupedMLP now(kG, kH, kF, o);
  o.delay_wgrad_compute = true;
  GroupedMLP later(kG, kH, kF, o);
  MainGrads mg_now(now), mg_later(later);
  int hooks = 0;
  later.register_wgrad_hook([&] { ++hooks; });
  later.backward_dw();  // nothing queued: no-op, no hook
  EXPECT_EQ(hooks, 0);
  for (int step = 0; step < 2; ++step) {
    MlpForwardResult f = now.forward(b.x, b.routing.layout, b.probs);
    now.backward(f.ctx, b.dy);
    MlpForwardResult g = later.forward(b.x, b.routing.layout, b.probs);
    later.backward(g.ctx, b.dy);
  }
  EXPECT_EQ(later.queued_wgrads(), 2u);
  EXPECT_TRUE(bitwise_equal(mg_later.fc1, Tensor::zeros({kG, 2 * kF, kH}, DType::kFloat32)));
  later.backward_dw();
  EXPECT_EQ(hooks, 1);
  EXPECT_TRUE(bitwise_equal(mg_later.fc1, mg_now.fc1)) << "delayed != immediate";
  EXPECT_TRUE(bitwise_equal(mg_later.fc2, mg_now.fc2)) << "delayed != immediate";
  const Reference once = reference(now, b, DType::kFloat32);
  Tensor twice = Tensor::zeros(once.dw2.shape(), DType::kFloat32);
  for (int64_t i = 0; i < twice.numel(); ++i) twice.data_as<float>()[i] = 2 * once.dw2.data_as<float>()[i];
  EXPECT_TRUE(bitwise_equal(mg_now.fc2, twice)) << "accumulating twice is not 2x";

  o.delay_wgrad_compute = false;
  o.overwrite_main_grad = true;
  GroupedMLP over(kG, kH, kF, o);
  MainGrads mg_over(over);
  fill_uniform(mg_over.fc1, 3, -1, 1);
  for (int step = 0; step < 2; ++step) {
    MlpForwardResult f = over.forward(b.x, b.routing.layout, b.probs);
    over.backward(f.ctx, b.dy);
  }
  EXPECT_TRUE(bitwise_equal(mg_over.fc1, once.dw1)) << "overwrite";
}

TEST(GroupedMlpModule, MissingMainGradIsAClearError) {
  Rng rng;
  Batch b(rng);
  GroupedMLPOptions o = options();
  o.accumulate_into_main_grad = true;
  GroupedMLP m(kG, kH, kF, o);
  MlpForwardResult f = m.forward(b.x, b.routing.layout, b.probs);
  EXPECT_MOE_ERROR(m.backward(f.ctx, b.dy), ErrorCode::kInvalidArgument, "no main_grad");
  o.overwrite_main_grad = true;
  o.accumulate_into_main_grad = false;
  EXPECT_MOE_ERROR((GroupedMLP(kG, kH, kF, o)), ErrorCode::kInvalidArgument, "overwrite_main_grad needs");
  o = options();
  o.glu.layout = GluLayout::blocks(3);
  EXPECT_MOE_ERROR((GroupedMLP(kG, kH, kF, o)), ErrorCode::kShape, "divisible by 3");
}

TEST(GroupedMlpModule, StateDictRoundTripsAcrossExpertAndGluLayouts) {
  Rng rng;
  Batch b(rng);
  GroupedMLPOptions ho = options();
  ho.glu.layout = GluLayout::halves();
  GroupedMLP halves_packed(kG, kH, kF, ho);
  const std::map<std::string, Tensor> sd = halves_packed.state_dict("mlp.");
  EXPECT_EQ(sd.size(), 4u);
  EXPECT_TRUE(sd.count("mlp.fc1.weight") && sd.count("mlp.fc2.bias"));

  // Into a per-expert module with pairs: the keys split, the FC1 rows move, the outputs agree.
  GroupedMLPOptions po = options(ExpertLayout::kPerExpert);
  po.seed = 99;
  GroupedMLP pairs_per(kG, kH, kF, po);
  pairs_per.load_state_dict(sd, "mlp.", GluLayout::halves());
  const Tensor y_halves = halves_packed.forward(b.x, b.routing.layout, b.probs, false).y;
  const Tensor y_pairs = pairs_per.forward(b.x, b.routing.layout, b.probs, false).y;
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(y_pairs), oracle::to_matrix(y_halves)), 1e-6);
  const Tensor w_pairs = packed_of(pairs_per.fc1_weight().value());
  const Tensor w_halves = halves_packed.fc1_weight().storage().packed();
  for (int64_t j = 0; j < kF; ++j) {  // gate j: halves row j -> pairs row 2j; linear j: F + j -> 2j + 1
    EXPECT_TRUE(bitwise_equal(w_pairs.view().select(3).select(2 * j), w_halves.view().select(3).select(j)));
    EXPECT_TRUE(bitwise_equal(w_pairs.view().select(3).select(2 * j + 1), w_halves.view().select(3).select(kF + j)));
  }
  EXPECT_TRUE(bitwise_equal(halves_packed.fc1_weight().storage().packed(), w_halves)) << "the source was modified";

  // And back, without a GLU change: bit-identical parameters.
  GroupedMLP again(kG, kH, kF, options());
  again.load_state_dict(pairs_per.state_dict());
  EXPECT_TRUE(bitwise_equal(again.fc1_weight().value(), pairs_per.fc1_weight().value()));
  EXPECT_TRUE(bitwise_equal(again.fc2_bias().value(), pairs_per.fc2_bias().value()));

  std::map<std::string, Tensor> missing = sd;
  missing.erase("mlp.fc2.bias");
  EXPECT_MOE_ERROR(halves_packed.load_state_dict(missing, "mlp."), ErrorCode::kInvalidArgument, "missing key");
  std::map<std::string, Tensor> extra = sd;
  extra["mlp.router.weight"] = Tensor::zeros({2}, DType::kFloat32);
  EXPECT_MOE_ERROR(halves_packed.load_state_dict(extra, "mlp."), ErrorCode::kInvalidArgument, "unexpected keys");
}

}  // namespace
}  // namespace moe::test
