// The expert MLP on the CPU backend, GLU and non-gated activations: against the float64 oracle,
// finite differences, recompute vs saved pre-activation, per-expert vs packed weights, gradient
// modes, workspace sizing.
#include <cmath>

#include "test_support.hpp"

namespace moe::test {
namespace {

struct MlpProblem {
  Routing routing;
  int64_t H, F;
  DType dt;
  GluSpec glu;
  Tensor x, w1, b1, w2, b2, p, dy;  // b1/b2/p undefined when absent

  int64_t T() const { return routing.capacity; }
  int64_t G() const { return routing.num_groups(); }
  oracle::MlpParams oracle_params() const {
    oracle::MlpParams m;
    m.w1 = oracle::to_matrices(GroupedParam::packed(w1));
    m.w2 = oracle::to_matrices(GroupedParam::packed(w2));
    if (b1.defined()) m.b1 = oracle::to_matrix(b1);
    if (b2.defined()) m.b2 = oracle::to_matrix(b2);
    return m;
  }
  oracle::Vector oracle_probs() const {
    return p.defined() ? head(oracle::to_vector(p), routing.rows()) : oracle::Vector{};
  }
};

// fc1_scale > 1 spreads the pre-activation past the clamp limit.
MlpProblem make_problem(Rng& rng, std::vector<int64_t> splits, int64_t T, int64_t H, int64_t F,
                        DType dt, GluSpec glu, bool bias, bool probs, double fc1_scale = 1.0) {
  MlpProblem m{Routing(std::move(splits), T), H, F, dt, glu, {}, {}, {}, {}, {}, {}, {}};
  const int64_t G = m.G();
  m.x = random_tensor({T, H}, dt, rng);
  m.w1 = random_tensor({G, fc1_width(glu, F), H}, dt, rng, fc1_scale / std::sqrt(double(H)));
  m.w2 = random_tensor({G, H, F}, dt, rng, 1.0 / std::sqrt(double(F)));
  if (bias) {
    m.b1 = random_tensor({G, fc1_width(glu, F)}, dt, rng, 0.5);
    m.b2 = random_tensor({G, H}, dt, rng, 0.5);
  }
  if (probs)
    m.p = uniform_tensor({T}, dt == DType::kFloat64 ? dt : DType::kFloat32, rng, 0.05, 1.0);
  m.dy = random_tensor({T, H}, dt, rng);
  return m;
}

struct MlpRun {
  Tensor y, fc1_out, dx, dprobs;
  OwnedParam dw1, db1, dw2, db2;
};

Tensor workspace_for(size_t bytes) { return Tensor::empty({int64_t(bytes)}, DType::kUInt8); }

ExecContext ctx_with(const Tensor& ws) {
  return ExecContext{nullptr, {ws.data(), ws.nbytes(), Device::cpu()}};
}

// Forward + backward; gradients in float32 (write mode), stored packed or per expert.
MlpRun run(const MlpProblem& m, bool per_expert, bool save_fc1_out) {
  const int64_t T = m.T(), G = m.G(), H = m.H, F = m.F, W = fc1_width(m.glu, F);
  const DType gdt = m.dt == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  OwnedParam w1(m.w1, per_expert), w2(m.w2, per_expert);
  OwnedParam b1 = m.b1.defined() ? OwnedParam(m.b1, per_expert) : OwnedParam();
  OwnedParam b2 = m.b2.defined() ? OwnedParam(m.b2, per_expert) : OwnedParam();
  const ExpertMlpWeights weights{w1.param, b1.param, w2.param, b2.param};
  const ExpertMlpSpec spec{m.glu};
  MlpRun r;
  r.y = poisoned({T, H}, m.dt);
  if (save_fc1_out) r.fc1_out = poisoned({T, W}, m.dt);
  Tensor fws = workspace_for(expert_mlp_forward_workspace_size(T, H, F, m.dt, save_fc1_out, spec));
  expert_mlp_forward(m.x, m.p, weights, m.routing.layout, r.y, r.fc1_out, spec, ctx_with(fws));

  r.dx = poisoned({T, H}, m.dt);
  if (m.p.defined()) r.dprobs = poisoned({T}, m.p.dtype());
  r.dw1 = OwnedParam(poisoned({G, W, H}, gdt), per_expert);
  r.dw2 = OwnedParam(poisoned({G, H, F}, gdt), per_expert);
  if (m.b1.defined()) r.db1 = OwnedParam(poisoned({G, W}, gdt), per_expert);
  if (m.b2.defined()) r.db2 = OwnedParam(poisoned({G, H}, gdt), per_expert);
  ExpertMlpGrads grads;
  grads.dx = r.dx;
  grads.dprobs = r.dprobs;
  grads.fc1_weight = {r.dw1.param, GradMode::kWrite};
  grads.fc2_weight = {r.dw2.param, GradMode::kWrite};
  grads.fc1_bias = {r.db1.param, GradMode::kWrite};
  grads.fc2_bias = {r.db2.param, GradMode::kWrite};
  Tensor bws = workspace_for(expert_mlp_backward_workspace_size(T, H, F, m.dt, !save_fc1_out, spec));
  expert_mlp_backward(m.dy, m.x, m.p, weights, m.routing.layout, r.fc1_out, grads, spec,
                      ctx_with(bws));
  return r;
}

void expect_matches_oracle(const MlpProblem& m, const MlpRun& r) {
  const double tol = oracle::mlp_tolerance(m.dt);
  const int64_t rows = m.routing.rows();
  const auto params = m.oracle_params();
  const auto probs = m.oracle_probs();
  const auto xm = head(oracle::to_matrix(m.x), rows);
  const auto f = oracle::mlp_forward(xm, probs, params, m.routing.splits, m.glu);
  const auto g = oracle::mlp_backward(head(oracle::to_matrix(m.dy), rows), xm, probs, params,
                                      m.routing.splits, m.glu);
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(r.y), f.y), tol) << "y";
  if (r.fc1_out.defined())
    EXPECT_LE(oracle::rel_error(oracle::to_matrix(r.fc1_out), f.h), tol) << "fc1_out";
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(r.dx), g.dx), tol) << "dx";
  EXPECT_LE(oracle::rel_error(oracle::to_matrices(r.dw1.param), g.dw1), tol) << "dw1";
  EXPECT_LE(oracle::rel_error(oracle::to_matrices(r.dw2.param), g.dw2), tol) << "dw2";
  auto bias_matrix = [](const GroupedParam& p) {  // G x [N] -> [G, N]
    oracle::Matrix out(p.num_groups(), p.expert_shape()[0]);
    for (int64_t e = 0; e < p.num_groups(); ++e) {
      const auto col = oracle::to_matrix(p.expert(e));
      for (int64_t n = 0; n < out.cols; ++n) out(e, n) = col(n, 0);
    }
    return out;
  };
  if (m.b1.defined()) EXPECT_LE(oracle::rel_error(bias_matrix(r.db1.param), g.db1), tol) << "db1";
  if (m.b2.defined()) EXPECT_LE(oracle::rel_error(bias_matrix(r.db2.param), g.db2), tol) << "db2";
  if (m.p.defined())
    EXPECT_LE(oracle::rel_error(oracle::to_vector(r.dprobs), g.dprobs), tol) << "dprobs";
  // Rows past sum(splits) are never written.
  EXPECT_TRUE(tail_untouched(r.y, rows)) << "y tail";
  EXPECT_TRUE(tail_untouched(r.dx, rows)) << "dx tail";
  if (r.fc1_out.defined()) EXPECT_TRUE(tail_untouched(r.fc1_out, rows)) << "fc1_out tail";
  if (r.dprobs.defined()) EXPECT_TRUE(tail_untouched(r.dprobs, rows)) << "dprobs tail";
}

// Every gradient of two runs, bit for bit.
void expect_same_gradients(const MlpRun& r, const MlpRun& base) {
  EXPECT_TRUE(bitwise_equal(r.dx, base.dx)) << "dx";
  EXPECT_TRUE(bitwise_equal(r.dprobs, base.dprobs)) << "dprobs";
  EXPECT_TRUE(bitwise_equal(r.dw1.param, base.dw1.param)) << "dw1";
  EXPECT_TRUE(bitwise_equal(r.dw2.param, base.dw2.param)) << "dw2";
  EXPECT_TRUE(bitwise_equal(r.db1.param, base.db1.param)) << "db1";
  EXPECT_TRUE(bitwise_equal(r.db2.param, base.db2.param)) << "db2";
}

GluSpec glu(Activation act, GluLayout layout) {
  GluSpec s;
  s.activation = act;
  s.layout = layout;
  return s;
}

class ExpertMlp : public ::testing::TestWithParam<DType> {};

TEST_P(ExpertMlp, MatchesOracleForEveryActivationLayoutBiasAndProbs) {
  const DType dt = GetParam();
  Rng rng;
  for (const GluSpec& spec : activation_specs({GluLayout::halves(), GluLayout::pairs(), GluLayout::blocks(8)}))
      for (bool bias : {false, true})
        for (bool probs : {false, true}) {
          SCOPED_TRACE(describe(spec) + (bias ? ", bias" : "") + (probs ? ", probs" : ""));
          // bf16/fp16 round the pre-activation, so values near the clamp could land on its
          // other side; past-the-clamp values are exercised in float32/float64.
          const double fc1_scale = (dt == DType::kFloat32 || dt == DType::kFloat64) ? 4.0 : 1.0;
          const MlpProblem m =
              make_problem(rng, {0, 13, 1, 29}, 50, 40, 24, dt, spec, bias, probs, fc1_scale);
          expect_matches_oracle(m, run(m, /*per_expert=*/false, /*save_fc1_out=*/true));
        }
}

TEST_P(ExpertMlp, SingleExpertAndManyExperts) {
  const DType dt = GetParam();
  Rng rng;
  const GluSpec spec = glu(Activation::kSwiGLU, GluLayout::halves());
  {
    SCOPED_TRACE("G = 1");
    const MlpProblem m = make_problem(rng, {37}, 40, 24, 16, dt, spec, true, true);
    expect_matches_oracle(m, run(m, false, true));
  }
  {
    SCOPED_TRACE("G = 256");
    std::vector<int64_t> splits = random_splits(rng, 256, 3);
    int64_t rows = 0;
    for (int64_t s : splits) rows += s;
    const MlpProblem m = make_problem(rng, splits, rows + 5, 16, 8, dt, spec, true, true);
    expect_matches_oracle(m, run(m, true, false));
  }
}

TEST_P(ExpertMlp, RecomputeAndPerExpertAreBitIdentical) {
  const DType dt = GetParam();
  Rng rng;
  for (const GluSpec& spec : {glu(Activation::kClampedQGeGLU, GluLayout::blocks(4)), spec_of(Activation::kSReLU),
                              spec_of(Activation::kGeluTanh)}) {
  SCOPED_TRACE(describe(spec));
  const MlpProblem m = make_problem(rng, {9, 0, 1, 30}, 48, 32, 16, dt, spec, true, true);
  const MlpRun base = run(m, false, true);
  for (auto [per_expert, save] :
       {std::pair{false, false}, std::pair{true, true}, std::pair{true, false}}) {
    SCOPED_TRACE(std::string(per_expert ? "per-expert" : "packed") +
                 (save ? ", saved" : ", recompute"));
    const MlpRun r = run(m, per_expert, save);
    EXPECT_TRUE(bitwise_equal(r.y, base.y));
    expect_same_gradients(r, base);
  }
  const MlpRun again = run(m, false, true);  // run to run
  EXPECT_TRUE(bitwise_equal(again.dw1.param, base.dw1.param));
  EXPECT_TRUE(bitwise_equal(again.y, base.y));
  }
}

// FC2's half of the backward writing dL/d(fc1_out) and FC2's input out (ExpertMlpGrads::d_fc1,
// ::act), then FC1's gradients from dL/d(fc1_out) and FC2's weight gradient again from act through
// the grouped-linear ops: the bits of the whole backward in one call, with a workspace W per row
// smaller.
TEST_P(ExpertMlp, Fc2HalfAndFc1OpsEqualTheWholeBackward) {
  const DType dt = GetParam();
  Rng rng;
  for (const GluSpec& spec : {glu(Activation::kSwiGLU, GluLayout::blocks(4)), spec_of(Activation::kSReLU)})
    for (bool save : {true, false}) {
      SCOPED_TRACE(describe(spec) + (save ? ", saved" : ", recompute"));
      const MlpProblem m = make_problem(rng, {9, 0, 1, 30}, 48, 32, 16, dt, spec, true, true);
      const MlpRun base = run(m, false, save);
      const int64_t T = m.T(), G = m.G(), H = m.H, F = m.F, W = fc1_width(m.glu, F);
      const DType gdt = dt == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
      const ExpertMlpWeights weights{GroupedParam::packed(m.w1), GroupedParam::packed(m.b1),
                                     GroupedParam::packed(m.w2), GroupedParam::packed(m.b2)};
      const ExpertMlpSpec mlp_spec{m.glu};
      MlpRun r;
      r.dprobs = poisoned({T}, m.p.dtype());
      r.dw1 = OwnedParam(poisoned({G, W, H}, gdt), false);
      r.dw2 = OwnedParam(poisoned({G, H, F}, gdt), false);
      r.db1 = OwnedParam(poisoned({G, W}, gdt), false);
      r.db2 = OwnedParam(poisoned({G, H}, gdt), false);
      r.dx = poisoned({T, H}, dt);
      Tensor d_fc1 = poisoned({T, W}, dt), act = poisoned({T, F}, dt);
      ExpertMlpGrads fc2_half;
      fc2_half.dprobs = r.dprobs;
      fc2_half.fc2_weight = {r.dw2.param, GradMode::kWrite};
      fc2_half.fc2_bias = {r.db2.param, GradMode::kWrite};
      fc2_half.d_fc1 = d_fc1;
      fc2_half.act = act;  // FC2's input written out: its weight gradient again from it below
      const size_t whole = expert_mlp_backward_workspace_size(T, H, F, dt, !save, mlp_spec);
      const size_t half = expert_mlp_backward_workspace_size(T, H, F, dt, !save, mlp_spec, true);
      if (save) EXPECT_EQ(whole - half, size_t(T * W) * dtype_size(dt));
      Tensor bws = workspace_for(half);
      expert_mlp_backward(m.dy, save ? TensorView{} : m.x.view(), m.p, weights, m.routing.layout,
                          save ? base.fc1_out.view() : TensorView{}, fc2_half, mlp_spec, ctx_with(bws));
      EXPECT_TRUE(tail_untouched(d_fc1, m.routing.rows())) << "d_fc1 tail";
      EXPECT_TRUE(tail_untouched(act, m.routing.rows())) << "act tail";
      OwnedParam dw2_later(poisoned({G, H, F}, gdt), false);
      grouped_linear_wgrad(m.dy, act, m.routing.layout, dw2_later.param, GradMode::kWrite);
      EXPECT_TRUE(bitwise_equal(dw2_later.param, base.dw2.param)) << "FC2's weight gradient from act";
      grouped_linear_dbias(d_fc1, m.routing.layout, r.db1.param, GradMode::kWrite);
      grouped_linear_wgrad(d_fc1, m.x, m.routing.layout, r.dw1.param, GradMode::kWrite);
      grouped_linear_dgrad(d_fc1, weights.fc1_weight, m.routing.layout, r.dx);
      expect_same_gradients(r, base);
    }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ExpertMlp,
                         ::testing::Values(DType::kBFloat16, DType::kFloat32, DType::kFloat16,
                                           DType::kFloat64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Accumulating twice into a zeroed main_grad gives exactly 2x one write; overwrite replaces.
TEST(ExpertMlpGradModes, AccumulateTwiceIsTwiceAndOverwriteReplaces) {
  Rng rng;
  const GluSpec spec = glu(Activation::kSwiGLU, GluLayout::halves());
  const MlpProblem m = make_problem(rng, {6, 0, 11}, 20, 16, 8, DType::kBFloat16, spec, true, true);
  const MlpRun once = run(m, false, true);
  const int64_t G = m.G(), T = m.T(), H = m.H, F = m.F;
  const ExpertMlpWeights weights{GroupedParam::packed(m.w1), GroupedParam::packed(m.b1),
                                 GroupedParam::packed(m.w2), GroupedParam::packed(m.b2)};
  Tensor fc1_out = poisoned({T, 2 * F}, m.dt), y = poisoned({T, H}, m.dt);
  Tensor fws = workspace_for(expert_mlp_forward_workspace_size(T, H, F, m.dt, true, {spec}));
  expert_mlp_forward(m.x, m.p, weights, m.routing.layout, y, fc1_out, {spec}, ctx_with(fws));
  Tensor bws = workspace_for(expert_mlp_backward_workspace_size(T, H, F, m.dt, false, {spec}));
  for (GradMode mode : {GradMode::kAccumulate, GradMode::kOverwrite}) {
    SCOPED_TRACE(grad_mode_name(mode));
    Tensor mg1 = Tensor::zeros({G, 2 * F, H}, DType::kFloat32),
           mg2 = Tensor::zeros({G, H, F}, DType::kFloat32);
    Tensor mb1 = Tensor::zeros({G, 2 * F}, DType::kFloat32),
           mb2 = Tensor::zeros({G, H}, DType::kFloat32);
    if (mode == GradMode::kOverwrite)
      for (const Tensor* t : {&mg1, &mg2, &mb1, &mb2}) fill_bytes(*t, kPoison);
    ExpertMlpGrads grads;
    grads.fc1_weight = {GroupedParam::packed(mg1), mode};
    grads.fc2_weight = {GroupedParam::packed(mg2), mode};
    grads.fc1_bias = {GroupedParam::packed(mb1), mode};
    grads.fc2_bias = {GroupedParam::packed(mb2), mode};
    for (int step = 0; step < 2; ++step)
      expert_mlp_backward(m.dy, m.x, m.p, weights, m.routing.layout, fc1_out, grads, {spec},
                          ctx_with(bws));
    const double factor = mode == GradMode::kAccumulate ? 2.0 : 1.0;
    auto check = [&](const Tensor& got, const GroupedParam& one, const char* what) {
      for (int64_t g = 0; g < G; ++g) {
        const auto a = oracle::to_matrix(got.view().select(g).reshape({got.numel() / G}));
        const auto b = oracle::to_matrix(one.expert(g).reshape({got.numel() / G}));
        for (size_t i = 0; i < a.data.size(); ++i)
          ASSERT_EQ(a.data[i], factor * b.data[i]) << what << " expert " << g << " element " << i;
      }
    };
    check(mg1, once.dw1.param, "dw1");
    check(mg2, once.dw2.param, "dw2");
    check(mb1, once.db1.param, "db1");
    check(mb2, once.db2.param, "db2");
  }
}

// The acceptance check: float64 central differences of L = <y, R> for every input and parameter,
// for every activation (the GLUs in two layouts).
TEST(ExpertMlpBackward, AgreesWithFiniteDifferences) {
  Rng rng;
  const int64_t H = 5, F = 4, T = 6;
  for (const GluSpec& spec : activation_specs({GluLayout::halves(), GluLayout::pairs()})) {
      SCOPED_TRACE(describe(spec));
      const int64_t W = fc1_width(spec, F);
      MlpProblem m = make_problem(rng, {2, 0, 3}, T, H, F, DType::kFloat64, spec, true, true,
                                  spec.activation == Activation::kClampedQGeGLU ? 5.0 : 1.0);
      const ExpertMlpWeights weights{GroupedParam::packed(m.w1), GroupedParam::packed(m.b1),
                                     GroupedParam::packed(m.w2), GroupedParam::packed(m.b2)};
      Tensor fws = workspace_for(expert_mlp_forward_workspace_size(T, H, F, m.dt, true, {spec}));
      auto loss = [&](Tensor* fc1_out) {
        Tensor y = Tensor::zeros({T, H}, DType::kFloat64);
        Tensor h = Tensor::zeros({T, W}, DType::kFloat64);
        expert_mlp_forward(m.x, m.p, weights, m.routing.layout, y, h, {spec}, ctx_with(fws));
        if (fc1_out) *fc1_out = h;
        double l = 0;
        for (int64_t i = 0; i < m.routing.rows() * H; ++i)
          l += y.data_as<double>()[i] * m.dy.data_as<double>()[i];
        return l;
      };
      Tensor h;
      loss(&h);
      for (int64_t i = 0; i < m.routing.rows() * W; ++i) {  // stay clear of the kinks
        const double v = h.data_as<double>()[i];
        if (spec.activation == Activation::kClampedQGeGLU)
          ASSERT_GT(std::abs(std::abs(v) - spec.limit), 1e-4) << "resample: clamp kink";
        if (spec.activation == Activation::kSReLU) ASSERT_GT(std::abs(v), 1e-4) << "resample: kink at 0";
      }
      const MlpRun r = run(m, false, true);
      const double eps = 1e-6;
      int64_t checked = 0;
      auto check = [&](const Tensor& param, const TensorView& grad, int64_t count,
                       const char* what) {
        for (int64_t i = 0; i < count; ++i) {
          double& v = param.data_as<double>()[i];
          const double saved = v;
          v = saved + eps;
          const double up = loss(nullptr);
          v = saved - eps;
          const double down = loss(nullptr);
          v = saved;
          const double numeric = (up - down) / (2 * eps);
          EXPECT_NEAR(grad.data_as<double>()[i], numeric, 1e-6 * (1 + std::abs(numeric)))
              << what << "[" << i << "]";
          ++checked;
        }
      };
      check(m.x, r.dx, m.routing.rows() * H, "dx");
      check(m.w1, r.dw1.param.packed_view(), m.w1.numel(), "dw1");
      check(m.b1, r.db1.param.packed_view(), m.b1.numel(), "db1");
      check(m.w2, r.dw2.param.packed_view(), m.w2.numel(), "dw2");
      check(m.b2, r.db2.param.packed_view(), m.b2.numel(), "db2");
      check(m.p, r.dprobs, m.routing.rows(), "dprobs");
      EXPECT_EQ(checked, m.routing.rows() * (H + 1) + m.w1.numel() + m.b1.numel() + m.w2.numel() + m.b2.numel());
    }
}

TEST(ExpertMlpWorkspace, ExactSizeWorksOneByteLessIsAClearError) {
  Rng rng;
  const GluSpec spec = glu(Activation::kSwiGLU, GluLayout::halves());
  const MlpProblem m = make_problem(rng, {3, 4}, 8, 16, 8, DType::kBFloat16, spec, false, false);
  const ExpertMlpWeights weights{GroupedParam::packed(m.w1), {}, GroupedParam::packed(m.w2), {}};
  const size_t need = expert_mlp_forward_workspace_size(8, 16, 8, DType::kBFloat16, false, {spec});
  EXPECT_GT(need, expert_mlp_forward_workspace_size(8, 16, 8, DType::kBFloat16, true, {spec}));
  Tensor ws = workspace_for(need);
  Tensor y = poisoned({8, 16}, DType::kBFloat16);
  EXPECT_NO_THROW(
      expert_mlp_forward(m.x, {}, weights, m.routing.layout, y, {}, {spec}, ctx_with(ws)));
  const ExecContext small{nullptr, {ws.data(), need - 1, Device::cpu()}};
  EXPECT_MOE_ERROR(expert_mlp_forward(m.x, {}, weights, m.routing.layout, y, {}, {spec}, small),
                   ErrorCode::kWorkspace, "size it with expert_mlp_forward_workspace_size");
  EXPECT_MOE_ERROR(expert_mlp_forward(m.x, {}, weights, m.routing.layout, y, {}, {spec}, {}),
                   ErrorCode::kWorkspace, "holds 0 bytes");
}

// FC1's width follows the activation: F per row for srelu / gelu_tanh where a GLU takes 2F.
TEST(ExpertMlpWorkspace, SizedByTheActivationsFc1Width) {
  const int64_t T = 64, H = 32, F = 256;  // multiples of the carver's 256-byte alignment
  const DType dt = DType::kBFloat16;
  const ExpertMlpSpec glu_spec{glu(Activation::kSwiGLU, GluLayout::halves())};
  for (Activation act : kElementwiseActivations) {
    SCOPED_TRACE(activation_name(act));
    const ExpertMlpSpec spec{spec_of(act)};
    // forward: [T, F] act, + [T, F] h when not kept (a GLU's h: [T, 2F])
    EXPECT_EQ(expert_mlp_forward_workspace_size(T, H, F, dt, true, spec), size_t(T * F * 2));
    EXPECT_EQ(expert_mlp_forward_workspace_size(T, H, F, dt, false, spec), size_t(2 * T * F * 2));
    EXPECT_EQ(expert_mlp_forward_workspace_size(T, H, F, dt, false, glu_spec), size_t(3 * T * F * 2));
    // backward: d_act [T, F] and dh [T, F] (a GLU's: [T, 2F])
    EXPECT_EQ(expert_mlp_backward_workspace_size(T, H, F, dt, false, spec), size_t(2 * T * F * 2));
    EXPECT_EQ(expert_mlp_backward_workspace_size(T, H, F, dt, false, glu_spec), size_t(3 * T * F * 2));
  }
}

}  // namespace
}  // namespace moe::test
