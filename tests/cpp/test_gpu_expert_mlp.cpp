// GPU activation kernels and the expert MLP, fused and unfused (label "gpu"): against the CPU
// backend on the same inputs for every activation (GLUs with values past the clamp limit, in every
// GLU layout; srelu and gelu_tanh, elementwise), with and without biases and probs, saved or
// recomputed pre-activation; poisoned tails; which paths ran fused; CUDA-graph replay of the whole
// forward + backward with new routings, bit-identical to eager runs. Skips without a GPU.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "gpu_support.hpp"

namespace moe::test {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// blocks:5 (odd) keeps the one-feature-per-thread 16-bit backward covered.
const GluLayout kLayouts[] = {GluLayout::halves(), GluLayout::pairs(), GluLayout::blocks(8), GluLayout::blocks(5)};

// rel. error of rows [0, rows) of a GPU result against the CPU's, and its tail still poisoned.
void expect_close(const TensorView& gpu, const TensorView& cpu, int64_t rows, double tol, const char* what) {
  const Tensor got = to_host(gpu);
  const Tensor want = to_host(cpu);
  double err;
  if (got.dim() == 1)
    err = oracle::rel_error(head(oracle::to_vector(got), rows), head(oracle::to_vector(want), rows));
  else
    err = oracle::rel_error(head(oracle::to_matrix(got), rows), head(oracle::to_matrix(want), rows));
  EXPECT_LE(err, tol) << what << ": rel. error vs the CPU backend " << err;
  EXPECT_TRUE(tail_untouched(got, rows)) << what << ": rows past sum(splits) were written";
}

class GpuGlu : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(GpuGlu, ForwardAndBackwardMatchTheCpuForEveryActivationLayoutAndProbs) {
  const DType dt = GetParam();
  Rng rng;
  const int64_t T = 300, F = 200;
  DualRouting r({0, 1, 37, 0, 150, 40}, T);  // 228 routed rows
  const int64_t rows = r.cpu.rows();
  for (const GluSpec& spec : activation_specs({std::begin(kLayouts), std::end(kLayouts)}))
      for (bool with_probs : {false, true}) {
        SCOPED_TRACE(describe(spec) + (with_probs ? ", probs" : ""));
        const int64_t W = fc1_width(spec, F);
        // Scale 4: some gate and linear values lie past the clamp limit (7).
        const Tensor h = random_tensor({T, W}, dt, rng, 4.0);
        const Tensor d_out = random_tensor({T, F}, dt, rng);
        const Tensor p = with_probs ? uniform_tensor({T}, DType::kFloat32, rng, 0.05, 1.0) : Tensor();
        const Tensor hd = to_gpu(h), dd = to_gpu(d_out), pd = with_probs ? to_gpu(p) : Tensor();

        Tensor out_c = poisoned({T, F}, dt), out_g = poisoned_gpu({T, F}, dt);
        glu_forward(h, p, r.cpu.layout, out_c, spec);
        glu_forward(hd, pd, r.gpu, out_g, spec);
        expect_close(out_g, out_c, rows, tolerance(dt), "out");

        Tensor dh_c = poisoned({T, W}, dt), dh_g = poisoned_gpu({T, W}, dt);
        Tensor re_c = poisoned({T, F}, dt), re_g = poisoned_gpu({T, F}, dt);
        Tensor dp_c = with_probs ? poisoned({T}, DType::kFloat32) : Tensor();
        Tensor dp_g = with_probs ? poisoned_gpu({T}, DType::kFloat32) : Tensor();
        glu_backward(h, p, d_out, r.cpu.layout, {dh_c, dp_c, re_c}, spec);
        glu_backward(hd, pd, dd, r.gpu, {dh_g, dp_g, re_g}, spec);
        expect_close(dh_g, dh_c, rows, tolerance(dt), "dh");
        expect_close(re_g, re_c, rows, tolerance(dt), "recomputed out");
        if (with_probs) expect_close(dp_g, dp_c, rows, tolerance(DType::kFloat32) * 10, "dprobs");

        // In place (dh = h, out = d_out): the same bytes as separate buffers that start as copies
        // of the inputs (rows past the routed ones keep them).
        Tensor dh_s = to_gpu(h), re_s = to_gpu(d_out), hi = to_gpu(h), di = to_gpu(d_out);
        Tensor dp_s = with_probs ? poisoned_gpu({T}, DType::kFloat32) : Tensor();
        Tensor dp_i = with_probs ? poisoned_gpu({T}, DType::kFloat32) : Tensor();
        glu_backward(hd, pd, dd, r.gpu, {dh_s, dp_s, re_s}, spec);
        glu_backward(hi, pd, di, r.gpu, {hi, dp_i, di}, spec);
        EXPECT_TRUE(bitwise_equal(to_host(hi), to_host(dh_s))) << "in place: dh";
        EXPECT_TRUE(bitwise_equal(to_host(di), to_host(re_s))) << "in place: out";
        if (with_probs) EXPECT_TRUE(bitwise_equal(to_host(dp_i), to_host(dp_s))) << "in place: dprobs";
      }
  EXPECT_NO_THROW(r.flag.check());
}

// SwiGLU's kernels take its constants at compile time (GluMath::swiglu); clamped_qgeglu with the
// same constants (limit inf, alpha 1, offset 0) takes them from the parameters: the same function,
// so the same bits, over every layout, with and without probs (h at scale 4, some values large).
TEST_P(GpuGlu, SwigluEqualsClampedQGeGLUWithSwigluConstantsBitForBit) {
  const DType dt = GetParam();
  Rng rng;
  const int64_t T = 300, F = 192;
  DualRouting r({0, 1, 37, 0, 150, 40}, T);
  for (const GluLayout& layout : {GluLayout::halves(), GluLayout::pairs(), GluLayout::blocks(32), GluLayout::blocks(4)})
    for (bool with_probs : {false, true}) {
      GluSpec swiglu{Activation::kSwiGLU};
      swiglu.layout = layout;
      GluSpec generic{Activation::kClampedQGeGLU, std::numeric_limits<float>::infinity(), 1.f, 0.f, layout};
      SCOPED_TRACE(describe(swiglu) + (with_probs ? ", probs" : ""));
      const Tensor hd = to_gpu(random_tensor({T, 2 * F}, dt, rng, 4.0)), dd = to_gpu(random_tensor({T, F}, dt, rng));
      const Tensor pd = with_probs ? to_gpu(uniform_tensor({T}, DType::kFloat32, rng, 0.05, 1.0)) : Tensor();
      Tensor out[2], dh[2], re[2], dp[2];
      for (int i = 0; i < 2; ++i) {
        out[i] = poisoned_gpu({T, F}, dt), dh[i] = poisoned_gpu({T, 2 * F}, dt), re[i] = poisoned_gpu({T, F}, dt);
        dp[i] = with_probs ? poisoned_gpu({T}, DType::kFloat32) : Tensor();
        const GluSpec& spec = i == 0 ? swiglu : generic;
        glu_forward(hd, pd, r.gpu, out[i], spec);
        glu_backward(hd, pd, dd, r.gpu, {dh[i], dp[i], re[i]}, spec);
      }
      EXPECT_TRUE(bitwise_equal(to_host(out[0]), to_host(out[1]))) << "out";
      EXPECT_TRUE(bitwise_equal(to_host(dh[0]), to_host(dh[1]))) << "dh";
      EXPECT_TRUE(bitwise_equal(to_host(re[0]), to_host(re[1]))) << "recomputed out";
      if (with_probs) EXPECT_TRUE(bitwise_equal(to_host(dp[0]), to_host(dp[1]))) << "dprobs";
    }
  EXPECT_NO_THROW(r.flag.check());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuGlu,
                         ::testing::Values(DType::kBFloat16, DType::kFloat16, DType::kFloat32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// The non-gated activations in float32, element by element, over [-12, 12] (GELU's negative tail,
// where 1 + tanh(u) cancels, included). GELU on both backends against float64 (h sigmoid(2u) in
// double, accurate in the tail): each within float's error of evaluating it, whose argument 2u
// carries |2u| rounding errors of ~2^-24 into exp: 5e-7 |2u| + 2e-6 relative (a tanh.approx
// GELU is off by 1e-3 and more at h = -3); the derivative relative to max(|f'|, 1) x |d_out p|.
// srelu is the same float operations on both backends: bit for bit.
TEST(GpuElementwise, Float32IsWithinFloatErrorElementByElement) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  Rng rng;
  const int64_t T = 40, F = 1000;
  DualRouting r({0, 17, 1, 20}, T);  // 38 routed rows
  const int64_t rows = r.cpu.rows();
  const Tensor h = uniform_tensor({T, F}, DType::kFloat32, rng, -12.0, 12.0);
  const Tensor d_out = random_tensor({T, F}, DType::kFloat32, rng);
  const Tensor p = uniform_tensor({T}, DType::kFloat32, rng, 0.05, 1.0);
  for (Activation act : kElementwiseActivations) {
    SCOPED_TRACE(activation_name(act));
    const GluSpec spec = spec_of(act);
    Tensor out_c = poisoned({T, F}, DType::kFloat32), out_g = poisoned_gpu({T, F}, DType::kFloat32);
    Tensor dh_c = poisoned({T, F}, DType::kFloat32), dh_g = poisoned_gpu({T, F}, DType::kFloat32);
    glu_forward(h, p, r.cpu.layout, out_c, spec);
    glu_forward(to_gpu(h), to_gpu(p), r.gpu, out_g, spec);
    glu_backward(h, p, d_out, r.cpu.layout, {dh_c, {}, {}}, spec);
    glu_backward(to_gpu(h), to_gpu(p), to_gpu(d_out), r.gpu, {dh_g, {}, {}}, spec);
    const Tensor og = to_host(out_g), dg = to_host(dh_g);
    EXPECT_TRUE(tail_untouched(og, rows));
    EXPECT_TRUE(tail_untouched(dg, rows));
    if (act == Activation::kSReLU) {
      EXPECT_TRUE(std::memcmp(og.data(), out_c.data(), size_t(rows * F) * 4) == 0) << "out";
      EXPECT_TRUE(std::memcmp(dg.data(), dh_c.data(), size_t(rows * F) * 4) == 0) << "dh";
      continue;
    }
    double worst[2][2] = {};  // [cpu, gpu][out, dh], in units of the bound
    for (int64_t i = 0; i < rows * F; ++i) {
      const double x = h.data_as<float>()[i], pr = p.data_as<float>()[i / F], d = d_out.data_as<float>()[i];
      const double two_u = 1.5957691216057308 * (x + 0.044715 * x * x * x), s = 1.0 / (1.0 + std::exp(-two_u));
      const double f = x * s * pr, df = (s + x * s * (1 - s) * 1.5957691216057308 * (1 + 3 * 0.044715 * x * x)) * d * pr;
      const double bound = 5e-7 * std::abs(two_u) + 2e-6;
      const float* outs[2] = {out_c.data_as<float>(), og.data_as<float>()};
      const float* dhs[2] = {dh_c.data_as<float>(), dg.data_as<float>()};
      for (int b = 0; b < 2; ++b) {
        // (Below 1e-30 relative errors do not matter: the GPU's sigmoid flushes results under 2^-126.)
        worst[b][0] = std::max(worst[b][0], std::abs(outs[b][i] - f) / std::max(std::abs(f), 1e-30) / bound);
        worst[b][1] = std::max(worst[b][1], std::abs(dhs[b][i] - df) / std::max(std::abs(df), std::abs(d * pr)) / bound);
      }
    }
    EXPECT_LE(worst[1][0], 1.0) << "GPU out: worst error per element, in units of the bound";
    EXPECT_LE(worst[1][1], 1.0) << "GPU dh: worst error per element, in units of the bound";
    EXPECT_LE(worst[0][0], 1.0) << "CPU out: worst error per element, in units of the bound";
    EXPECT_LE(worst[0][1], 1.0) << "CPU dh: worst error per element, in units of the bound";
    std::printf("gelu_tanh float32 vs float64, worst per element in units of the bound: CPU out %.2f dh %.2f, "
                "GPU out %.2f dh %.2f\n", worst[0][0], worst[0][1], worst[1][0], worst[1][1]);
  }
  EXPECT_NO_THROW(r.flag.check());
}

// One expert MLP problem: host inputs, and its forward + backward outputs on a device.
struct MlpCase {
  int64_t T, H, F, W;  // W: FC1's rows (2F for a GLU, F for a non-gated activation)
  DType dt;
  GluSpec glu;
  Tensor x, w1, b1, w2, b2, p, dy;  // host; b1, b2, p undefined when absent

  MlpCase(Rng& rng, int64_t G, int64_t T_, int64_t H_, int64_t F_, DType dt_, GluSpec glu_, bool bias,
          bool probs)
      : T(T_), H(H_), F(F_), W(fc1_width(glu_, F_)), dt(dt_), glu(glu_) {
    x = random_tensor({T, H}, dt, rng);
    // 3 / sqrt(H): the pre-activation reaches past the clamp limit.
    w1 = random_tensor({G, W, H}, dt, rng, 3.0 / std::sqrt(double(H)));
    w2 = random_tensor({G, H, F}, dt, rng, 1.0 / std::sqrt(double(F)));
    if (bias) {
      b1 = random_tensor({G, W}, dt, rng, 0.5);
      b2 = random_tensor({G, H}, dt, rng, 0.5);
    }
    if (probs) p = uniform_tensor({T}, DType::kFloat32, rng, 0.05, 1.0);
    dy = random_tensor({T, H}, dt, rng);
  }
};

struct MlpOutputs {
  Tensor y, fc1_out, dx, dprobs, dw1, db1, dw2, db2;  // on the device it ran on
  bool forward_fused = false, backward_fused = false;  // which activation steps ran in GEMM epilogues
};

// Forward + backward on `device`; weight and bias gradients in float32, written.
// split_backward: FC2's half of the backward writes dL/d(fc1_out) and FC2's input
// (ExpertMlpGrads::d_fc1, ::act); FC1's gradients run from dL/d(fc1_out) and FC2's weight gradient
// from act through the grouped-linear ops, as the two-node and delayed-wgrad autograd paths do.
MlpOutputs run_mlp(const MlpCase& c, const GroupLayout& groups, Device device, bool save_fc1_out,
                   MlpFusion fusion = MlpFusion::kForwardBackward, bool split_backward = false) {
  const int64_t G = c.w1.size(0), T = c.T, H = c.H, F = c.F, W = c.W;
  auto on = [&](const Tensor& t) { return t.defined() ? t.to(device) : Tensor(); };
  auto poison = [&](Shape s, DType d) { return poisoned(s, d).to(device); };
  const Tensor x = on(c.x), w1 = on(c.w1), b1 = on(c.b1), w2 = on(c.w2), b2 = on(c.b2), p = on(c.p),
               dy = on(c.dy);
  auto param = [](const Tensor& t) { return t.defined() ? GroupedParam::packed(t) : GroupedParam(); };
  const ExpertMlpWeights weights{param(w1), param(b1), param(w2), param(b2)};
  ExpertMlpSpec spec{c.glu};
  spec.fusion = fusion;
  MlpOutputs o;
  o.y = poison({T, H}, c.dt);
  if (save_fc1_out) o.fc1_out = poison({T, W}, c.dt);
  Tensor fws = Tensor::empty({int64_t(expert_mlp_forward_workspace_size(T, H, F, c.dt, save_fc1_out, spec))},
                             DType::kUInt8, device);
  expert_mlp_forward(x, p, weights, groups, o.y, o.fc1_out, spec, {nullptr, {fws.data(), fws.nbytes(), device}},
                     &o.forward_fused);

  o.dx = poison({T, H}, c.dt);
  if (p.defined()) o.dprobs = poison({T}, DType::kFloat32);
  o.dw1 = poison({G, W, H}, DType::kFloat32);
  o.dw2 = poison({G, H, F}, DType::kFloat32);
  if (b1.defined()) o.db1 = poison({G, W}, DType::kFloat32);
  if (b2.defined()) o.db2 = poison({G, H}, DType::kFloat32);
  ExpertMlpGrads grads;
  grads.dx = o.dx;
  grads.dprobs = o.dprobs;
  grads.fc1_weight = {param(o.dw1), GradMode::kWrite};
  grads.fc2_weight = {param(o.dw2), GradMode::kWrite};
  grads.fc1_bias = {param(o.db1), GradMode::kWrite};
  grads.fc2_bias = {param(o.db2), GradMode::kWrite};
  Tensor d_fc1, act;
  if (split_backward) {
    d_fc1 = poison({T, W}, c.dt);
    act = poison({T, F}, c.dt);
    grads.d_fc1 = d_fc1;
    grads.act = act;
    grads.dx = {};
    grads.fc1_weight = {};
    grads.fc1_bias = {};
    grads.fc2_weight = {};
  }
  Tensor bws = Tensor::empty(
      {int64_t(expert_mlp_backward_workspace_size(T, H, F, c.dt, !save_fc1_out, spec, split_backward))},
      DType::kUInt8, device);
  expert_mlp_backward(dy, x, p, weights, groups, o.fc1_out, grads, spec,
                      {nullptr, {bws.data(), bws.nbytes(), device}}, &o.backward_fused);
  if (split_backward) {
    grouped_linear_wgrad(dy, act, groups, param(o.dw2), GradMode::kWrite);
    if (b1.defined()) grouped_linear_dbias(d_fc1, groups, param(o.db1), GradMode::kWrite);
    grouped_linear_wgrad(d_fc1, x, groups, param(o.dw1), GradMode::kWrite);
    grouped_linear_dgrad(d_fc1, weights.fc1_weight, groups, o.dx);
  }
  return o;
}

void expect_mlp_close(const MlpOutputs& gpu, const MlpOutputs& cpu, int64_t rows, DType dt) {
  const double tol = oracle::mlp_tolerance(dt);
  expect_close(gpu.y, cpu.y, rows, tol, "y");
  if (cpu.fc1_out.defined()) expect_close(gpu.fc1_out, cpu.fc1_out, rows, tol, "fc1_out");
  expect_close(gpu.dx, cpu.dx, rows, tol, "dx");
  if (cpu.dprobs.defined()) expect_close(gpu.dprobs, cpu.dprobs, rows, tol, "dprobs");
  // Weight-shaped gradients: every row is written (empty experts get zeros).
  auto whole = [&](const Tensor& g, const Tensor& c, const char* what) {
    if (!c.defined()) return;
    const int64_t n = c.numel() / c.size(c.dim() - 1);
    const Tensor gh = to_host(g);
    const double err = oracle::rel_error(oracle::to_matrix(gh.view().reshape({n, c.size(c.dim() - 1)})),
                                         oracle::to_matrix(c.view().reshape({n, c.size(c.dim() - 1)})));
    EXPECT_LE(err, tol) << what << ": rel. error vs the CPU backend " << err;
  };
  whole(gpu.dw1, cpu.dw1, "dw1");
  whole(gpu.dw2, cpu.dw2, "dw2");
  whole(gpu.db1, cpu.db1, "db1");
  whole(gpu.db2, cpu.db2, "db2");
}

class GpuExpertMlp : public GpuGlu {};

// Every CUDA path against the CPU backend: fused forward + backward (the activation in FC1's
// epilogue, its backward + dprobs in FC2 dgrad's; GLU layouts pairs and blocks of 8..128, and the
// non-gated activations), fused forward only, and unfused (grouped GEMMs + activation kernels; every
// layout). halves with F = 200 has no fused GLU kernel: all runs take the unfused path there.
TEST_P(GpuExpertMlp, MatchesTheCpuForEveryActivationLayoutBiasAndProbs) {
  const DType dt = GetParam();
  Rng rng;
  const int64_t H = 264;
  // 357 routed rows in buffers of 400 (57 rows a group on average: FC1's activation forward runs
  // on ping-pong tiles) or 520 (74: on the 4-stage ring), alternated so that every case and both
  // bias settings run on both.
  const std::vector<int64_t> splits{0, 1, 37, 0, 150, 40, 129};
  DualRouting routings[] = {DualRouting(splits, 400), DualRouting(splits, 520)};
  int run = 0;
  struct Case {
    GluSpec spec;
    int64_t F;
    bool fusable;
  };
  // F not a multiple of 256 everywhere: FC1's last tile and FC2 dgrad's are partial (F = 384 for a
  // non-gated FC1: its second tile has only a first batch of columns). F = 196 (not a multiple of 8:
  // 392-byte rows of act, which TMA cannot address) takes no Hopper kernel for the steps that read
  // or write act: the fused forward falls back to the unfused path.
  std::vector<Case> cases;
  for (Activation act : kGluActivations)
    for (const auto& [layout, F, fusable] :
         {std::tuple{GluLayout::halves(), 200, false}, {GluLayout::pairs(), 200, true}, {GluLayout::blocks(8), 200, true},
          {GluLayout::blocks(64), 320, true}, {GluLayout::blocks(128), 384, true}, {GluLayout::halves(), 64, true},
          {GluLayout::pairs(), 196, false}})
      cases.push_back({spec_of(act, layout), F, fusable});
  for (Activation act : kElementwiseActivations)
    for (const auto& [F, fusable] : {std::pair{200, true}, {384, true}, {64, true}, {196, false}})
      cases.push_back({spec_of(act), F, fusable});
  const bool hopper = no_hopper_reason().empty();
  bool save = false;
  for (const Case& c : cases)
    for (bool bias_and_probs : {false, true}) {
      save = !save;  // alternate saved and recomputed pre-activation
      DualRouting& r = routings[(run++ / 2 + bias_and_probs) % 2];
      const int64_t T = r.cpu.layout.capacity();
      SCOPED_TRACE(describe(c.spec) + ", F = " + std::to_string(c.F) + (bias_and_probs ? ", biases and probs" : "") +
                   (save ? ", fc1_out saved" : ", recomputed") + ", T = " + std::to_string(T));
      const MlpCase m(rng, r.cpu.num_groups(), T, H, c.F, dt, c.spec, bias_and_probs, bias_and_probs);
      const MlpOutputs cpu = run_mlp(m, r.cpu.layout, Device::cpu(), save);
      const MlpOutputs fused = run_mlp(m, r.gpu, Device::cuda(0), save, MlpFusion::kForwardBackward);
      const MlpOutputs forward_fused = run_mlp(m, r.gpu, Device::cuda(0), save, MlpFusion::kForward);
      const MlpOutputs unfused = run_mlp(m, r.gpu, Device::cuda(0), save, MlpFusion::kNone);
      {
        SCOPED_TRACE("fused forward and backward");
        expect_mlp_close(fused, cpu, r.cpu.rows(), dt);
      }
      {
        SCOPED_TRACE("fused forward");
        expect_mlp_close(forward_fused, cpu, r.cpu.rows(), dt);
      }
      {
        SCOPED_TRACE("unfused");
        expect_mlp_close(unfused, cpu, r.cpu.rows(), dt);
      }
      // What ran fused: exactly where the Hopper kernel takes the problem and the fusion asks.
      const bool can = c.fusable && hopper;
      EXPECT_EQ(fused.forward_fused, can);
      EXPECT_EQ(fused.backward_fused, can);
      EXPECT_EQ(forward_fused.forward_fused, can);
      EXPECT_FALSE(forward_fused.backward_fused);
      EXPECT_FALSE(unfused.forward_fused || unfused.backward_fused);
      if (bias_and_probs) {
        // The fused path sums dprobs per 256-feature tile, then over tiles: where it ran, its
        // bits differ from the unfused per-row tree (this catches a silent fallback).
        const Tensor a = to_host(fused.dprobs), b = to_host(unfused.dprobs);
        const bool same = std::memcmp(a.data(), b.data(), size_t(r.cpu.rows()) * 4) == 0;
        EXPECT_EQ(same, !can) << "dprobs of the fused and unfused runs "
                              << (same ? "agree bit for bit: the fused path did not run"
                                       : "differ: the fused path ran where it should not");
      }
    }
  for (DualRouting& r : routings) EXPECT_NO_THROW(r.flag.check());
}

TEST_P(GpuExpertMlp, ManyExpertsOneExpertTakingAllAndOneExpert) {
  const DType dt = GetParam();
  Rng rng;
  std::vector<int64_t> many = random_splits(rng, 256, 12);
  int64_t sum = 0;
  for (int64_t v : many) sum += v;
  std::vector<int64_t> all(8, 0);
  all[3] = 500;
  for (const GluSpec& glu : {spec_of(Activation::kClampedQGeGLU, GluLayout::pairs()), spec_of(Activation::kSReLU),
                             spec_of(Activation::kGeluTanh)})
    for (const auto& [name, splits, T] :
         {std::tuple<const char*, std::vector<int64_t>, int64_t>{"G = 256", many, sum + 7},
          {"one expert takes all", all, 512}, {"G = 1", {301}, 333}}) {
      SCOPED_TRACE(describe(glu) + ", " + name);
      DualRouting r(splits, T);
      const MlpCase c(rng, r.cpu.num_groups(), T, 128, 64, dt, glu, true, true);
      const MlpOutputs gpu = run_mlp(c, r.gpu, Device::cuda(0), true);
      expect_mlp_close(gpu, run_mlp(c, r.cpu.layout, Device::cpu(), true), r.cpu.rows(), dt);
      EXPECT_EQ(gpu.forward_fused, no_hopper_reason().empty());
      EXPECT_NO_THROW(r.flag.check());
    }
}

// FC2's half with dL/d(fc1_out) written out, then FC1's grouped-linear ops (the two-node autograd
// path): the bits of the whole backward, for every fusion and with fc1_out saved or recomputed.
TEST_P(GpuExpertMlp, Fc2HalfAndFc1OpsEqualTheWholeBackward) {
  const DType dt = GetParam();
  Rng rng;
  const int64_t T = 400, H = 264;
  DualRouting r({0, 1, 37, 0, 150, 40, 129}, T);
  for (const auto& [spec, F] : {std::pair{spec_of(Activation::kSwiGLU, GluLayout::blocks(64)), int64_t(320)},
                                {spec_of(Activation::kClampedQGeGLU, GluLayout::halves()), int64_t(200)},
                                {spec_of(Activation::kSReLU), int64_t(384)}})
    for (MlpFusion fusion : {MlpFusion::kForwardBackward, MlpFusion::kForward, MlpFusion::kNone})
      for (bool save : {true, false}) {
        SCOPED_TRACE(describe(spec) + ", fusion " + std::to_string(int(fusion)) + (save ? ", saved" : ", recomputed"));
        const MlpCase m(rng, r.cpu.num_groups(), T, H, F, dt, spec, true, true);
        const MlpOutputs whole = run_mlp(m, r.gpu, Device::cuda(0), save, fusion);
        const MlpOutputs split = run_mlp(m, r.gpu, Device::cuda(0), save, fusion, /*split_backward=*/true);
        EXPECT_EQ(split.backward_fused, whole.backward_fused);
        const Tensor* pairs[][2] = {{&split.dx, &whole.dx},   {&split.dprobs, &whole.dprobs}, {&split.dw1, &whole.dw1},
                                    {&split.db1, &whole.db1}, {&split.dw2, &whole.dw2},       {&split.db2, &whole.db2}};
        const char* names[] = {"dx", "dprobs", "dw1", "db1", "dw2", "db2"};
        for (size_t i = 0; i < std::size(pairs); ++i)
          EXPECT_TRUE(bitwise_equal(to_host(*pairs[i][0]), to_host(*pairs[i][1]))) << names[i];
      }
  EXPECT_NO_THROW(r.flag.check());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuExpertMlp, ::testing::Values(DType::kBFloat16, DType::kFloat16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

class GpuExpertMlpGraph : public ::testing::TestWithParam<MlpFusion> {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

// Offsets + the whole forward + backward (main_grad accumulation, bias grads, dprobs, dx)
// captured once; replayed with new routings, each replay equal bit for bit to eager runs (which are
// deterministic), and right.
TEST_P(GpuExpertMlpGraph, CapturedOnceReplayedWithNewRoutingsEqualsEager) {
  for (const GluSpec& glu : {spec_of(Activation::kClampedQGeGLU, GluLayout::pairs()), spec_of(Activation::kGeluTanh)}) {
  SCOPED_TRACE(describe(glu));
  Rng rng;
  const DType dt = DType::kBFloat16;
  const int64_t G = 16, T = 1024, H = 256, F = 192, W = fc1_width(glu, F);
  ExpertMlpSpec spec{glu};
  spec.fusion = GetParam();
  const MlpCase c(rng, G, T, H, F, dt, glu, true, true);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Device dev = Device::cuda(0);
  const Tensor x = to_gpu(c.x), w1 = to_gpu(c.w1), b1 = to_gpu(c.b1), w2 = to_gpu(c.w2), b2 = to_gpu(c.b2),
               p = to_gpu(c.p), dy = to_gpu(c.dy);
  const ExpertMlpWeights weights{GroupedParam::packed(w1), GroupedParam::packed(b1), GroupedParam::packed(w2),
                                 GroupedParam::packed(b2)};
  Tensor splits = Tensor::empty({G}, DType::kInt64, dev), offsets = Tensor::empty({G + 1}, DType::kInt64, dev);
  Tensor y = poisoned_gpu({T, H}, dt), fc1_out = poisoned_gpu({T, W}, dt), dx = poisoned_gpu({T, H}, dt);
  Tensor dprobs = poisoned_gpu({T}, DType::kFloat32);
  const Tensor start_w1 = random_tensor({G, W, H}, DType::kFloat32, rng),
               start_w2 = random_tensor({G, H, F}, DType::kFloat32, rng);
  Tensor mg1 = to_gpu(start_w1), mg2 = to_gpu(start_w2);  // main_grad buffers: accumulated into
  Tensor db1 = Tensor::empty({G, W}, DType::kFloat32, dev), db2 = Tensor::empty({G, H}, DType::kFloat32, dev);
  Tensor fws = Tensor::empty({int64_t(expert_mlp_forward_workspace_size(T, H, F, dt, true, spec))}, DType::kUInt8, dev);
  Tensor bws = Tensor::empty({int64_t(expert_mlp_backward_workspace_size(T, H, F, dt, false, spec))}, DType::kUInt8, dev);
  DeviceErrorFlag flag(dev);
  ExpertMlpGrads grads;
  grads.dx = dx;
  grads.dprobs = dprobs;
  grads.fc1_weight = {GroupedParam::packed(mg1), GradMode::kAccumulate};
  grads.fc2_weight = {GroupedParam::packed(mg2), GradMode::kAccumulate};
  grads.fc1_bias = {GroupedParam::packed(db1), GradMode::kWrite};
  grads.fc2_bias = {GroupedParam::packed(db2), GradMode::kWrite};
  auto step = [&] {
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag, stream);
    expert_mlp_forward(x, p, weights, groups, y, fc1_out, spec, {stream, {fws.data(), fws.nbytes(), dev}});
    expert_mlp_backward(dy, x, p, weights, groups, fc1_out, grads, spec, {stream, {bws.data(), bws.nbytes(), dev}});
  };
  auto reset = [&] {
    for (Tensor* t : {&y, &fc1_out, &dx, &dprobs}) fill_bytes(*t, kPoison, stream);
    copy_tensor(mg1, start_w1, stream);
    copy_tensor(mg2, start_w2, stream);
  };
  copy_tensor(splits, splits_tensor_for(random_splits_within(rng, G, T)), stream);
  step();  // warm-up outside capture
  CUDA_OK(cudaStreamSynchronize(stream));
  CapturedGraph graph(stream, step);
  for (int replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE("routing " + std::to_string(replay));
    std::vector<int64_t> s = random_splits_within(rng, G, T);
    if (replay == 2) s.assign(size_t(G), 0), s[7] = T - 5;  // one expert takes (almost) all
    copy_tensor(splits, splits_tensor_for(s), stream);
    reset();
    graph.launch();
    const Tensor all[] = {to_host(y), to_host(fc1_out), to_host(dx), to_host(dprobs),
                          to_host(mg1), to_host(mg2), to_host(db1), to_host(db2)};
    for (int eager = 0; eager < 2; ++eager) {
      reset();
      step();
      CUDA_OK(cudaStreamSynchronize(stream));
      const Tensor again[] = {to_host(y), to_host(fc1_out), to_host(dx), to_host(dprobs),
                              to_host(mg1), to_host(mg2), to_host(db1), to_host(db2)};
      for (size_t i = 0; i < std::size(all); ++i) EXPECT_TRUE(bitwise_equal(again[i], all[i])) << "output " << i;
    }
    // and the replayed result is right: the CPU backend from the same start
    DualRouting r(s, T);
    const MlpOutputs cpu = run_mlp(c, r.cpu.layout, Device::cpu(), true);
    expect_close(y, cpu.y, r.cpu.rows(), oracle::mlp_tolerance(dt), "replayed y");
    expect_close(dx, cpu.dx, r.cpu.rows(), oracle::mlp_tolerance(dt), "replayed dx");
    EXPECT_NO_THROW(flag.check(stream));
  }
  cudaStreamDestroy(stream);
  }
}

INSTANTIATE_TEST_SUITE_P(Fusions, GpuExpertMlpGraph,
                         ::testing::Values(MlpFusion::kNone, MlpFusion::kForward, MlpFusion::kForwardBackward),
                         [](const auto& info) { return std::string(fusion_name(info.param)); });

}  // namespace
}  // namespace moe::test
