// The router on the CPU backend: against the float64 oracle (softmax and sigmoid scores, expert
// bias, group-limited routing, normalization and scaling, counts, both losses) in every dtype; ties
// to the lower index; the backward against finite differences in float64 and against the oracle;
// gradient modes; no tokens; the expert-bias update; the shared math (exp, the choice order); and
// every validation error.
#include <cmath>
#include <limits>

#include "common/router_math.hpp"
#include "router_support.hpp"

namespace moe::test {
namespace {

RouterSpec make_spec(RouterScore score, int64_t topk, int64_t groups, int64_t topk_groups,
                     bool norm, float scaling, float aux = 0.01f, float z = 0.001f) {
  RouterSpec s;
  s.score = score;
  s.topk = topk;
  s.num_groups = groups;
  s.topk_groups = topk_groups;
  s.norm_topk_prob = norm;
  s.scaling_factor = scaling;
  s.aux_loss_coeff = aux;
  s.z_loss_coeff = z;
  return s;
}

// Specs over E = 16 experts: plain, unnormalized, grouped, DeepSeek-V3-like (sigmoid, groups,
// norm, scaling), top-1, and a grouped one keeping most groups.
std::vector<RouterSpec> specs_for_16() {
  return {make_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f),
          make_spec(RouterScore::kSoftmax, 4, 1, 1, false, 1.f),
          make_spec(RouterScore::kSoftmax, 3, 4, 2, true, 2.5f),
          make_spec(RouterScore::kSigmoid, 4, 8, 4, true, 2.5f),
          make_spec(RouterScore::kSigmoid, 1, 1, 1, false, 1.f),
          make_spec(RouterScore::kSigmoid, 6, 4, 3, false, 0.5f)};
}

std::vector<int64_t> recount(const std::vector<int64_t>& indices, int64_t experts) {
  std::vector<int64_t> c(size_t(experts), 0);
  for (int64_t e : indices) ++c[size_t(e)];
  return c;
}

// The smallest margin a token may have for a float32 backend's choice to be compared exactly.
double margin_floor(DType acc) { return acc == DType::kFloat64 ? 1e-12 : 1e-5; }

class Router : public ::testing::TestWithParam<DType> {};

TEST_P(Router, ForwardMatchesTheOracle) {
  const DType dt = GetParam(), acc = router_acc(dt);
  Rng rng;
  const int64_t T = 37, H = 24, E = 16;
  const Tensor x = dyadic_tensor({T, H}, dt, rng, 0.25), w = dyadic_tensor({E, H}, dt, rng, 0.125);
  const Tensor bias = tier_bias(E, acc, rng);
  const double tol = acc == DType::kFloat64 ? 1e-12 : 2e-6,
               loss_tol = acc == DType::kFloat64 ? 1e-12 : 1e-5;
  for (const RouterSpec& spec : specs_for_16())
    for (bool with_bias : {false, true})
      for (DType index_dtype : {DType::kInt64, DType::kInt32}) {
        SCOPED_TRACE(describe(spec) + (with_bias ? ", bias" : "") + ", " + dtype_name(index_dtype));
        const RouterRun r = run_router_forward(x, w, with_bias ? TensorView(bias) : TensorView(),
                                               spec, index_dtype);
        const oracle::RouterForward ref =
            oracle::router_forward(oracle::to_matrix(x), oracle::to_matrix(w),
                                   with_bias ? oracle::to_vector(bias) : oracle::Vector{}, spec);
        EXPECT_TRUE(r.tails_untouched());
        EXPECT_EQ(oracle::to_matrix(r.logits.values()).data, ref.logits.data) << "logits are exact";
        // Tokens that came within rounding of a tie may be decided otherwise in float32.
        const oracle::Choices got = r.choices();
        int64_t close = 0;
        for (int64_t t = 0; t < T; ++t) {
          if (ref.margin[size_t(t)] < margin_floor(acc)) {
            ++close;
            continue;
          }
          EXPECT_EQ(got[size_t(t)], ref.indices[size_t(t)]) << "token " << t;
        }
        EXPECT_LE(close, T / 10) << "tokens within rounding of a tie";
        // The probabilities of the choices made, the counts of those choices.
        const oracle::Matrix probs_ref = oracle::router_probs(ref.logits, got, spec);
        EXPECT_LE(oracle::rel_error(oracle::to_matrix(r.probs.values()), probs_ref), tol);
        EXPECT_EQ(RouterRun::int64s(r.counts), recount(r.host_indices(), E));
        if (close == 0) {
          EXPECT_EQ(RouterRun::int64s(r.counts), ref.counts);
          EXPECT_EQ(RouterRun::int64s(r.aux_counts), ref.aux_counts);
          EXPECT_NEAR(scalar_value(r.aux_loss.view), ref.aux_loss, loss_tol * ref.aux_loss);
        }
        EXPECT_NEAR(scalar_value(r.z_loss.view), ref.z_loss, loss_tol * ref.z_loss);
      }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Router,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                           DType::kFloat64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// x = 0: every logit is 0, every expert and group ties; the lower indices win.
TEST(RouterTies, GoToTheLowerIndex) {
  const int64_t T = 3, H = 4, E = 8;
  const Tensor x = Tensor::zeros({T, H}, DType::kFloat32);
  Rng rng;
  const Tensor w = random_tensor({E, H}, DType::kFloat32, rng);
  for (const RouterSpec& spec : {make_spec(RouterScore::kSoftmax, 3, 1, 1, true, 1.f),
                                 make_spec(RouterScore::kSigmoid, 3, 4, 2, false, 1.f),
                                 make_spec(RouterScore::kSigmoid, 4, 4, 2, true, 1.f)}) {
    SCOPED_TRACE(describe(spec));
    const RouterRun r = run_router_forward(x, w, {}, spec);
    const std::vector<int64_t> idx = r.host_indices();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < spec.topk; ++j) EXPECT_EQ(idx[size_t(t * spec.topk + j)], j);
    const oracle::Matrix p = oracle::to_matrix(r.probs.values());
    const double each = spec.norm_topk_prob ? 1.0 / double(spec.topk)
                                            : (spec.score == RouterScore::kSoftmax ? 1.0 / E : 0.5);
    for (double v : p.data) EXPECT_NEAR(v, each, 1e-6);
  }
  // Equal logits away from zero: experts 5 and 2 share the best weight row, 2 comes first.
  Tensor w2 = Tensor::zeros({E, H}, DType::kFloat32);
  for (int64_t h = 0; h < H; ++h)
    w2.data_as<float>()[5 * H + h] = w2.data_as<float>()[2 * H + h] = 1.f;
  const Tensor ones = uniform_tensor({T, H}, DType::kFloat32, rng, 0.5, 1.0);
  const RouterRun r =
      run_router_forward(ones, w2, {}, make_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f));
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(r.host_indices()[size_t(2 * t)], 2);
    EXPECT_EQ(r.host_indices()[size_t(2 * t + 1)], 5);
  }
}

// The bias decides the choice but never enters the probabilities.
TEST(RouterExpertBias, ChoosesButNeverEntersTheProbabilities) {
  Rng rng;
  const int64_t T = 20, H = 16, E = 8;
  const Tensor x = random_tensor({T, H}, DType::kFloat32, rng),
               w = random_tensor({E, H}, DType::kFloat32, rng);
  Tensor bias = Tensor::zeros({E}, DType::kFloat32);
  bias.data_as<float>()[6] = 10.f;  // expert 6 always first
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    const RouterSpec spec = make_spec(score, 2, 1, 1, false, 1.f);
    const RouterRun biased = run_router_forward(x, w, bias, spec),
                    plain = run_router_forward(x, w, {}, spec);
    const oracle::Matrix logits = oracle::to_matrix(plain.logits.values());
    const oracle::Matrix p = oracle::to_matrix(biased.probs.values());
    const std::vector<int64_t> idx = biased.host_indices();
    const oracle::Matrix unbiased = oracle::router_probs(logits, biased.choices(), spec);
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(idx[size_t(2 * t)], 6);
      EXPECT_NEAR(p(t, 0), unbiased(t, 0), 1e-6)
          << "the probability is the expert's unbiased score";
    }
    EXPECT_EQ(oracle::to_matrix(biased.logits.values()).data, logits.data);
  }
}

// Group-limited routing (DeepSeek-V3): the best expert alone does not keep its group.
TEST(RouterGroups, KeepTheGroupsWithTheBestTwoScores) {
  const int64_t E = 8;
  // Logits as x with an identity weight. Sigmoid scores per group of 2: {0.88, 0.02}, {0.62, 0.62},
  // {0.56, 0.56}, {0.12, 0.12}: the groups score 0.90, 1.25, 1.12, 0.24, so groups 1 and 2 stay and
  // expert 0, the best alone, does not.
  Tensor x = Tensor::empty({1, E}, DType::kFloat32);
  oracle::assign(x, {2, -4, 0.5, 0.5, 0.25, 0.25, -2, -2});
  Tensor w = Tensor::zeros({E, E}, DType::kFloat32);
  for (int64_t e = 0; e < E; ++e) w.data_as<float>()[e * E + e] = 1.f;
  const RouterRun grouped =
      run_router_forward(x, w, {}, make_spec(RouterScore::kSigmoid, 3, 4, 2, true, 1.f));
  EXPECT_EQ(grouped.host_indices(), (std::vector<int64_t>{2, 3, 4}));  // 2 and 3 tie: 2 first
  const RouterRun plain =
      run_router_forward(x, w, {}, make_spec(RouterScore::kSigmoid, 3, 1, 1, true, 1.f));
  EXPECT_EQ(plain.host_indices(), (std::vector<int64_t>{0, 2, 3}));
  // One group per expert: group-limited routing keeps the topk_groups best experts.
  const RouterRun singles =
      run_router_forward(x, w, {}, make_spec(RouterScore::kSigmoid, 2, 8, 3, true, 1.f));
  EXPECT_EQ(singles.host_indices(), (std::vector<int64_t>{0, 2}));
}

// p = score / (sum of the k scores + 1e-20) * scaling, or score * scaling.
TEST(RouterProbs, NormalizationAndScaling) {
  Rng rng;
  const int64_t T = 9, H = 8, E = 12;
  const Tensor x = random_tensor({T, H}, DType::kFloat64, rng),
               w = random_tensor({E, H}, DType::kFloat64, rng);
  for (RouterScore score : {RouterScore::kSoftmax, RouterScore::kSigmoid}) {
    const RouterRun norm = run_router_forward(x, w, {}, make_spec(score, 3, 1, 1, true, 2.5f));
    const RouterRun raw = run_router_forward(x, w, {}, make_spec(score, 3, 1, 1, false, 1.f));
    EXPECT_EQ(norm.host_indices(), raw.host_indices());
    const oracle::Matrix pn = oracle::to_matrix(norm.probs.values()),
                         pr = oracle::to_matrix(raw.probs.values());
    for (int64_t t = 0; t < T; ++t) {
      const double sum = pr(t, 0) + pr(t, 1) + pr(t, 2);
      for (int64_t j = 0; j < 3; ++j) EXPECT_NEAR(pn(t, j), pr(t, j) / sum * 2.5, 1e-14);
      EXPECT_GE(pr(t, 0), pr(t, 1));
      EXPECT_GE(pr(t, 1), pr(t, 2));
    }
  }
}

// The loss L = <G, probs> + A aux + Z z for finite differences.
double loss_of(const RouterRun& r, const oracle::Matrix& g, double a, double z) {
  double l = a * scalar_value(r.aux_loss.view) + z * scalar_value(r.z_loss.view);
  const oracle::Matrix p = oracle::to_matrix(r.probs.values());
  for (size_t i = 0; i < p.data.size(); ++i) l += g.data[i] * p.data[i];
  return l;
}

// The whole backward in float64 against central differences of the forward's outputs, and against
// the oracle's Jacobians.
TEST(RouterBackward, MatchesFiniteDifferencesInFloat64) {
  Rng rng;
  const int64_t T = 6, H = 5, E = 8;
  for (const RouterSpec& spec :
       {make_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f, 0.1f, 0.01f),
        make_spec(RouterScore::kSoftmax, 3, 4, 2, false, 2.5f, 0.1f, 0.01f),
        make_spec(RouterScore::kSigmoid, 3, 4, 2, true, 2.5f, 0.1f, 0.01f),
        make_spec(RouterScore::kSigmoid, 1, 1, 1, false, 1.f, 0.1f, 0.01f)})
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(describe(spec) + (with_bias ? ", bias" : ""));
      Tensor x = random_tensor({T, H}, DType::kFloat64, rng),
             w = random_tensor({E, H}, DType::kFloat64, rng);
      const Tensor bias = random_tensor({E}, DType::kFloat64, rng, 0.3);
      const TensorView b = with_bias ? TensorView(bias) : TensorView();
      const Tensor g = random_tensor({T, spec.topk}, DType::kFloat64, rng);
      const double a = 0.7, z = 1.3;
      const RouterRun base = run_router_forward(x, w, b, spec);
      const RouterBackwardRun grads = run_router_backward(
          {g, scalar_tensor(a, DType::kFloat64), scalar_tensor(z, DType::kFloat64)}, x, w, base,
          spec, DType::kFloat64);
      // Central differences over every entry of x and of the weight; the choices must not move.
      const oracle::Matrix gm = oracle::to_matrix(g);
      auto differences = [&](Tensor& param) {
        oracle::Vector fd(size_t(param.numel()));
        double* v = param.data_as<double>();
        for (int64_t i = 0; i < param.numel(); ++i) {
          const double keep = v[i], h = 1e-6;
          v[i] = keep + h;
          const RouterRun up = run_router_forward(x, w, b, spec);
          v[i] = keep - h;
          const RouterRun down = run_router_forward(x, w, b, spec);
          v[i] = keep;
          EXPECT_EQ(up.host_indices(), base.host_indices());
          EXPECT_EQ(RouterRun::int64s(up.aux_counts), RouterRun::int64s(base.aux_counts));
          fd[size_t(i)] = (loss_of(up, gm, a, z) - loss_of(down, gm, a, z)) / (2 * h);
        }
        return fd;
      };
      const oracle::Vector fd_x = differences(x), fd_w = differences(w);
      EXPECT_LE(
          oracle::rel_error(oracle::to_vector(grads.dx.values().view().reshape({T * H})), fd_x),
          1e-7);
      EXPECT_LE(oracle::rel_error(oracle::to_vector(grads.dweight.values().view().reshape({E * H})),
                                  fd_w),
                1e-7);
      const oracle::RouterGrads ref =
          oracle::router_backward(oracle::to_matrix(x), oracle::to_matrix(w), base.choices(),
                                  RouterRun::int64s(base.aux_counts), gm, a, z, spec);
      EXPECT_LE(oracle::rel_error(oracle::to_matrix(grads.dx.values()), ref.dx), 1e-12);
      EXPECT_LE(oracle::rel_error(oracle::to_matrix(grads.dweight.values()), ref.dweight), 1e-12);
      EXPECT_TRUE(grads.dx.tail_untouched());
      EXPECT_TRUE(grads.dweight.tail_untouched());
    }
}

// 16-bit and float32 inputs against the oracle; each gradient of the outputs alone.
TEST(RouterBackward, MatchesTheOracleForEveryInputDtypeAndEachOutput) {
  Rng rng;
  const int64_t T = 40, H = 32, E = 16;
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
    for (const RouterSpec& spec : specs_for_16())
      for (int which = 0; which < 3; ++which) {  // d_probs, d_aux, d_z
        SCOPED_TRACE(std::string(dtype_name(dt)) + ", " + describe(spec) + ", output " +
                     std::to_string(which));
        const Tensor x = random_tensor({T, H}, dt, rng), w = random_tensor({E, H}, dt, rng, 0.3);
        const RouterRun f = run_router_forward(x, w, {}, spec);
        const Tensor g = random_tensor({T, spec.topk}, DType::kFloat32, rng);
        RouterOutputGrads d;
        if (which == 0) d.d_probs = g;
        // The losses' gradients are scaled up so that dx stays in float16's normal range.
        const double d_aux = 800, d_z = -150;
        const Tensor a = scalar_tensor(d_aux, DType::kFloat32),
                     z = scalar_tensor(d_z, DType::kFloat32);
        if (which == 1) d.d_aux_loss = a;
        if (which == 2) d.d_z_loss = z;
        const RouterBackwardRun r = run_router_backward(d, x, w, f, spec);
        const oracle::RouterGrads ref = oracle::router_backward(
            oracle::to_matrix(x), oracle::to_matrix(w), f.choices(),
            RouterRun::int64s(f.aux_counts), which == 0 ? oracle::to_matrix(g) : oracle::Matrix(),
            which == 1 ? d_aux : 0.0, which == 2 ? d_z : 0.0, spec);
        EXPECT_LE(oracle::rel_error(oracle::to_matrix(r.dx.values()), ref.dx),
                  std::max(tolerance(dt), 1e-5));
        EXPECT_LE(oracle::rel_error(oracle::to_matrix(r.dweight.values()), ref.dweight), 1e-5);
      }
}

// dweight in every gradient mode; with no tokens, zeros or an untouched main_grad.
TEST(RouterBackward, WeightGradientModes) {
  Rng rng;
  const int64_t H = 8, E = 4;
  const RouterSpec spec = make_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f);
  for (int64_t T : {int64_t(5), int64_t(0)}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    const Tensor x = random_tensor({T, H}, DType::kBFloat16, rng),
                 w = random_tensor({E, H}, DType::kBFloat16, rng);
    const RouterRun f = run_router_forward(x, w, {}, spec);
    const Tensor g = random_tensor({T, 2}, DType::kFloat32, rng);
    const RouterBackwardRun fresh =
        run_router_backward({g, {}, {}}, x, w, f, spec, DType::kFloat32);
    const oracle::Matrix dw = oracle::to_matrix(fresh.dweight.values());
    const Tensor ws =
        workspace_tensor(router_backward_workspace_size(T, E, H, x.dtype()), Device::cpu());
    const Tensor before = random_tensor({E, H}, DType::kFloat32, rng);
    for (GradMode mode : {GradMode::kAccumulate, GradMode::kOverwrite, GradMode::kWrite}) {
      SCOPED_TRACE(grad_mode_name(mode));
      Tensor main_grad =
          Tensor::empty({E, H}, mode == GradMode::kWrite ? DType::kBFloat16 : DType::kFloat32);
      copy_tensor(main_grad,
                  mode == GradMode::kWrite ? random_tensor({E, H}, DType::kBFloat16, rng) : before);
      router_backward({g, {}, {}}, x, w, f.logits.view, f.indices.view, {}, {{}, main_grad, mode},
                      spec, {nullptr, workspace_of(ws, Device::cpu())});
      const oracle::Matrix got = oracle::to_matrix(main_grad), start = oracle::to_matrix(before);
      for (size_t i = 0; i < got.data.size(); ++i) {
        const double want =
            mode == GradMode::kAccumulate ? double(float(start.data[i] + dw.data[i])) : dw.data[i];
        if (mode == GradMode::kWrite)
          EXPECT_NEAR(got.data[i], want, 1e-2 * std::abs(want) + 1e-30);
        else
          EXPECT_EQ(got.data[i], want);
      }
      if (T == 0 && mode == GradMode::kAccumulate) EXPECT_TRUE(bitwise_equal(main_grad, before));
    }
  }
}

// No tokens: zero counts and losses, nothing else written.
TEST(RouterNoTokens, ZeroCountsAndLosses) {
  const Tensor x = Tensor::empty({0, 8}, DType::kFloat32),
               w = Tensor::zeros({4, 8}, DType::kFloat32);
  const RouterRun r =
      run_router_forward(x, w, {}, make_spec(RouterScore::kSigmoid, 2, 2, 1, true, 1.f));
  EXPECT_EQ(RouterRun::int64s(r.counts), (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(RouterRun::int64s(r.aux_counts), (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(scalar_value(r.aux_loss.view), 0.0);
  EXPECT_EQ(scalar_value(r.z_loss.view), 0.0);
  EXPECT_TRUE(r.tails_untouched());
}

// Rows strided past their width: the same results as contiguous tensors.
TEST(RouterStrides, RowStridedTensorsGiveTheSameResults) {
  Rng rng;
  const int64_t T = 7, H = 6, E = 8;
  const Tensor x = random_tensor({T, H}, DType::kBFloat16, rng),
               w = random_tensor({E, H}, DType::kBFloat16, rng);
  Tensor wide = random_tensor({T, H + 3}, DType::kBFloat16, rng);
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(wide.data_as<BFloat16>() + t * (H + 3), x.data_as<BFloat16>() + t * H,
                size_t(H) * 2);
  const TensorView strided(wide.data(), {T, H}, {H + 3, 1}, DType::kBFloat16, Device::cpu());
  const RouterSpec spec = make_spec(RouterScore::kSoftmax, 3, 2, 1, true, 1.f);
  const RouterRun a = run_router_forward(x, w, {}, spec),
                  b = run_router_forward(strided, w, {}, spec);
  EXPECT_TRUE(bitwise_equal(a.logits.values(), b.logits.values()));
  EXPECT_EQ(a.host_indices(), b.host_indices());
  EXPECT_TRUE(bitwise_equal(a.probs.values(), b.probs.values()));
}

// DeepSeek-V3's rule: bias += rate * sign(mean - count), the sign exact (0 at the mean).
TEST(RouterExpertBias, UpdateMovesTowardTheMean) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor bias = Tensor::empty({4}, dt);
    oracle::assign(bias, {0.5, -0.25, 0, 1});
    const Tensor counts = splits_tensor_for({5, 3, 4, 4});  // mean 4
    router_update_expert_bias(bias, counts, 0.125f);
    EXPECT_EQ(oracle::to_vector(bias), (oracle::Vector{0.375, -0.125, 0, 1}));
  }
  // A mean that is not an integer: sign(17/3 - c) with c = 5, 6, 6.
  Tensor bias = Tensor::zeros({3}, DType::kFloat32);
  router_update_expert_bias(bias, splits_tensor_for({5, 6, 6}), 1.f);
  EXPECT_EQ(oracle::to_vector(bias), (oracle::Vector{1, -1, -1}));
}

// The shared math: e^x within 2 ulp over the whole float range, the sigmoid, and the choice order.
TEST(RouterMath, ExpIsWithinTwoUlp) {
  double worst = 0;
  for (float x = -103.9f; x < 88.7f; x = std::nextafter(x, 100.f) + 1e-3f * std::abs(x) + 1e-7f) {
    const double want = std::exp(double(x));
    const float got = detail::router_exp(x);
    const double ulp = std::nextafter(float(want), INFINITY) - float(want);
    if (want >= std::numeric_limits<float>::min())
      worst = std::max(worst, std::abs(got - want) / ulp);
    else  // a subnormal result: within 1.5 of its ulps (2^-149)
      EXPECT_LE(std::abs(got - want), 2.2e-45) << x;
  }
  EXPECT_LE(worst, 2.0);
  std::printf("router_exp: worst error over normal results %.3f ulp\n", worst);
  EXPECT_EQ(detail::router_exp(0.f), 1.f);
  EXPECT_EQ(detail::router_exp(88.72283935546875f), INFINITY);
  EXPECT_LT(detail::router_exp(88.7228317f), INFINITY);
  EXPECT_EQ(detail::router_exp(-INFINITY), 0.f);
  EXPECT_TRUE(std::isnan(detail::router_exp(NAN)));
  EXPECT_NEAR(detail::router_sigmoid(0.7f), 1 / (1 + std::exp(-0.7)), 1e-7);
}

TEST(RouterMath, KeysOrderAsTheChoiceOrder) {
  const float values[] = {-INFINITY, -3.f, -0.f, 0.f, 1e-30f, 0.5f, 2.f, INFINITY, NAN};
  for (float a : values)
    for (float b : values)
      for (uint32_t ia : {0u, 3u})
        for (uint32_t ib : {1u, 3u}) {
          if (ia == ib) continue;
          EXPECT_EQ(detail::router_key(a, ia) > detail::router_key(b, ib),
                    detail::router_better(a, ia, b, ib))
              << a << "@" << ia << " vs " << b << "@" << ib;
          EXPECT_GT(detail::router_key(a, ia), detail::kRouterNoKey);
          EXPECT_EQ(detail::float_bits(detail::router_key_value(detail::router_key(a, ia))),
                    detail::float_bits(detail::router_canonical(a)));
        }
}

// counts_total sums the counts of every call; total_loss is aux + z as written; accumulate_dx adds
// the router's dx into dx's value (in float32 the sum of the written dx and the start, bit for bit).
TEST(RouterAccumulation, CountsTotalTotalLossAndAccumulatedDx) {
  Rng rng;
  const int64_t T = 29, H = 12, E = 6, k = 2;
  const RouterSpec spec = make_spec(RouterScore::kSoftmax, k, 1, 1, true, 1.f, 0.01f, 0.002f);
  const Tensor x = random_tensor({T, H}, DType::kFloat32, rng), w = random_tensor({E, H}, DType::kFloat32, rng);
  const Tensor g = random_tensor({T, k}, DType::kFloat32, rng), start = random_tensor({T, H}, DType::kFloat32, rng);
  const RouterAccumulation r = run_router_accumulation(x, w, g, start, spec, Device::cpu());
  for (int64_t e = 0; e < E; ++e)
    EXPECT_EQ(r.counts_total.data_as<int64_t>()[e], 2 * r.counts.data_as<int64_t>()[e]) << e;
  EXPECT_EQ(*r.total_loss.data_as<float>(), *r.aux_loss.data_as<float>() + *r.z_loss.data_as<float>());
  for (int64_t i = 0; i < x.numel(); ++i)
    ASSERT_EQ(r.dx_added.data_as<float>()[i], start.data_as<float>()[i] + r.dx_written.data_as<float>()[i]) << i;
  // No loss requested: total_loss is 0.
  const RouterSpec quiet = make_spec(RouterScore::kSoftmax, k, 1, 1, true, 1.f, 0.f, 0.f);
  const Tensor total = Tensor::empty({}, DType::kFloat32);
  // RouterOutputs holds views: the tensors behind them must outlive the calls.
  const Tensor logits = Tensor::empty({T, E}, DType::kFloat32), indices = Tensor::empty({T, k}, DType::kInt32);
  const Tensor probs = Tensor::empty({T, k}, DType::kFloat32), counts = Tensor::empty({E}, DType::kInt64);
  RouterOutputs out{logits, indices, probs, counts};
  out.total_loss = total;
  const Tensor ws = workspace_tensor(router_forward_workspace_size(T, E), Device::cpu());
  const ExecContext ctx{nullptr, workspace_of(ws, Device::cpu())};
  router_forward(x, w, {}, out, quiet, ctx);
  EXPECT_EQ(*total.data_as<float>(), 0.f);
  out.counts_total = Tensor::zeros({E + 1}, DType::kInt64);
  EXPECT_MOE_ERROR(router_forward(x, w, {}, out, quiet, ctx), ErrorCode::kShape, "out.counts_total");
}

TEST(RouterSpecs, NamesDescriptionsAndChecks) {
  EXPECT_EQ(parse_router_score("sigmoid"), RouterScore::kSigmoid);
  EXPECT_MOE_ERROR(parse_router_score("sparsemax"), ErrorCode::kInvalidArgument,
                   "unknown router score function 'sparsemax'; expected softmax or sigmoid");
  EXPECT_EQ(describe(RouterSpec{}), "softmax, topk=2, norm");
  EXPECT_EQ(describe(make_spec(RouterScore::kSigmoid, 8, 8, 4, true, 2.5f, 0.001f, 0.f)),
            "sigmoid, topk=8, groups=8/4, norm, scaling=2.5, aux=0.001");
  EXPECT_NO_THROW(
      check_router_spec(make_spec(RouterScore::kSigmoid, 8, 8, 4, true, 2.5f), 256, "t"));
  EXPECT_MOE_ERROR(check_router_spec(make_spec(RouterScore::kSoftmax, 9, 1, 1, true, 1.f), 8, "t"),
                   ErrorCode::kInvalidArgument,
                   "t: spec.topk: expected 1 <= topk <= 8 (E, the number of experts), got 9");
  EXPECT_MOE_ERROR(check_router_spec(make_spec(RouterScore::kSoftmax, 0, 1, 1, true, 1.f), 8, "t"),
                   ErrorCode::kInvalidArgument, "spec.topk: expected 1 <= topk <= 8");
  EXPECT_MOE_ERROR(check_router_spec(make_spec(RouterScore::kSoftmax, 2, 3, 1, true, 1.f), 8, "t"),
                   ErrorCode::kInvalidArgument,
                   "t: spec.num_groups: expected a divisor of E = 8 (the experts split into equal "
                   "groups), got 3");
  EXPECT_MOE_ERROR(check_router_spec(make_spec(RouterScore::kSoftmax, 2, 4, 5, true, 1.f), 8, "t"),
                   ErrorCode::kInvalidArgument,
                   "t: spec.topk_groups: expected 1 <= topk_groups <= num_groups = 4, got 5");
  EXPECT_MOE_ERROR(check_router_spec(make_spec(RouterScore::kSoftmax, 5, 4, 2, true, 1.f), 8, "t"),
                   ErrorCode::kInvalidArgument,
                   "t: spec.topk: expected 1 <= topk <= 4 (topk_groups x experts per group: the "
                   "experts of the kept "
                   "groups), got 5");
  EXPECT_MOE_ERROR(
      check_router_spec(make_spec(RouterScore::kSoftmax, 2, 1, 1, true, INFINITY), 8, "t"),
      ErrorCode::kInvalidArgument, "spec.scaling_factor: expected a finite value, got inf");
  EXPECT_MOE_ERROR(
      check_router_spec(make_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f, -1.f), 8, "t"),
      ErrorCode::kInvalidArgument, "spec.aux_loss_coeff: expected a finite value >= 0, got -1");
  EXPECT_MOE_ERROR(
      check_router_spec(make_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f, 0.f, NAN), 8, "t"),
      ErrorCode::kInvalidArgument, "spec.z_loss_coeff: expected a finite value >= 0, got nan");
}

class RouterValidation : public ::testing::Test {
 protected:
  Rng rng;
  RouterSpec spec = make_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f);
  Tensor x = random_tensor({6, 8}, DType::kBFloat16, rng);
  Tensor w = random_tensor({4, 8}, DType::kBFloat16, rng);
  Tensor logits = Tensor::empty({6, 4}, DType::kFloat32);
  Tensor indices = Tensor::empty({6, 2}, DType::kInt64);
  Tensor probs = Tensor::empty({6, 2}, DType::kFloat32);
  Tensor counts = Tensor::empty({4}, DType::kInt64);
  Tensor ws = workspace_tensor(router_forward_workspace_size(6, 4), Device::cpu());
  RouterOutputs out() const { return {logits, indices, probs, counts, {}, {}, {}}; }
  void forward(const TensorView& xv, const TensorView& wv, const TensorView& bias,
               const RouterOutputs& o, const RouterSpec& s) const {
    router_forward(xv, wv, bias, o, s, {nullptr, workspace_of(ws, Device::cpu())});
  }
};

TEST_F(RouterValidation, Forward) {
  EXPECT_NO_THROW(forward(x, w, {}, out(), spec));
  EXPECT_MOE_ERROR(forward({}, w, {}, out(), spec), ErrorCode::kInvalidArgument,
                   "router_forward: x: required tensor [T, H] is undefined");
  EXPECT_MOE_ERROR(forward(x, random_tensor({4, 7}, DType::kBFloat16, rng), {}, out(), spec),
                   ErrorCode::kShape,
                   "router_forward: weight: expected [E, H] = [*, 8], got bfloat16[4, 7]");
  EXPECT_MOE_ERROR(forward(x, random_tensor({4, 8}, DType::kFloat32, rng), {}, out(), spec),
                   ErrorCode::kDType, "weight: expected bfloat16 like x, got float32");
  RouterSpec too_many = spec;
  too_many.topk = 5;
  EXPECT_MOE_ERROR(forward(x, w, {}, out(), too_many), ErrorCode::kInvalidArgument,
                   "router_forward: spec.topk: expected 1 <= topk <= 4");
  RouterOutputs o = out();
  const Tensor logits_bf16 = Tensor::empty({6, 4}, DType::kBFloat16);
  o.logits = logits_bf16;
  EXPECT_MOE_ERROR(forward(x, w, {}, o, spec), ErrorCode::kDType,
                   "out.logits: expected float32, got bfloat16");
  o = out();
  const Tensor short_probs = Tensor::empty({6, 3}, DType::kFloat32);
  o.probs = short_probs;
  EXPECT_MOE_ERROR(forward(x, w, {}, o, spec), ErrorCode::kShape,
                   "out.probs: expected [T, k] = [6, 2]");
  o = out();
  const Tensor float_indices = Tensor::empty({6, 2}, DType::kFloat32);
  o.indices = float_indices;
  EXPECT_MOE_ERROR(forward(x, w, {}, o, spec), ErrorCode::kDType,
                   "out.indices: expected int32 or int64, got float32");
  o = out();
  const Tensor counts32 = Tensor::empty({4}, DType::kInt32);
  o.counts = counts32;
  EXPECT_MOE_ERROR(forward(x, w, {}, o, spec), ErrorCode::kDType,
                   "out.counts: expected int64, got int32");
  o = out();
  const Tensor loss = Tensor::empty({}, DType::kFloat32),
               loss1 = Tensor::empty({1}, DType::kFloat32);
  o.aux_loss = loss;
  EXPECT_MOE_ERROR(forward(x, w, {}, o, spec), ErrorCode::kInvalidArgument,
                   "out.aux_loss_counts: required with out.aux_loss, got an undefined tensor");
  o = out();
  o.z_loss = loss1;
  EXPECT_MOE_ERROR(forward(x, w, {}, o, spec), ErrorCode::kShape,
                   "out.z_loss: expected a scalar (a 0-d tensor), got float32[1]");
  EXPECT_MOE_ERROR(forward(x, w, Tensor::zeros({5}, DType::kFloat32), out(), spec),
                   ErrorCode::kShape, "expert_bias: expected a 1-D [E] = [4] tensor");
  EXPECT_MOE_ERROR(forward(x, w, Tensor::zeros({4}, DType::kBFloat16), out(), spec),
                   ErrorCode::kDType, "expert_bias: expected float32, got bfloat16");
  o = out();
  o.probs = logits.view().reshape({12, 2}).slice(0, 6);  // shares memory with logits
  EXPECT_MOE_ERROR(forward(x, w, {}, o, spec), ErrorCode::kInvalidArgument,
                   "outputs out.logits and out.probs overlap in memory");
  EXPECT_MOE_ERROR(router_forward(x, w, {}, out(), spec), ErrorCode::kWorkspace,
                   "the workspace holds 0 bytes but");
  // A tensor on another device (a view that claims cuda:0: validation reads no data).
  const TensorView w_gpu(w.data(), w.shape(), w.dtype(), Device::cuda(0));
  EXPECT_MOE_ERROR(forward(x, w_gpu, {}, out(), spec), ErrorCode::kDevice,
                   "router_forward: weight is on cuda:0; expected x's device cpu");
}

TEST_F(RouterValidation, Backward) {
  const RouterRun f = run_router_forward(x, w, {}, spec);
  const Tensor bws =
      workspace_tensor(router_backward_workspace_size(6, 4, 8, DType::kBFloat16), Device::cpu());
  const ExecContext ctx{nullptr, workspace_of(bws, Device::cpu())};
  const Tensor dx = Tensor::empty({6, 8}, DType::kBFloat16),
               dw = Tensor::empty({4, 8}, DType::kFloat32);
  const Tensor g = Tensor::zeros({6, 2}, DType::kFloat32);
  EXPECT_NO_THROW(
      router_backward({g, {}, {}}, x, w, f.logits.view, f.indices.view, {}, {dx, dw}, spec, ctx));
  EXPECT_MOE_ERROR(
      router_backward({g, {}, {}}, x, w, f.logits.view, f.indices.view, {}, {}, spec, ctx),
      ErrorCode::kInvalidArgument,
      "router_backward: neither grads.dx nor grads.dweight is requested: the call would do "
      "nothing");
  EXPECT_MOE_ERROR(router_backward({{}, scalar_tensor(1, DType::kFloat32), {}}, x, w, f.logits.view,
                                   f.indices.view, {}, {dx, dw}, spec, ctx),
                   ErrorCode::kInvalidArgument, "aux_loss_counts: required with d_out.d_aux_loss");
  EXPECT_MOE_ERROR(router_backward({g, {}, {}}, x, w, f.logits.view, f.indices.view, {},
                                   {Tensor::empty({6, 8}, DType::kFloat32), dw}, spec, ctx),
                   ErrorCode::kDType, "grads.dx: expected bfloat16 like x, got float32");
  EXPECT_MOE_ERROR(
      router_backward({g, {}, {}}, x, w, f.logits.view, f.indices.view, {},
                      {dx, Tensor::empty({4, 8}, DType::kBFloat16), GradMode::kAccumulate}, spec,
                      ctx),
      ErrorCode::kDType, "grads.dweight: accumulate mode writes a float32 main_grad, got bfloat16");
  EXPECT_MOE_ERROR(
      router_backward({g, {}, {}}, x, w, f.logits.view, f.indices.view, {}, {x, dw}, spec, ctx),
      ErrorCode::kInvalidArgument, "output grads.dx overlaps input x in memory");
  Tensor bad = Tensor::zeros({6, 2}, DType::kInt64);
  bad.data_as<int64_t>()[3] = 4;
  EXPECT_MOE_ERROR(
      router_backward({g, {}, {}}, x, w, f.logits.view, bad, {}, {dx, dw}, spec, ctx),
      ErrorCode::kInvalidArgument,
      "router_backward: indices[1, 1] = 4 is not an expert (expected 0 <= index < E = 4; pass "
      "router_forward's indices)");
  EXPECT_MOE_ERROR(
      router_backward({g, {}, {}}, x, w, f.logits.view, f.indices.view, {}, {dx, dw}, spec, {}),
      ErrorCode::kWorkspace, "size it with router_backward_workspace_size(...)");
}

TEST_F(RouterValidation, ExpertBiasUpdate) {
  Tensor bias = Tensor::zeros({4}, DType::kFloat32);
  EXPECT_MOE_ERROR(router_update_expert_bias(bias, Tensor::zeros({3}, DType::kInt64), 0.1f),
                   ErrorCode::kShape,
                   "router_update_expert_bias: counts: expected a 1-D [E] = [4] tensor");
  EXPECT_MOE_ERROR(router_update_expert_bias(bias, Tensor::zeros({4}, DType::kInt32), 0.1f),
                   ErrorCode::kDType, "counts: expected int64, got int32");
  EXPECT_MOE_ERROR(router_update_expert_bias(Tensor::zeros({4}, DType::kBFloat16), counts, 0.1f),
                   ErrorCode::kDType, "expert_bias: expected float32 (or float64), got bfloat16");
  EXPECT_MOE_ERROR(router_update_expert_bias(bias, counts, NAN), ErrorCode::kInvalidArgument,
                   "rate: expected a finite value >= 0 (a negative rate moves the bias against the balance), got nan");
  EXPECT_MOE_ERROR(router_update_expert_bias(bias, counts, -1e-3f), ErrorCode::kInvalidArgument,
                   "rate: expected a finite value >= 0");
}

}  // namespace
}  // namespace moe::test
