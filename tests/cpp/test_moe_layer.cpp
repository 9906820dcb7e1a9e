// The MoE layer (CPU backend): forward, dx, the router weight's and the experts' gradients and the
// losses' gradients against a float64 reference built from the oracle's router, permute and MLP,
// on odd shapes (k = 1 and k > 1, E = 1, sigmoid with an expert bias and groups, capacity drops, an
// expert with no tokens) in float32 and bfloat16, with FP8 experts within FP8's error; finite
// differences of a float64 layer; the router weight's gradient contract; the expert-bias update;
// state dicts; run-to-run bits; and the validation errors.
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <tuple>

#include "moe_layer_support.hpp"

namespace moe::test {
namespace {

std::vector<int64_t> int64s(const Tensor& t) {
  const Tensor h = host_copy(t);
  return std::vector<int64_t>(h.data_as<int64_t>(), h.data_as<int64_t>() + h.numel());
}

class MoELayerVsOracle : public ::testing::TestWithParam<std::tuple<LayerCase, DType>> {};

TEST_P(MoELayerVsOracle, ForwardAndEveryGradient) {
  const auto& [c, dtype] = GetParam();
  Rng rng;
  MoELayer layer(c.E, c.H, c.F, layer_options(c, dtype));
  const LayerInputs in = layer_inputs(c, layer, dtype, rng);
  const LayerReference ref =
      layer_reference(c, layer_params(layer), oracle::to_matrix(in.x), oracle::to_matrix(in.dy), in.d_loss);
  ASSERT_GE(ref.min_margin, 1e-4) << "inputs near a routing tie";
  if (c.empty_expert >= 0) ASSERT_EQ(ref.counts[size_t(c.empty_expert)], 0);
  if (c.capacity_factor) {
    int64_t dropped = 0;
    for (int64_t d : ref.dropped) dropped += d;
    ASSERT_GT(dropped, 0) << "the capacity case must drop";
  }

  MoELayerForwardResult f = layer.forward(in.x);
  // The routing decisions are exact.
  EXPECT_EQ(int64s(f.counts), ref.counts);
  EXPECT_EQ(int64s(f.splits), ref.splits);
  if (c.capacity_factor) EXPECT_EQ(int64s(f.dropped), ref.dropped);
  EXPECT_FALSE(f.dropped.defined() && !c.capacity_factor);
  EXPECT_EQ(int64s(layer.tokens_per_expert()), ref.counts);
  const double tol = dtype == DType::kFloat32 ? 1e-5 : 1e-2;  // measured: 3e-7 and 5e-3
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(f.y), ref.y), tol);
  EXPECT_NEAR(scalar_value(f.loss), ref.loss, 1e-5 * std::abs(ref.loss) + 1e-12);
  EXPECT_GT(f.ctx.saved_bytes(), 0);

  MoELayerBackwardResult b = layer.backward(f.ctx, in.dy, in.d_loss);
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(b.dx), ref.dx), tol);
  ASSERT_EQ(b.router_weight.kind, GradKind::kGrad);
  EXPECT_LE(oracle::rel_error(grad_matrices(b.router_weight)[0], ref.d_router_weight), tol);
  EXPECT_LE(oracle::rel_error(grad_matrices(b.fc1_weight), ref.dw1), tol);
  EXPECT_LE(oracle::rel_error(grad_matrices(b.fc2_weight), ref.dw2), tol);
  if (c.mlp_bias) {
    EXPECT_LE(oracle::rel_error(bias_rows(host_copy(b.fc1_bias.grad).view()), ref.db1), tol);
    EXPECT_LE(oracle::rel_error(bias_rows(host_copy(b.fc2_bias.grad).view()), ref.db2), tol);
  }
  EXPECT_MOE_ERROR(layer.backward(f.ctx, in.dy), ErrorCode::kInvalidArgument, "already used");
}

INSTANTIATE_TEST_SUITE_P(Cases, MoELayerVsOracle,
                         ::testing::Combine(::testing::ValuesIn(layer_cases()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" + dtype_name(std::get<1>(info.param));
                         });

// FP8 experts (options.experts.fp8: all six GEMMs in FP8): the routing exactly as without them (the
// router is not quantized), y and every gradient within FP8's error of the float64 layer
// (expect_fp8_layer_close), on the cases' fp8_shapes.
class MoELayerFp8VsOracle : public ::testing::TestWithParam<std::tuple<LayerCase, DType>> {};

TEST_P(MoELayerFp8VsOracle, ForwardAndEveryGradientWithinFp8Error) {
  const LayerCase c = fp8_shapes(std::get<0>(GetParam()));
  const DType dtype = std::get<1>(GetParam());
  Rng rng;
  MoELayer layer(c.E, c.H, c.F, fp8_layer_options(c, dtype));
  const LayerInputs in = layer_inputs(c, layer, dtype, rng);
  const LayerReference ref =
      layer_reference(c, layer_params(layer), oracle::to_matrix(in.x), oracle::to_matrix(in.dy), in.d_loss);
  ASSERT_GE(ref.min_margin, 1e-4) << "inputs near a routing tie";
  MoELayerForwardResult f = layer.forward(in.x);
  EXPECT_EQ(int64s(f.counts), ref.counts);
  EXPECT_EQ(int64s(f.splits), ref.splits);
  if (c.capacity_factor) EXPECT_EQ(int64s(f.dropped), ref.dropped);
  EXPECT_NEAR(scalar_value(f.loss), ref.loss, 1e-5 * std::abs(ref.loss) + 1e-12);
  const MoELayerBackwardResult b = layer.backward(f.ctx, in.dy, in.d_loss);
  expect_fp8_layer_close(f, b, ref, c.mlp_bias);
}

INSTANTIATE_TEST_SUITE_P(Cases, MoELayerFp8VsOracle,
                         ::testing::Combine(::testing::ValuesIn(layer_cases()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" + dtype_name(std::get<1>(info.param));
                         });

// The losses' gradient: with d_loss = 0 the router gets only the probs' gradient; the difference
// to a run with d_loss is the aux + z gradient alone, as the oracle's.
TEST(MoELayer, LossGradientIsTheAuxAndZGradient) {
  const LayerCase c = layer_cases()[3];  // sigmoid, bias, groups: both losses on
  Rng rng;
  MoELayer layer(c.E, c.H, c.F, layer_options(c, DType::kFloat32));
  const LayerInputs in = layer_inputs(c, layer, DType::kFloat32, rng);
  const LayerParams p = layer_params(layer);
  const oracle::Matrix x = oracle::to_matrix(in.x), dy = oracle::to_matrix(in.dy);
  const LayerReference with = layer_reference(c, p, x, dy, 2.0), without = layer_reference(c, p, x, dy, 0.0);
  oracle::Matrix want = with.d_router_weight;
  for (size_t i = 0; i < want.data.size(); ++i) want.data[i] -= without.d_router_weight.data[i];
  MoELayerForwardResult f1 = layer.forward(in.x);
  const MoELayerBackwardResult b1 = layer.backward(f1.ctx, in.dy, scalar_tensor(2.0, DType::kFloat32));
  MoELayerForwardResult f0 = layer.forward(in.x);
  const MoELayerBackwardResult b0 = layer.backward(f0.ctx, in.dy);  // no d_loss: none
  oracle::Matrix got = grad_matrices(b1.router_weight)[0];
  const oracle::Matrix g0 = grad_matrices(b0.router_weight)[0];
  for (size_t i = 0; i < got.data.size(); ++i) got.data[i] -= g0.data[i];
  EXPECT_LE(oracle::rel_error(got, want), 1e-3);
  EXPECT_LE(oracle::rel_error(grad_matrices(b0.router_weight)[0], without.d_router_weight), 3e-4);
}

// A float64 layer against central differences of L = <y, dy> + d_loss * loss in x and the router
// weight (the routing stays put: inputs are far from ties).
TEST(MoELayer, FiniteDifferencesInFloat64) {
  LayerCase c{"fd", 5, 6, 4, 4, layer_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.5f, 0.1f, 0.05f), std::nullopt};
  Rng rng;
  MoELayer layer(c.E, c.H, c.F, layer_options(c, DType::kFloat64));
  std::map<std::string, Tensor> sd = layer.state_dict();
  Tensor w = sd.at("router.weight");
  oracle::assign(w, oracle::to_matrix(random_tensor({c.E, c.H}, DType::kFloat64, rng, 0.7)).data);
  Tensor x = random_tensor({c.T, c.H}, DType::kFloat64, rng);
  const Tensor dy = random_tensor({c.T, c.H}, DType::kFloat64, rng);
  const double d_loss = 1.7;
  ASSERT_GE(layer_reference(c, layer_params(layer), oracle::to_matrix(x), oracle::to_matrix(dy), d_loss).min_margin,
            1e-3);
  auto objective = [&] {
    const MoELayerForwardResult f = layer.forward(x, false);
    double l = d_loss * scalar_value(f.loss);
    for (int64_t i = 0; i < dy.numel(); ++i) l += f.y.data_as<double>()[i] * dy.data_as<double>()[i];
    return l;
  };
  MoELayerForwardResult f = layer.forward(x);
  const MoELayerBackwardResult b = layer.backward(f.ctx, dy, d_loss);
  const double eps = 1e-6;
  auto central = [&](double* v) {
    const double keep = *v;
    *v = keep + eps;
    const double up = objective();
    *v = keep - eps;
    const double down = objective();
    *v = keep;
    return (up - down) / (2 * eps);
  };
  oracle::Vector fd_x, fd_w;
  for (int64_t i = 0; i < x.numel(); ++i) fd_x.push_back(central(x.data_as<double>() + i));
  for (int64_t i = 0; i < w.numel(); ++i) fd_w.push_back(central(w.data_as<double>() + i));
  EXPECT_LE(oracle::rel_error(oracle::to_vector(b.dx), fd_x), 1e-7);
  EXPECT_LE(oracle::rel_error(grad_matrices(b.router_weight)[0].data, fd_w), 1e-7);
}

MoELayerOptions float32_options(const LayerCase& c) { return layer_options(c, DType::kFloat32); }

// Two identical runs give identical bits; and without an input gradient the router weight's
// gradient is the same bits (its d_probs comes from the experts either way).
TEST(MoELayer, BitIdenticalRunToRunAndWithoutInputGradient) {
  const LayerCase c = layer_cases()[4];  // capacity drops
  Rng rng;
  MoELayer layer(c.E, c.H, c.F, layer_options(c, DType::kBFloat16));
  const LayerInputs in = layer_inputs(c, layer, DType::kBFloat16, rng);
  std::vector<Tensor> runs[2];
  for (auto& run : runs) {
    MoELayerForwardResult f = layer.forward(in.x);
    const MoELayerBackwardResult b = layer.backward(f.ctx, in.dy, in.d_loss);
    run = {f.y, f.loss, b.dx, b.router_weight.grad.packed(), b.fc1_weight.grad.packed(), b.fc2_weight.grad.packed()};
  }
  for (size_t i = 0; i < runs[0].size(); ++i) EXPECT_TRUE(bitwise_equal(runs[0][i], runs[1][i])) << i;
  MoELayerForwardResult f = layer.forward(in.x, /*input_requires_grad=*/false);
  const int64_t saved = f.ctx.saved_bytes();
  const MoELayerBackwardResult b = layer.backward(f.ctx, in.dy, in.d_loss);
  EXPECT_EQ(f.ctx.saved_bytes(), 0) << "backward releases what forward kept";
  EXPECT_FALSE(b.dx.defined());
  EXPECT_TRUE(bitwise_equal(b.router_weight.grad.packed(), runs[0][3]));
  EXPECT_TRUE(bitwise_equal(b.fc1_weight.grad.packed(), runs[0][4]));
  // Nothing wants a gradient from the router: it keeps nothing for it.
  layer.router_weight().requires_grad = false;
  MoELayerForwardResult g = layer.forward(in.x, false);
  EXPECT_LT(g.ctx.saved_bytes(), saved);
  const MoELayerBackwardResult gb = layer.backward(g.ctx, in.dy, in.d_loss);
  EXPECT_EQ(gb.router_weight.kind, GradKind::kNone);
  EXPECT_TRUE(bitwise_equal(gb.fc2_weight.grad.packed(), runs[0][5]));
}

// The router weight under the experts' main_grad options: accumulate adds each backward's
// gradient (the written gradient's bits, twice), overwrite replaces it; grad_added_to_main_grad
// gets the dummy and is set; a missing main_grad is a clear error.
TEST(MoELayer, RouterWeightMainGradContract) {
  const LayerCase c = layer_cases()[0];
  Rng rng;
  MoELayer plain(c.E, c.H, c.F, float32_options(c));
  const LayerInputs in = layer_inputs(c, plain, DType::kFloat32, rng);
  MoELayerForwardResult f = plain.forward(in.x);
  const Tensor want = plain.backward(f.ctx, in.dy, in.d_loss).router_weight.grad.packed();

  for (bool overwrite : {false, true}) {
    SCOPED_TRACE(overwrite ? "overwrite" : "accumulate");
    MoELayerOptions o = float32_options(c);
    o.experts.accumulate_into_main_grad = true;
    o.experts.overwrite_main_grad = overwrite;
    MoELayer layer(c.E, c.H, c.F, o);
    layer.load_state_dict(plain.state_dict());
    MoELayerForwardResult g = layer.forward(in.x);
    EXPECT_MOE_ERROR(layer.backward(g.ctx, in.dy, in.d_loss), ErrorCode::kInvalidArgument, "no main_grad");
    const Tensor router_mg = Tensor::zeros({1, c.E, c.H}, DType::kFloat32);
    const Tensor fc1_mg = Tensor::zeros({c.E, 2 * c.F, c.H}, DType::kFloat32);
    const Tensor fc2_mg = Tensor::zeros({c.E, c.H, c.F}, DType::kFloat32);
    layer.router_weight().set_main_grad(GroupedParam::packed(router_mg));
    layer.experts().fc1_weight().set_main_grad(GroupedParam::packed(fc1_mg));
    layer.experts().fc2_weight().set_main_grad(GroupedParam::packed(fc2_mg));
    for (int step = 0; step < 2; ++step) {
      MoELayerForwardResult h = layer.forward(in.x);
      const MoELayerBackwardResult b = layer.backward(h.ctx, in.dy, in.d_loss);
      EXPECT_EQ(b.router_weight.kind, GradKind::kNone);
    }
    const float* got = router_mg.data_as<float>();
    const float* one = want.data_as<float>();
    for (int64_t i = 0; i < router_mg.numel(); ++i)
      ASSERT_EQ(got[i], overwrite ? one[i] : one[i] + one[i]) << "element " << i;
    layer.router_weight().grad_added_to_main_grad = false;
    MoELayerForwardResult h = layer.forward(in.x);
    const MoELayerBackwardResult b = layer.backward(h.ctx, in.dy, in.d_loss);
    EXPECT_EQ(b.router_weight.kind, GradKind::kDummy);
    EXPECT_EQ(layer.router_weight().grad_added_to_main_grad, std::optional<bool>(true));
  }
}

// tokens_per_expert sums the router's counts over forwards; update_expert_bias moves each expert
// by rate * sign(mean - count) and starts the count again.
TEST(MoELayer, ExpertBiasUpdateFromAccumulatedCounts) {
  const LayerCase c = layer_cases()[3];
  Rng rng;
  MoELayer layer(c.E, c.H, c.F, float32_options(c));
  const LayerInputs in = layer_inputs(c, layer, DType::kFloat32, rng);
  const std::vector<float> before(layer.expert_bias().data_as<float>(), layer.expert_bias().data_as<float>() + c.E);
  std::vector<int64_t> total(size_t(c.E), 0);
  for (int i = 0; i < 3; ++i) {
    const MoELayerForwardResult f = layer.forward(in.x, false);
    const std::vector<int64_t> counts = int64s(f.counts);
    for (int64_t e = 0; e < c.E; ++e) total[size_t(e)] += counts[size_t(e)];
  }
  EXPECT_EQ(int64s(layer.tokens_per_expert()), total);
  int64_t sum = 0;
  for (int64_t v : total) sum += v;
  layer.update_expert_bias(0.01f);
  for (int64_t e = 0; e < c.E; ++e) {
    const int64_t sign = (sum > c.E * total[size_t(e)]) - (sum < c.E * total[size_t(e)]);
    EXPECT_EQ(layer.expert_bias().data_as<float>()[e], before[size_t(e)] + 0.01f * float(sign)) << e;
  }
  EXPECT_EQ(int64s(layer.tokens_per_expert()), std::vector<int64_t>(size_t(c.E), 0));
  MoELayer no_bias(c.E, c.H, c.F, float32_options(layer_cases()[0]));
  EXPECT_MOE_ERROR(no_bias.update_expert_bias(0.01f), ErrorCode::kInvalidArgument, "no expert bias");
  EXPECT_MOE_ERROR(no_bias.expert_bias(), ErrorCode::kInvalidArgument, "no expert bias");
}

// The keys, their shapes, and a round trip into a layer of another seed and expert layout: the
// same forward bits. Missing and unexpected keys are errors.
TEST(MoELayer, StateDictRoundTrip) {
  const LayerCase c = layer_cases()[3];
  Rng rng;
  MoELayer a(c.E, c.H, c.F, float32_options(c));
  const LayerInputs in = layer_inputs(c, a, DType::kFloat32, rng);
  const std::string prefix = "decoder.layers.3.mlp.";
  const std::map<std::string, Tensor> sd = a.state_dict(prefix);
  std::vector<std::string> keys;
  for (const auto& [key, t] : sd) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{prefix + "experts.fc1.bias", prefix + "experts.fc1.weight",
                                            prefix + "experts.fc2.bias", prefix + "experts.fc2.weight",
                                            prefix + "router.expert_bias", prefix + "router.weight"}));
  EXPECT_EQ(sd.at(prefix + "router.weight").shape(), (Shape{c.E, c.H}));
  EXPECT_EQ(sd.at(prefix + "router.expert_bias").dtype(), DType::kFloat32);

  MoELayerOptions o = float32_options(c);
  o.experts.seed = 99;
  o.experts.layout = ExpertLayout::kPerExpert;
  MoELayer b(c.E, c.H, c.F, o);
  b.load_state_dict(sd, prefix);
  const MoELayerForwardResult fa = a.forward(in.x, false), fb = b.forward(in.x, false);
  EXPECT_TRUE(bitwise_equal(fa.y, fb.y));
  EXPECT_TRUE(bitwise_equal(fa.loss, fb.loss));

  std::map<std::string, Tensor> missing = sd;
  missing.erase(prefix + "router.expert_bias");
  EXPECT_MOE_ERROR(b.load_state_dict(missing, prefix), ErrorCode::kInvalidArgument, "router.expert_bias");
  std::map<std::string, Tensor> extra = sd;
  extra[prefix + "router.score_bias"] = Tensor::zeros({c.E}, DType::kFloat32);
  EXPECT_MOE_ERROR(b.load_state_dict(extra, prefix), ErrorCode::kInvalidArgument, "unexpected keys");
  std::map<std::string, Tensor> wrong = sd;
  wrong[prefix + "router.weight"] = Tensor::zeros({c.E, c.H + 1}, DType::kFloat32);
  EXPECT_MOE_ERROR(b.load_state_dict(wrong, prefix), ErrorCode::kShape, "router.weight");
}

TEST(MoELayer, ValidationErrors) {
  const LayerCase c = layer_cases()[0];
  const MoELayerOptions o = float32_options(c);
  MoELayerOptions bad = o;
  bad.router.topk = 7;
  EXPECT_MOE_ERROR(MoELayer(c.E, c.H, c.F, bad), ErrorCode::kInvalidArgument, "MoELayer: options.router");
  bad = o;
  bad.router.num_groups = 4;  // does not divide E = 6
  EXPECT_MOE_ERROR(MoELayer(c.E, c.H, c.F, bad), ErrorCode::kInvalidArgument, "MoELayer: options.router");
  bad = o;
  bad.capacity_factor = 0.0;
  EXPECT_MOE_ERROR(MoELayer(c.E, c.H, c.F, bad), ErrorCode::kInvalidArgument, "capacity_factor");
  EXPECT_MOE_ERROR(MoELayer(0, c.H, c.F, o), ErrorCode::kInvalidArgument, "num_experts, hidden, ffn >= 1");

  MoELayer layer(c.E, c.H, c.F, o);
  Rng rng;
  EXPECT_MOE_ERROR(layer.forward(random_tensor({9, c.H + 1}, DType::kFloat32, rng)), ErrorCode::kShape,
                   "MoELayer.forward: x: expected [T, H] = [T, 24], got float32[9, 25]");
  EXPECT_MOE_ERROR(layer.forward(random_tensor({9, c.H}, DType::kBFloat16, rng)), ErrorCode::kDType,
                   "MoELayer.forward: x: expected float32 (MoELayerOptions::experts.dtype), got bfloat16");
  const Tensor x = random_tensor({9, c.H}, DType::kFloat32, rng);
  MoELayerForwardResult f = layer.forward(x);
  EXPECT_MOE_ERROR(layer.backward(f.ctx, random_tensor({8, c.H}, DType::kFloat32, rng)), ErrorCode::kShape,
                   "MoELayer.backward: dy: expected [T, H] = [9, 24]");
  EXPECT_MOE_ERROR(layer.backward(f.ctx, random_tensor({9, c.H}, DType::kFloat32, rng),
                                  scalar_tensor(1.0, DType::kFloat64)),
                   ErrorCode::kShape, "MoELayer.backward: d_loss: expected a 0-dim float32 tensor");
  EXPECT_NO_THROW(layer.backward(f.ctx, random_tensor({9, c.H}, DType::kFloat32, rng)));
  MoELayerOptions f64 = o;
  f64.experts.dtype = DType::kFloat64;
  f64.experts.device = Device::cuda(0);
  EXPECT_MOE_ERROR(MoELayer(c.E, c.H, c.F, f64), ErrorCode::kDType, "float64 runs on the CPU backend only");
}

// No tokens: an empty forward and backward, the losses 0, main_grad untouched.
TEST(MoELayer, NoTokens) {
  const LayerCase c = layer_cases()[4];
  MoELayer layer(c.E, c.H, c.F, float32_options(c));
  const Tensor x = Tensor::zeros({0, c.H}, DType::kFloat32);
  MoELayerForwardResult f = layer.forward(x);
  EXPECT_EQ(f.y.shape(), (Shape{0, c.H}));
  EXPECT_EQ(scalar_value(f.loss), 0.0);
  EXPECT_EQ(int64s(f.counts), std::vector<int64_t>(size_t(c.E), 0));
  const MoELayerBackwardResult b = layer.backward(f.ctx, x, 1.0);
  EXPECT_EQ(b.dx.shape(), (Shape{0, c.H}));
  const std::vector<oracle::Matrix> dw = grad_matrices(b.router_weight);
  for (double v : dw[0].data) EXPECT_EQ(v, 0.0);
}

}  // namespace
}  // namespace moe::test
