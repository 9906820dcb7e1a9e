// GroupedLinear module: the gradient contract of docs/design.md section 6 (every row), delayed
// wgrad, main_grad accumulate / overwrite, hooks, what forward keeps, layouts, checkpoints (CPU
// backend).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "moe_engine/modules.hpp"
#include "grad_contract_rows.hpp"
#include "test_support.hpp"

namespace moe::test {
namespace {

constexpr int64_t kG = 5, kIn = 24, kOut = 40;

struct Batch {
  Routing routing{{7, 0, 1, 13, 9}, 36};  // empty and 1-row experts, 6 rows past the end
  Tensor x, dy, scales;
  explicit Batch(Rng& rng, DType dt = DType::kBFloat16)
      : x(random_tensor({36, kIn}, dt, rng)),
        dy(random_tensor({36, kOut}, dt, rng)),
        scales(uniform_tensor({36}, DType::kFloat32, rng, 0, 1)) {}
};

GroupedLinearOptions options(ExpertLayout layout = ExpertLayout::kPacked) {
  GroupedLinearOptions o;
  o.layout = layout;
  o.seed = 42;
  return o;
}

// A float32 main_grad for `p`, packed, zero (or `start`).
struct MainGrad {
  Tensor buffer;
  explicit MainGrad(const Parameter& p) {
    Shape s{p.num_groups()};
    for (int64_t d : p.expert_shape()) s.push_back(d);
    buffer = Tensor::zeros(s, DType::kFloat32);
  }
  GroupedParam param() const { return GroupedParam::packed(buffer); }
};

// The weight gradient the ops give for this batch, written as `dtype`.
Tensor reference_wgrad(const Batch& b, DType dtype) {
  Tensor dw = Tensor::zeros({kG, kOut, kIn}, dtype);
  grouped_linear_wgrad(b.dy, b.x, b.routing.layout, GroupedParam::packed(dw), GradMode::kWrite);
  return dw;
}

// 2 * t, exactly (float32).
Tensor doubled(const Tensor& t) {
  Tensor out = Tensor::zeros(t.shape(), DType::kFloat32);
  for (int64_t i = 0; i < t.numel(); ++i) out.data_as<float>()[i] = 2 * t.data_as<float>()[i];
  return out;
}

bool param_equals(const GroupedParam& a, const TensorView& packed) {
  return bitwise_equal(a, GroupedParam::packed(packed));
}

TEST(GroupedLinearModule, ForwardBackwardEqualTheOpsAndLayoutsAreBitIdentical) {
  Rng rng;
  Batch b(rng);
  GroupedLinearOptions o = options();
  o.bias = true;
  o.scale_bias = true;
  GroupedLinear packed(kG, kIn, kOut, o);
  o.layout = ExpertLayout::kPerExpert;
  GroupedLinear per(kG, kIn, kOut, o);
  ASSERT_TRUE(bitwise_equal(packed.weight().value(), per.weight().value())) << "initialization differs by layout";
  ASSERT_TRUE(bitwise_equal(packed.bias().value(), per.bias().value()));

  LinearForwardResult fp = packed.forward(b.x, b.routing.layout, b.scales);
  LinearForwardResult fe = per.forward(b.x, b.routing.layout, b.scales);
  Tensor y = Tensor::zeros({36, kOut}, DType::kBFloat16);
  grouped_linear_forward(b.x, packed.weight().value(), b.routing.layout, y, {packed.bias().value(), b.scales});
  EXPECT_TRUE(bitwise_equal(fp.y, y));
  EXPECT_TRUE(bitwise_equal(fe.y, y));
  // Rows past the routing (30..35) are zeros: allocated zeroed, never written.
  const auto* bytes = static_cast<const uint8_t*>(fp.y.data()) + 30 * kOut * 2;
  EXPECT_EQ(std::count(bytes, bytes + 6 * kOut * 2, uint8_t(0)), 6 * kOut * 2);

  LinearBackwardResult bp = packed.backward(fp.ctx, b.dy);
  LinearBackwardResult be = per.backward(fe.ctx, b.dy);
  Tensor dx = Tensor::zeros({36, kIn}, DType::kBFloat16);
  grouped_linear_dgrad(b.dy, packed.weight().value(), b.routing.layout, dx);
  EXPECT_TRUE(bitwise_equal(bp.dx, dx));
  EXPECT_TRUE(bitwise_equal(be.dx, dx));
  EXPECT_EQ(bp.weight.kind, GradKind::kGrad);
  EXPECT_TRUE(param_equals(bp.weight.grad, reference_wgrad(b, DType::kBFloat16)));
  EXPECT_TRUE(bitwise_equal(bp.weight.grad.view(), be.weight.grad.view()));
  EXPECT_EQ(be.weight.grad.layout(), ExpertLayout::kPerExpert);
  EXPECT_EQ(bp.bias.kind, GradKind::kGrad);
  EXPECT_TRUE(bitwise_equal(bp.bias.grad.view(), be.bias.grad.view()));
  Tensor dscales = Tensor::zeros({36}, DType::kFloat32);
  grouped_linear_dscales(b.dy, packed.bias().value(), b.routing.layout, dscales);
  EXPECT_TRUE(bitwise_equal(bp.dscales, dscales));
  EXPECT_TRUE(bitwise_equal(be.dscales, dscales));
}

TEST(GroupedLinearModule, KeepsOnlyWhatBackwardNeeds) {
  Rng rng;
  Batch b(rng);
  GroupedLinear m(kG, kIn, kOut, options());
  // Input without grad, weight with: wgrad, no dgrad.
  LinearForwardResult f = m.forward(b.x, b.routing.layout, {}, /*input_requires_grad=*/false);
  EXPECT_TRUE(f.ctx.saves_input());
  LinearBackwardResult r = m.backward(f.ctx, b.dy);
  EXPECT_FALSE(r.dx.defined());
  EXPECT_EQ(r.weight.kind, GradKind::kGrad);
  // Frozen weight: x not kept, no wgrad, dgrad still.
  m.weight().requires_grad = false;
  f = m.forward(b.x, b.routing.layout);
  EXPECT_FALSE(f.ctx.saves_input());
  r = m.backward(f.ctx, b.dy);
  EXPECT_TRUE(r.dx.defined());
  EXPECT_EQ(r.weight.kind, GradKind::kNone);
  EXPECT_FALSE(r.weight.grad.defined());
  // Neither: nothing kept, nothing computed.
  f = m.forward(b.x, b.routing.layout, {}, false);
  EXPECT_FALSE(f.ctx.saves_input());
  EXPECT_FALSE(f.ctx.computes_dgrad());
  r = m.backward(f.ctx, b.dy);
  EXPECT_FALSE(r.dx.defined());
  EXPECT_EQ(r.weight.kind, GradKind::kNone);
  // A context serves one backward.
  EXPECT_MOE_ERROR(m.backward(f.ctx, b.dy), ErrorCode::kInvalidArgument, "already used");
}

// The rows of docs/design.md section 6 (tests/data/grad_contract.json), for both layouts.
class GradientContract : public ::testing::TestWithParam<std::tuple<Row, ExpertLayout>> {};

TEST_P(GradientContract, Row) {
  const auto& [row, layout] = GetParam();
  Rng rng;
  Batch b(rng);
  GroupedLinearOptions o = options(layout);
  apply_row(o, row);
  GroupedLinear m(kG, kIn, kOut, o);
  MainGrad mg(m.weight());
  if (row.main_grad) m.weight().set_main_grad(mg.param());
  if (row.flag) m.weight().grad_added_to_main_grad = false;
  int hook_calls = 0;
  m.register_wgrad_hook([&] { ++hook_calls; });

  LinearForwardResult f = m.forward(b.x, b.routing.layout);
  LinearBackwardResult r = m.backward(f.ctx, b.dy);
  EXPECT_TRUE(r.dx.defined());
  expect_contract_steps(m, {{&r.weight, &m.weight()}}, row, hook_calls);

  // Where the gradient ended up, bit for bit.
  const Tensor exact32 = reference_wgrad(b, DType::kFloat32);
  if (row.main_grad) {
    EXPECT_TRUE(bitwise_equal(mg.buffer, exact32)) << row.name << ": main_grad";
    EXPECT_FALSE(m.weight().grad().defined());
  } else if (row.delay) {
    EXPECT_TRUE(param_equals(m.weight().grad(), exact32)) << row.name << ": .grad after backward_dw";
  } else {
    EXPECT_TRUE(param_equals(r.weight.grad, reference_wgrad(b, DType::kBFloat16))) << row.name;
  }
  if (row.backward_kind == GradKind::kDummy)
    EXPECT_TRUE(param_equals(r.weight.grad, Tensor::zeros({kG, kOut, kIn}, DType::kBFloat16)));
}

INSTANTIATE_TEST_SUITE_P(TableRows, GradientContract, all_rows_and_layouts(), row_and_layout_name);

// The decision itself, row by row: what both the C++ modules and moe_engine.torch apply.
TEST(GradOutcome, EveryRowOfTheTable) {
  for (const Row& row : grad_contract_rows()) {
    const GradOutcome got = grad_outcome({row.main_grad, row.overwrite, row.zero_out, row.delay, row.flag});
    EXPECT_EQ(got.deferred, row.outcome.deferred) << row.name;
    EXPECT_EQ(got.target, row.outcome.target) << row.name << ": " << grad_target_name(got.target);
    EXPECT_EQ(got.mode, row.outcome.mode) << row.name << ": " << grad_mode_name(got.mode);
    EXPECT_EQ(got.handed_back, row.outcome.handed_back) << row.name << ": " << grad_kind_name(got.handed_back);
    EXPECT_EQ(got.zero_dummy, row.outcome.zero_dummy) << row.name;
    EXPECT_EQ(got.flag, row.outcome.flag) << row.name << ": " << flag_update_name(got.flag);
  }
}

TEST(GradOutcome, ModifiersMatterOnlyForMainGrad) {
  // overwrite / zero_out without main_grad (parameter attributes a framework may set anyway).
  const GradOutcome plain = grad_outcome({false, true, true, false, true});
  EXPECT_EQ(plain.target, GradTarget::kFresh);
  EXPECT_EQ(plain.mode, GradMode::kWrite);
  EXPECT_EQ(plain.handed_back, GradKind::kGrad);
  EXPECT_FALSE(plain.zero_dummy);
  EXPECT_EQ(plain.flag, FlagUpdate::kNever);
  // zero_out without the flag: there is no dummy to zero.
  EXPECT_FALSE(grad_outcome({true, false, true, false, false}).zero_dummy);
  // Overwrite is a mode of the delayed GEMM too.
  EXPECT_EQ(grad_outcome({true, true, false, true, true}).mode, GradMode::kOverwrite);
}

TEST(GroupedLinearModule, DelayedEqualsImmediateAccumulateTwiceIsDoubleOverwriteReplaces) {
  Rng rng;
  Batch b(rng);
  GroupedLinearOptions o = options();
  o.accumulate_into_main_grad = true;
  GroupedLinear now(kG, kIn, kOut, o);
  o.delay_wgrad_compute = true;
  GroupedLinear later(kG, kIn, kOut, o);
  MainGrad mg_now(now.weight()), mg_later(later.weight());
  now.weight().set_main_grad(mg_now.param());
  later.weight().set_main_grad(mg_later.param());
  int hooks = 0;
  later.register_wgrad_hook([&] { ++hooks; });

  later.backward_dw();  // nothing queued: a no-op, no hook
  EXPECT_EQ(hooks, 0);
  for (int step = 0; step < 2; ++step) {
    LinearForwardResult f = now.forward(b.x, b.routing.layout);
    now.backward(f.ctx, b.dy);
    LinearForwardResult g = later.forward(b.x, b.routing.layout);
    later.backward(g.ctx, b.dy);
  }
  EXPECT_EQ(later.queued_wgrads(), 2u) << "a second backward before backward_dw queues both";
  EXPECT_TRUE(bitwise_equal(mg_later.buffer, Tensor::zeros({kG, kOut, kIn}, DType::kFloat32)));
  later.backward_dw();
  EXPECT_EQ(hooks, 1);
  EXPECT_EQ(later.queued_wgrads(), 0u);
  EXPECT_TRUE(bitwise_equal(mg_later.buffer, mg_now.buffer)) << "delayed != immediate";
  const Tensor once = reference_wgrad(b, DType::kFloat32);
  EXPECT_TRUE(bitwise_equal(mg_now.buffer, doubled(once))) << "accumulating twice is not 2x";

  // Overwrite: main_grad = wgrad, whatever it held (empty experts: zeros).
  o.delay_wgrad_compute = false;
  o.overwrite_main_grad = true;
  GroupedLinear over(kG, kIn, kOut, o);
  MainGrad mg_over(over.weight());
  fill_uniform(mg_over.buffer, 7, -1, 1);
  over.weight().set_main_grad(mg_over.param());
  for (int step = 0; step < 2; ++step) {
    LinearForwardResult f = over.forward(b.x, b.routing.layout);
    over.backward(f.ctx, b.dy);
  }
  EXPECT_TRUE(bitwise_equal(mg_over.buffer, once));
}

TEST(GroupedLinearModule, DelayedWithoutMainGradSumsTheQueuedGradientsIntoGrad) {
  Rng rng;
  Batch b(rng);
  GroupedLinearOptions o = options(ExpertLayout::kPerExpert);
  o.delay_wgrad_compute = true;
  GroupedLinear m(kG, kIn, kOut, o);
  for (int step = 0; step < 2; ++step) {
    LinearForwardResult f = m.forward(b.x, b.routing.layout);
    EXPECT_EQ(m.backward(f.ctx, b.dy).weight.kind, GradKind::kNone);
  }
  m.backward_dw();
  const Tensor once = reference_wgrad(b, DType::kFloat32);
  EXPECT_EQ(m.weight().grad().layout(), ExpertLayout::kPerExpert);
  EXPECT_TRUE(param_equals(m.weight().grad(), doubled(once)));
  m.weight().zero_grad();
  EXPECT_FALSE(m.weight().grad().defined());
}

TEST(GroupedLinearModule, ZeroOutWgradZeroesTheSharedDummy) {
  Rng rng;
  Batch b(rng);
  GroupedLinearOptions o = options();
  o.accumulate_into_main_grad = true;
  o.zero_out_wgrad = true;
  GroupedLinear m(kG, kIn, kOut, o);
  MainGrad mg(m.weight());
  m.weight().set_main_grad(mg.param());
  m.weight().grad_added_to_main_grad = false;
  LinearForwardResult f = m.forward(b.x, b.routing.layout);
  LinearBackwardResult r1 = m.backward(f.ctx, b.dy);
  ASSERT_EQ(r1.weight.kind, GradKind::kDummy);
  fill_uniform(r1.weight.grad.packed(), 3, -1, 1);  // a framework scribbled on it
  f = m.forward(b.x, b.routing.layout);
  LinearBackwardResult r2 = m.backward(f.ctx, b.dy);
  EXPECT_EQ(r2.weight.grad.packed().data(), r1.weight.grad.packed().data()) << "the dummy is shared";
  EXPECT_TRUE(param_equals(r2.weight.grad, Tensor::zeros({kG, kOut, kIn}, DType::kBFloat16)));
}

TEST(GroupedLinearModule, BadMainGradAndMissingMainGradAreClearErrors) {
  GroupedLinearOptions o = options();
  o.accumulate_into_main_grad = true;
  GroupedLinear m(kG, kIn, kOut, o);
  Tensor wide = Tensor::zeros({kG, kOut, 2 * kIn}, DType::kFloat32);
  const TensorView strided(wide.data(), {kG, kOut, kIn}, {kOut * 2 * kIn, 2 * kIn, 1}, DType::kFloat32,
                           Device::cpu());
  EXPECT_MOE_ERROR(m.weight().set_main_grad(GroupedParam::packed(strided)), ErrorCode::kShape, "contiguous");
  Tensor small = Tensor::zeros({kG, kOut, kIn - 1}, DType::kFloat32);
  EXPECT_MOE_ERROR(m.weight().set_main_grad(GroupedParam::packed(small)), ErrorCode::kShape, "like the parameter");
  Tensor half = Tensor::zeros({kG, kOut, kIn}, DType::kBFloat16);
  EXPECT_MOE_ERROR(m.weight().set_main_grad(GroupedParam::packed(half)), ErrorCode::kDType, "float32");
  Rng rng;
  Batch b(rng);
  LinearForwardResult f = m.forward(b.x, b.routing.layout);
  EXPECT_MOE_ERROR(m.backward(f.ctx, b.dy), ErrorCode::kInvalidArgument, "no main_grad");
  EXPECT_MOE_ERROR(GroupedLinear(kG, kIn, kOut, [] {
                     GroupedLinearOptions bad;
                     bad.scale_bias = true;
                     return bad;
                   }()),
                   ErrorCode::kInvalidArgument, "scale_bias needs bias");
  EXPECT_MOE_ERROR(m.forward(b.dy, b.routing.layout), ErrorCode::kShape, "expected x");
  // main_grad is added into: the weight's own memory cannot be it.
  GroupedLinearOptions f32 = options();
  f32.dtype = DType::kFloat32;
  GroupedLinear m32(kG, kIn, kOut, f32);
  EXPECT_MOE_ERROR(m32.weight().set_main_grad(m32.weight().value()), ErrorCode::kInvalidArgument,
                   "set_main_grad: main_grad's expert 0 overlaps the parameter's values");
}

// A context belongs to the module whose forward made it: another module's backward refuses it
// (it would compute that module's gradient from the other's input); a moved module keeps its own.
TEST(GroupedLinearModule, BackwardRefusesAnotherModulesContext) {
  Rng rng;
  Batch b(rng);
  GroupedLinear first(kG, kIn, kOut, options()), second(kG, kIn, kOut, options());
  LinearForwardResult f = first.forward(b.x, b.routing.layout);
  EXPECT_MOE_ERROR(second.backward(f.ctx, b.dy), ErrorCode::kInvalidArgument,
                   "GroupedLinear.backward: the context comes from another module's forward");
  GroupedLinear copy = first;
  EXPECT_MOE_ERROR(copy.backward(f.ctx, b.dy), ErrorCode::kInvalidArgument, "another module's forward");
  GroupedLinear moved = std::move(first);
  EXPECT_NO_THROW(moved.backward(f.ctx, b.dy));
}

TEST(GroupedLinearModule, StateDictRoundTripsAcrossLayouts) {
  GroupedLinearOptions o = options();
  o.bias = true;
  GroupedLinear packed(kG, kIn, kOut, o);
  std::map<std::string, Tensor> sd = packed.state_dict("experts.fc1.");
  ASSERT_EQ(sd.size(), 2u);
  EXPECT_EQ(sd.at("experts.fc1.weight").shape(), Shape({kG, kOut, kIn}));
  EXPECT_EQ(sd.at("experts.fc1.bias").shape(), Shape({kG, kOut}));

  // Packed -> per-expert module: split.
  o.layout = ExpertLayout::kPerExpert;
  o.seed = 1;
  GroupedLinear per(kG, kIn, kOut, o);
  per.load_state_dict(sd, "experts.fc1.");
  EXPECT_TRUE(bitwise_equal(per.weight().value(), packed.weight().value()));
  EXPECT_TRUE(bitwise_equal(per.bias().value(), packed.bias().value()));
  std::map<std::string, Tensor> per_sd = per.state_dict("experts.fc1.");
  EXPECT_EQ(per_sd.size(), size_t(2 * kG));
  EXPECT_EQ(per_sd.at("experts.fc1.weight4").shape(), Shape({kOut, kIn}));

  // Per-expert -> packed module: stack; and TransformerEngine's flattened [G*N, K] loads too.
  o.layout = ExpertLayout::kPacked;
  o.seed = 2;
  GroupedLinear back(kG, kIn, kOut, o);
  back.load_state_dict(per_sd, "experts.fc1.");
  EXPECT_TRUE(bitwise_equal(back.weight().value(), packed.weight().value()));
  GroupedLinear flat(kG, kIn, kOut, o);
  std::map<std::string, Tensor> flat_sd{{"weight", Tensor::empty({kG * kOut, kIn}, DType::kBFloat16)},
                                        {"bias", Tensor::empty({kG * kOut}, DType::kBFloat16)}};
  std::memcpy(flat_sd["weight"].data(), sd.at("experts.fc1.weight").data(), flat_sd["weight"].nbytes());
  std::memcpy(flat_sd["bias"].data(), sd.at("experts.fc1.bias").data(), flat_sd["bias"].nbytes());
  flat.load_state_dict(flat_sd);
  EXPECT_TRUE(bitwise_equal(flat.weight().value(), packed.weight().value()));
  EXPECT_TRUE(bitwise_equal(flat.bias().value(), packed.bias().value()));
}

TEST(GroupedLinearModule, LoadStateDictErrors) {
  GroupedLinear m(kG, kIn, kOut, options());
  std::map<std::string, Tensor> sd = m.state_dict();
  sd["weight_extra"] = Tensor::zeros({1}, DType::kFloat32);
  EXPECT_MOE_ERROR(m.load_state_dict(sd), ErrorCode::kInvalidArgument, "unexpected keys 'weight_extra'");
  EXPECT_MOE_ERROR(m.load_state_dict({}), ErrorCode::kInvalidArgument, "missing key 'weight'");
  EXPECT_MOE_ERROR(m.load_state_dict({{"weight", Tensor::zeros({kG, kOut, kIn}, DType::kFloat32)}}),
                   ErrorCode::kDType, "expected bfloat16");
  // A mix (packed key and some indexed keys) is left alone: the packed key loads, the rest is unexpected.
  std::map<std::string, Tensor> mix = m.state_dict();
  mix["weight0"] = Tensor::zeros({kOut, kIn}, DType::kBFloat16);
  EXPECT_MOE_ERROR(m.load_state_dict(mix), ErrorCode::kInvalidArgument, "unexpected keys 'weight0'");
  // Per-expert keys for some experts only: the missing experts are named.
  GroupedLinearOptions per_expert = options();
  per_expert.layout = ExpertLayout::kPerExpert;
  std::map<std::string, Tensor> partial = GroupedLinear(kG, kIn, kOut, per_expert).state_dict();
  partial.erase("weight1");
  EXPECT_MOE_ERROR(m.load_state_dict(partial), ErrorCode::kInvalidArgument,
                   "the checkpoint holds per-expert tensors 'weight0'.. for " + std::to_string(kG - 1) + " of " +
                       std::to_string(kG) + " experts; missing: 'weight1'");
}

TEST(NormalizeGroupedKeys, StacksSplitsAndLeavesMixesAlone) {
  auto filled = [](Shape s, float start) {
    Tensor t = Tensor::empty(s, DType::kFloat32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = start + float(i);
    return t;
  };
  std::map<std::string, Tensor> sd{{"w0", filled({2, 3}, 0)}, {"w1", filled({2, 3}, 6)}, {"w2", filled({2, 3}, 12)}};
  normalize_grouped_keys(sd, "w", 3, ExpertLayout::kPacked);
  ASSERT_EQ(sd.size(), 1u);
  EXPECT_TRUE(bitwise_equal(sd.at("w"), filled({3, 2, 3}, 0)));
  normalize_grouped_keys(sd, "w", 3, ExpertLayout::kPerExpert);
  ASSERT_EQ(sd.size(), 3u);
  EXPECT_TRUE(bitwise_equal(sd.at("w1"), filled({2, 3}, 6)));
  // [G*N, K] splits into G chunks of [N, K].
  std::map<std::string, Tensor> flat{{"w", filled({6, 3}, 0)}};
  normalize_grouped_keys(flat, "w", 3, ExpertLayout::kPerExpert);
  EXPECT_TRUE(bitwise_equal(flat.at("w2"), filled({2, 3}, 12)));
  // Not divisible: an error. Incomplete groups and mixes: untouched.
  std::map<std::string, Tensor> odd{{"w", filled({7, 3}, 0)}};
  EXPECT_MOE_ERROR(normalize_grouped_keys(odd, "w", 3, ExpertLayout::kPerExpert), ErrorCode::kShape,
                   "does not split into 3 experts");
  std::map<std::string, Tensor> partial{{"w0", filled({2, 3}, 0)}, {"w2", filled({2, 3}, 0)}};
  normalize_grouped_keys(partial, "w", 3, ExpertLayout::kPacked);
  EXPECT_EQ(partial.size(), 2u);
  std::map<std::string, Tensor> mix{{"w", filled({3, 2, 3}, 0)}, {"w0", filled({2, 3}, 0)}};
  normalize_grouped_keys(mix, "w", 3, ExpertLayout::kPerExpert);
  normalize_grouped_keys(mix, "w", 3, ExpertLayout::kPacked);
  EXPECT_EQ(mix.size(), 2u);
  std::map<std::string, Tensor> bad{{"w0", filled({2, 3}, 0)}, {"w1", filled({3, 2}, 0)}, {"w2", filled({2, 3}, 0)}};
  EXPECT_MOE_ERROR(normalize_grouped_keys(bad, "w", 3, ExpertLayout::kPacked), ErrorCode::kShape, "'w1'");
}

// The decision alone, on shapes and dtype names (what moe_engine.torch applies to torch tensors).
TEST(PlanGroupedKeys, DecidesFromTheKeysAndShapes) {
  using Action = GroupedKeyPlan::Action;
  const std::map<std::string, CheckpointEntry> per_expert{
      {"w0", {{2, 3}, "float32"}}, {"w1", {{2, 3}, "float32"}}, {"w2", {{2, 3}, "float32"}}};
  GroupedKeyPlan p = plan_grouped_keys(per_expert, "w", 3, ExpertLayout::kPacked);
  EXPECT_EQ(p.action, Action::kStack);
  EXPECT_EQ(p.shape, (Shape{3, 2, 3}));
  EXPECT_EQ(plan_grouped_keys(per_expert, "w", 3, ExpertLayout::kPerExpert).action, Action::kKeep);

  const std::map<std::string, CheckpointEntry> flat{{"w", {{6, 3}, "bfloat16"}}};
  p = plan_grouped_keys(flat, "w", 3, ExpertLayout::kPerExpert);
  EXPECT_EQ(p.action, Action::kSplit);
  EXPECT_EQ(p.shape, (Shape{2, 3}));
  p = plan_grouped_keys({{"w", {{3, 2, 3}, "bfloat16"}}}, "w", 3, ExpertLayout::kPerExpert);
  EXPECT_EQ(p.action, Action::kSplit);
  EXPECT_EQ(p.shape, (Shape{2, 3}));
  // TransformerEngine's [G*N, K] into a packed module of [G, N, K]: only with the module's expert shape.
  EXPECT_EQ(plan_grouped_keys(flat, "w", 3, ExpertLayout::kPacked).action, Action::kKeep);
  p = plan_grouped_keys(flat, "w", 3, ExpertLayout::kPacked, Shape{2, 3});
  EXPECT_EQ(p.action, Action::kReshape);
  EXPECT_EQ(p.shape, (Shape{3, 2, 3}));
  EXPECT_EQ(plan_grouped_keys(flat, "w", 3, ExpertLayout::kPacked, Shape{3, 3}).action, Action::kKeep);
  EXPECT_EQ(plan_grouped_keys({{"w", {{3, 2, 3}, "bfloat16"}}}, "w", 3, ExpertLayout::kPacked, Shape{2, 3}).action,
            Action::kKeep);

  // Some experts only: kept, and the absent ones named for a packed module.
  p = plan_grouped_keys({{"w0", {{2}, "float32"}}, {"w2", {{2}, "float32"}}}, "w", 3, ExpertLayout::kPacked);
  EXPECT_EQ(p.action, Action::kKeep);
  EXPECT_EQ(p.missing, std::vector<std::string>{"w1"});
  EXPECT_TRUE(plan_grouped_keys({{"w0", {{2}, "float32"}}}, "w", 3, ExpertLayout::kPerExpert).missing.empty());

  // Errors are data: each loader raises them its own way.
  p = plan_grouped_keys({{"w", {{7, 3}, "float32"}}}, "w", 3, ExpertLayout::kPerExpert);
  EXPECT_EQ(p.action, Action::kKeep);
  EXPECT_NE(p.error.find("cannot split checkpoint key 'w' [7, 3] float32"), std::string::npos) << p.error;
  p = plan_grouped_keys({{"w", {{}, "float32"}}}, "w", 3, ExpertLayout::kPerExpert);
  EXPECT_NE(p.error.find("does not split into 3 experts"), std::string::npos) << p.error;
  p = plan_grouped_keys({{"w0", {{2}, "float32"}}, {"w1", {{2}, "float16"}}, {"w2", {{2}, "float32"}}}, "w", 3,
                        ExpertLayout::kPacked);
  EXPECT_NE(p.error.find("checkpoint key 'w1' is [2] float16, but 'w0' is [2] float32"), std::string::npos) << p.error;
  EXPECT_MOE_ERROR(plan_grouped_keys({}, "w", 0, ExpertLayout::kPacked), ErrorCode::kInvalidArgument, "G >= 1");
}

}  // namespace
}  // namespace moe::test
