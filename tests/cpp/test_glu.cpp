// The activations: every GLU x layout and every non-gated activation, x probs, against the oracle;
// layout equivalence, the clamp, the non-gated functions' values and NaN, and finite-difference
// checks of the backward.
#include <cmath>
#include <cstring>
#include <limits>

#include "common/glu_math.hpp"
#include "test_support.hpp"

namespace moe::test {
namespace {

std::vector<GluLayout> layouts() {
  return {GluLayout::halves(), GluLayout::pairs(), GluLayout::blocks(4), GluLayout::blocks(32)};
}

TEST(GluLayout, ColumnMapsAndNames) {
  const int64_t F = 64;
  EXPECT_EQ(GluLayout::halves().gate_column(5, F), 5);
  EXPECT_EQ(GluLayout::halves().linear_column(5, F), 69);
  EXPECT_EQ(GluLayout::pairs().gate_column(5, F), 10);
  EXPECT_EQ(GluLayout::pairs().linear_column(5, F), 11);
  EXPECT_EQ(GluLayout::blocks(32).gate_column(33, F), 65);
  EXPECT_EQ(GluLayout::blocks(32).linear_column(33, F), 97);
  for (const GluLayout& l : layouts()) {
    EXPECT_EQ(GluLayout::parse(l.name()), l);
    // Every layout is a permutation of the 2F columns.
    std::vector<int> seen(static_cast<size_t>(2 * F), 0);
    for (int64_t j = 0; j < F; ++j) {
      ++seen[size_t(l.gate_column(j, F))];
      ++seen[size_t(l.linear_column(j, F))];
    }
    for (int v : seen) EXPECT_EQ(v, 1) << l.name();
  }
  EXPECT_MOE_ERROR(GluLayout::parse("blocks:0"), ErrorCode::kInvalidArgument,
                   "expected halves, pairs or blocks:S");
  EXPECT_MOE_ERROR(GluLayout::parse("interleaved"), ErrorCode::kInvalidArgument,
                   "unknown GLU layout 'interleaved'");
  EXPECT_EQ(parse_activation("clamped_qgeglu"), Activation::kClampedQGeGLU);
  EXPECT_MOE_ERROR(parse_activation("gelu"), ErrorCode::kInvalidArgument,
                   "expected swiglu, clamped_qgeglu, srelu or gelu_tanh");
  EXPECT_EQ(describe(spec_of(Activation::kClampedQGeGLU, GluLayout::blocks(32))),
            "clamped_qgeglu(limit=7, alpha=1.702, offset=1), blocks:32");
}

TEST(Activation, NamesGatingAndFc1Width) {
  EXPECT_EQ(parse_activation("srelu"), Activation::kSReLU);
  EXPECT_EQ(parse_activation("gelu_tanh"), Activation::kGeluTanh);
  EXPECT_STREQ(activation_name(Activation::kGeluTanh), "gelu_tanh");
  for (Activation a : kGluActivations) {
    EXPECT_TRUE(is_gated(a));
    EXPECT_EQ(fc1_width(spec_of(a, GluLayout::pairs()), 24), 48);
  }
  for (Activation a : kElementwiseActivations) {
    EXPECT_FALSE(is_gated(a));
    EXPECT_EQ(fc1_width(spec_of(a), 24), 24);
    EXPECT_EQ(describe(spec_of(a)), activation_name(a));  // no layout: it has none
  }
  // A layout other than the default for a non-gated activation is a mistake, not ignored.
  EXPECT_NO_THROW(check_glu_spec(spec_of(Activation::kSReLU), 24, "test"));
  EXPECT_MOE_ERROR(check_glu_spec(spec_of(Activation::kSReLU, GluLayout::pairs()), 24, "test"),
                   ErrorCode::kInvalidArgument,
                   "test: GLU layout pairs given for srelu, which is not gated (FC1 has F columns, no "
                   "gate/linear pairs); expected the default layout halves");
}

// The non-gated functions at known points (float64 and float32), their derivatives, and NaN.
TEST(Elementwise, ValuesDerivativesAndNaN) {
  Routing r({1}, 1);
  const double points[] = {-30.0, -6.0, -3.0, -1.0, -0.25, 0.0, 0.5, 1.0, 3.0, 12.0};
  const int64_t F = std::size(points);
  for (DType dt : {DType::kFloat64, DType::kFloat32})
    for (Activation a : kElementwiseActivations) {
      SCOPED_TRACE(std::string(activation_name(a)) + " " + dtype_name(dt));
      Tensor h = Tensor::empty({1, F}, dt);
      oracle::assign(h, oracle::Vector(std::begin(points), std::end(points)));
      Tensor out = poisoned({1, F}, dt), dh = poisoned({1, F}, dt), ones = Tensor::empty({1, F}, dt);
      oracle::assign(ones, oracle::Vector(size_t(F), 1.0));
      glu_forward(h, {}, r.layout, out, spec_of(a));
      glu_backward(h, {}, ones, r.layout, {dh, {}, {}}, spec_of(a));
      const auto o = oracle::to_matrix(out), d = oracle::to_matrix(dh);
      const double tol = dt == DType::kFloat64 ? 1e-14 : 1e-6;
      for (int64_t j = 0; j < F; ++j) {
        const double x = points[j];
        double f, df;
        if (a == Activation::kSReLU) {
          f = x > 0 ? x * x : 0.0;
          df = x > 0 ? 2 * x : 0.0;
        } else {  // the textbook form
          const double k = 0.7978845608028654, t = std::tanh(k * (x + 0.044715 * x * x * x));
          f = 0.5 * x * (1 + t);
          df = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
        }
        // Relative to the value (GELU's tail far below 1 included: no cancellation), or absolute
        // near 0.
        EXPECT_NEAR(o(0, j), f, tol * std::max(1.0, std::abs(f)) + (std::abs(f) < 1e-3 ? tol * 1e-3 : 0))
            << "f(" << x << ")";
        EXPECT_NEAR(d(0, j), df, tol * std::max(1.0, std::abs(df)) * 4) << "f'(" << x << ")";
      }
      // GELU's negative tail: relative accuracy where 1 + tanh(u) cancels (f(-3) ~ -3.6e-3).
      if (a == Activation::kGeluTanh)
        EXPECT_NEAR(o(0, 2) / -0.0036373920817, 1.0, dt == DType::kFloat64 ? 1e-10 : 1e-5);
      // NaN stays NaN, forward and backward.
      oracle::assign(h, oracle::Vector(size_t(F), std::nan("")));
      glu_forward(h, {}, r.layout, out, spec_of(a));
      glu_backward(h, {}, ones, r.layout, {dh, {}, {}}, spec_of(a));
      EXPECT_TRUE(std::isnan(oracle::to_matrix(out)(0, 0)));
      EXPECT_TRUE(std::isnan(oracle::to_matrix(dh)(0, 0)));
    }
}

// SwiGLU is clamped_qgeglu with limit inf, alpha 1 and offset 0: the kernels that take SwiGLU's
// constants at compile time (GluMath::swiglu, swiglu_forward) rely on it. On the CPU backend the
// two specs give the same bits; swiglu_forward is forward() with those constants, bit for bit,
// signed zeros and infinities included (its dropped clamps only touch a NaN's payload).
TEST(GluMath, SwigluIsClampedQGeGLUWithItsConstants) {
  using Math = detail::GluMath<float>;
  const Math a = Math::swiglu(), b = Math::from(spec_of(Activation::kSwiGLU));
  const GluSpec generic{Activation::kClampedQGeGLU, std::numeric_limits<float>::infinity(), 1.f, 0.f};
  const Math c = Math::from(generic);
  for (const Math& m : {b, c}) {
    EXPECT_EQ(std::memcmp(&a.limit, &m.limit, sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(&a.alpha, &m.alpha, sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(&a.offset, &m.offset, sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(&a.neg_alpha_log2e, &m.neg_alpha_log2e, sizeof(float)), 0);
  }
  const float inf = std::numeric_limits<float>::infinity();
  const float values[] = {0.f, -0.f, 1e-30f, -1e-30f, 0.5f, -0.5f, 3.f, -3.f, 80.f, -80.f, 1e30f, -1e30f, inf, -inf};
  for (float g : values)
    for (float l : values) {
      const float x = Math::swiglu_forward(g, l), y = a.forward(g, l);
      EXPECT_TRUE(std::memcmp(&x, &y, sizeof(float)) == 0 || (std::isnan(x) && std::isnan(y)))
          << "g = " << g << ", l = " << l << ": " << x << " vs " << y;
    }
  Rng rng;
  Routing r({3, 0, 40, 1}, 50);
  for (const GluLayout& layout : layouts())
    for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
      SCOPED_TRACE(layout.name() + " " + dtype_name(dt));
      GluSpec swiglu{Activation::kSwiGLU}, clamped = generic;
      swiglu.layout = clamped.layout = layout;
      const int64_t F = 32;
      const Tensor h = random_tensor({50, 2 * F}, dt, rng, 6.0), d = random_tensor({50, F}, dt, rng);
      const Tensor p = uniform_tensor({50}, DType::kFloat32, rng, 0.05, 1.0);
      Tensor out[2], dh[2], dp[2];
      for (int i = 0; i < 2; ++i) {
        out[i] = poisoned({50, F}, dt), dh[i] = poisoned({50, 2 * F}, dt), dp[i] = poisoned({50}, DType::kFloat32);
        glu_forward(h, p, r.layout, out[i], i == 0 ? swiglu : clamped);
        glu_backward(h, p, d, r.layout, {dh[i], dp[i], {}}, i == 0 ? swiglu : clamped);
      }
      EXPECT_TRUE(bitwise_equal(out[0], out[1]));
      EXPECT_TRUE(bitwise_equal(dh[0], dh[1]));
      EXPECT_TRUE(bitwise_equal(dp[0], dp[1]));
    }
}

class Glu : public ::testing::TestWithParam<DType> {};

// Values spread past the clamp limit (|x| up to ~20) so both clamps are exercised.
Tensor wide_tensor(Shape shape, DType dt, Rng& rng) { return random_tensor(shape, dt, rng, 6.0); }

TEST_P(Glu, ForwardAndBackwardMatchOracle) {
  const DType dt = GetParam();
  Rng rng;
  const int64_t F = 64, T = 45;
  Routing r({0, 17, 1, 20}, T);  // 38 rows used, 7 past the end
  for (const GluSpec& spec : activation_specs(layouts()))
      for (bool with_probs : {false, true}) {
        SCOPED_TRACE(describe(spec) + (with_probs ? ", probs" : ""));
        const int64_t W = fc1_width(spec, F);
        Tensor h = wide_tensor({T, W}, dt, rng);
        Tensor d_out = random_tensor({T, F}, dt, rng);
        Tensor p = uniform_tensor({T}, DType::kFloat32, rng, 0.0, 1.0);
        const TensorView probs = with_probs ? TensorView(p) : TensorView();
        // The oracle sees only the rows that belong to experts.
        const oracle::Vector pv =
            with_probs ? head(oracle::to_vector(p), r.rows()) : oracle::Vector{};
        const oracle::Matrix hm = head(oracle::to_matrix(h), r.rows());
        const oracle::Matrix dm = head(oracle::to_matrix(d_out), r.rows());

        Tensor out = poisoned({T, F}, dt);
        glu_forward(h, probs, r.layout, out, spec);
        const auto out_ref = oracle::glu_forward(hm, pv, spec);
        EXPECT_LE(oracle::rel_error(oracle::to_matrix(out), out_ref), tolerance(dt));
        EXPECT_TRUE(tail_untouched(out, r.rows()));

        Tensor dh = poisoned({T, W}, dt);
        Tensor dprobs = poisoned({T}, DType::kFloat32);
        Tensor out2 = poisoned({T, F}, dt);
        glu_backward(h, probs, d_out, r.layout,
                     {dh, with_probs ? TensorView(dprobs) : TensorView(), out2}, spec);
        const auto g = oracle::glu_backward(hm, pv, dm, spec);
        EXPECT_LE(oracle::rel_error(oracle::to_matrix(dh), g.dh), tolerance(dt));
        EXPECT_TRUE(tail_untouched(dh, r.rows()));
        EXPECT_TRUE(bitwise_equal(out2, out))
            << "backward's recomputed output differs from forward";
        if (with_probs) {
          EXPECT_LE(oracle::rel_error(oracle::to_vector(dprobs), g.dprobs),
                    std::max(tolerance(dt), 1e-5));
          EXPECT_TRUE(tail_untouched(dprobs, r.rows()));
        }
      }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Glu,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                           DType::kFloat64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// The three layouts are the same function up to a column permutation: bit-identical results.
TEST(GluLayouts, IdenticalAfterColumnPermutation) {
  Rng rng;
  const int64_t F = 96, T = 33;
  Routing r({11, 0, 22}, T);
  for (Activation act : kGluActivations) {
    Tensor h = wide_tensor({T, 2 * F}, DType::kBFloat16, rng);
    Tensor d_out = random_tensor({T, F}, DType::kBFloat16, rng);
    Tensor p = uniform_tensor({T}, DType::kFloat32, rng, 0.0, 1.0);
    const GluSpec halves = spec_of(act, GluLayout::halves());
    Tensor out_h = poisoned({T, F}, DType::kBFloat16),
           dh_h = poisoned({T, 2 * F}, DType::kBFloat16);
    Tensor dp_h = poisoned({T}, DType::kFloat32);
    glu_forward(h, p, r.layout, out_h, halves);
    glu_backward(h, p, d_out, r.layout, {dh_h, dp_h, {}}, halves);
    for (const GluLayout& layout :
         {GluLayout::pairs(), GluLayout::blocks(32), GluLayout::blocks(3)}) {
      SCOPED_TRACE(layout.name());
      const GluSpec spec = spec_of(act, layout);
      // Move column j of each half to where `layout` keeps it.
      Tensor hp = Tensor::empty({T, 2 * F}, DType::kBFloat16);
      auto permute = [&](const Tensor& src, const Tensor& dst, bool forward) {
        const auto* s = src.data_as<BFloat16>();
        auto* d = dst.data_as<BFloat16>();
        for (int64_t row = 0; row < T; ++row)
          for (int64_t j = 0; j < F; ++j) {
            const int64_t from[2] = {j, F + j};
            const int64_t to[2] = {layout.gate_column(j, F), layout.linear_column(j, F)};
            for (int k = 0; k < 2; ++k) {
              const int64_t a = forward ? from[k] : to[k], b = forward ? to[k] : from[k];
              d[row * 2 * F + b] = s[row * 2 * F + a];
            }
          }
      };
      permute(h, hp, true);
      Tensor out = poisoned({T, F}, DType::kBFloat16), dh = poisoned({T, 2 * F}, DType::kBFloat16);
      Tensor dp = poisoned({T}, DType::kFloat32);
      glu_forward(hp, p, r.layout, out, spec);
      glu_backward(hp, p, d_out, r.layout, {dh, dp, {}}, spec);
      EXPECT_TRUE(bitwise_equal(out, out_h));
      EXPECT_TRUE(bitwise_equal(dp, dp_h));
      Tensor dh_back = poisoned({T, 2 * F}, DType::kBFloat16);
      permute(dh, dh_back, false);
      EXPECT_TRUE(bitwise_equal(dh_back, dh_h));
    }
  }
}

TEST(GluClamp, GradientsVanishExactlyPastTheLimit) {
  const int64_t F = 4, T = 1;
  Routing r({1}, T);
  GluSpec spec = spec_of(Activation::kClampedQGeGLU, GluLayout::halves());
  Tensor h = Tensor::empty({T, 2 * F}, DType::kFloat32);
  // gate: below, at, above the limit, far above; linear: inside, at +limit, above, below -limit
  const float v[8] = {3.f, 7.f, 7.5f, 40.f, 1.f, 7.f, 9.f, -8.f};
  std::memcpy(h.data(), v, sizeof(v));
  Tensor d_out = Tensor::empty({T, F}, DType::kFloat32);
  for (int j = 0; j < F; ++j) d_out.data_as<float>()[j] = 1.f;
  Tensor dh = poisoned({T, 2 * F}, DType::kFloat32);
  glu_backward(h, {}, d_out, r.layout, {dh, {}, {}}, spec);
  const float* g = dh.data_as<float>();
  EXPECT_NE(g[0], 0.f);  // gate 3 < 7
  EXPECT_NE(g[1], 0.f);  // gate == limit still passes
  EXPECT_EQ(g[2], 0.f);  // gate > limit
  EXPECT_EQ(g[3], 0.f);
  EXPECT_NE(g[4], 0.f);  // linear inside
  EXPECT_NE(g[5], 0.f);  // |linear| == limit passes
  EXPECT_EQ(g[6], 0.f);  // linear > limit
  EXPECT_EQ(g[7], 0.f);  // linear < -limit
  // and the forward uses the clamped values: gate 40 behaves like gate 7
  Tensor out = poisoned({T, F}, DType::kFloat32);
  glu_forward(h, {}, r.layout, out, spec);
  const double g7 = 7.0 / (1.0 + std::exp(-1.702 * 7.0));
  EXPECT_NEAR(out.data_as<float>()[3], g7 * (-7.0 + 1.0), 1e-5);
}

// Central differences in float64 of L = <out, R> w.r.t. h and probs. Inputs avoid the clamp kinks.
// In place (dh = h, out = d_out): the same bytes as separate buffers that start as copies of
// the inputs (rows past the routed ones keep them).
TEST(GluBackward, InPlaceEqualsSeparateBuffers) {
  Rng rng;
  const int64_t F = 64, T = 21;
  Routing r({7, 0, 1, 9}, T);
  for (DType dt : {DType::kBFloat16, DType::kFloat32})
      for (const GluSpec& spec : activation_specs(layouts())) {
        SCOPED_TRACE(describe(spec) + " " + dtype_name(dt));
        const Tensor h = wide_tensor({T, fc1_width(spec, F)}, dt, rng), d_out = random_tensor({T, F}, dt, rng);
        const Tensor p = uniform_tensor({T}, DType::kFloat32, rng, 0.05, 1.0);
        const Tensor dh = h.to(Device::cpu()), out = d_out.to(Device::cpu());
        const Tensor hi = h.to(Device::cpu()), di = d_out.to(Device::cpu());
        Tensor dp = poisoned({T}, DType::kFloat32), dpi = poisoned({T}, DType::kFloat32);
        glu_backward(h, p, d_out, r.layout, {dh, dp, out}, spec);
        glu_backward(hi, p, di, r.layout, {hi, dpi, di}, spec);
        EXPECT_TRUE(bitwise_equal(hi, dh));
        EXPECT_TRUE(bitwise_equal(di, out));
        EXPECT_TRUE(bitwise_equal(dpi, dp));
      }
}

TEST(GluBackward, AgreesWithFiniteDifferences) {
  Rng rng;
  const int64_t F = 6, T = 5;
  Routing r({2, 0, 3}, T);
  for (const GluSpec& spec : activation_specs({GluLayout::halves(), GluLayout::pairs(), GluLayout::blocks(2)})) {
      SCOPED_TRACE(describe(spec));
      const int64_t W = fc1_width(spec, F);
      Tensor h = wide_tensor({T, W}, DType::kFloat64, rng);
      for (int64_t i = 0; i < h.numel(); ++i) {  // keep 1e-3 away from +-limit and srelu's kink at 0
        double& v = h.data_as<double>()[i];
        if (std::abs(std::abs(v) - 7.0) < 1e-3 || std::abs(v) < 1e-3) v += 0.01;
      }
      Tensor p = uniform_tensor({T}, DType::kFloat64, rng, 0.1, 1.0);
      Tensor R = random_tensor({T, F}, DType::kFloat64, rng);
      auto loss = [&]() {
        Tensor out = Tensor::zeros({T, F}, DType::kFloat64);
        glu_forward(h, p, r.layout, out, spec);
        double l = 0;
        for (int64_t i = 0; i < out.numel(); ++i)
          l += out.data_as<double>()[i] * R.data_as<double>()[i];
        return l;
      };
      Tensor dh = Tensor::zeros({T, W}, DType::kFloat64);
      Tensor dp = Tensor::zeros({T}, DType::kFloat64);
      glu_backward(h, p, R, r.layout, {dh, dp, {}}, spec);
      const double eps = 1e-6;
      auto check = [&](double* x, double analytic, const char* what, int64_t i) {
        const double saved = *x;
        *x = saved + eps;
        const double up = loss();
        *x = saved - eps;
        const double down = loss();
        *x = saved;
        const double numeric = (up - down) / (2 * eps);
        EXPECT_NEAR(analytic, numeric, 1e-6 * (1 + std::abs(numeric))) << what << "[" << i << "]";
      };
      for (int64_t i = 0; i < r.rows() * W; ++i)
        check(h.data_as<double>() + i, dh.data_as<double>()[i], "dh", i);
      for (int64_t i = 0; i < r.rows(); ++i)
        check(p.data_as<double>() + i, dp.data_as<double>()[i], "dprobs", i);
    }
}

}  // namespace
}  // namespace moe::test
