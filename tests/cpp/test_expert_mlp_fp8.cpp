// The FP8 expert MLP on the CPU backend: forward + backward against the float64 MLP of the
// unquantized inputs over odd routings, what forward keeps, gradient modes, and bad input failing
// before anything is written.
#include "fp8_mlp_support.hpp"

namespace moe::test {
namespace {

struct RoutingCase {
  const char* name;
  std::vector<int64_t> splits;
  int64_t capacity;
};

const RoutingCase kRoutings[] = {
    {"odd_with_empty_and_one_row_experts", {37, 0, 1, 90, 0, 5}, 150},
    {"one_expert_takes_all", {0, 0, 131, 0}, 140},
    {"single_expert", {77}, 80},
    {"no_rows", {0, 0, 0}, 16},
};

class Fp8MlpCpu : public ::testing::TestWithParam<DType> {};

// H and F multiples of 16 but not of 128 (partial scale blocks along every contraction), biases
// and probs on and off, every activation (the non-gated ones with FC1 of F rows).
TEST_P(Fp8MlpCpu, ForwardAndBackwardMatchTheFloat64MlpWithinFp8Error) {
  const DType dt = GetParam();
  Rng rng;
  for (const RoutingCase& rc : kRoutings) {
    for (const auto& [act, bias] : {std::pair{Activation::kSwiGLU, false}, {Activation::kClampedQGeGLU, true},
                                    {Activation::kSReLU, true}, {Activation::kGeluTanh, false}}) {
      SCOPED_TRACE(std::string(rc.name) + ", " + activation_name(act) + (bias ? " with biases and probs" : " without"));
      const Routing r(rc.splits, rc.capacity);
      const Fp8MlpCase c(rng, rc.capacity, r.num_groups(), 144, 80, dt,
                         spec_of(act, is_gated(act) ? GluLayout::pairs() : GluLayout::halves()), bias, bias);
      const Fp8MlpWeights w(c, Device::cpu());
      const Fp8MlpBuffers b(c, Device::cpu());
      // The CPU backend runs every step as its own op, whatever the fusion asks, and says so.
      bool forward_fused = true;
      Fp8GluBackwardPath backward_path = Fp8GluBackwardPath::kOnePass;
      b.step(c, w, r.layout, nullptr, GradMode::kWrite, MlpFusion::kForwardBackward, {}, &forward_fused,
             &backward_path);
      EXPECT_FALSE(forward_fused);
      EXPECT_STREQ(enum_name(backward_path), "separate");
      if (r.rows() == 0) {
        EXPECT_TRUE(tail_untouched(b.out.y, 0));
        EXPECT_TRUE(tail_untouched(b.out.dx, 0));
        continue;
      }
      expect_fp8_mlp_matches_oracle(c, r, b.out);
    }
  }
}

// The pre-activation kept for backward is FC1's output quantized by rows (what quantize_fp8 makes
// of the pre-activation the same FP8 GEMM gives), and x's columns are quantize_fp8's columns of x.
TEST_P(Fp8MlpCpu, KeepsTheQuantizedPreActivationAndTheColumnsOfX) {
  const DType dt = GetParam();
  Rng rng;
  const Routing r({21, 0, 64, 3}, 96);
  const Fp8MlpCase c(rng, 96, 4, 128, 64, dt, spec_of(Activation::kSwiGLU, GluLayout::halves()), true, true);
  const Fp8MlpWeights w(c, Device::cpu());
  const Fp8MlpBuffers b(c, Device::cpu());
  b.step(c, w, r.layout);

  OwnedRows x_rows(c.T, c.H);
  OwnedColumns x_columns(c.T, c.G, c.H);
  quantize_fp8(c.x, r.layout, x_rows.view(), x_columns.view());
  EXPECT_TRUE(bitwise_equal(x_columns.data, b.out.saved_x.data));
  EXPECT_TRUE(bitwise_equal(x_columns.scales, b.out.saved_x.scales));
  EXPECT_TRUE(bitwise_equal(x_columns.offsets, b.out.saved_x.offsets));
  Tensor h = poisoned({c.T, 2 * c.F}, dt);
  grouped_linear_forward(x_rows.view(), w.fc1.view(), r.layout, h, {GroupedParam::packed(c.b1), {}});
  OwnedRows h_rows(c.T, 2 * c.F);
  quantize_fp8(h, r.layout, h_rows.view(), {});
  EXPECT_TRUE(bitwise_equal(h_rows.data, b.out.saved_h.data));
  EXPECT_TRUE(bitwise_equal(h_rows.scales, b.out.saved_h.scales));
}

// x kept as rows (many experts of few tokens: the columns would pad each to 128): forward writes
// FC1's operand into them, backward makes the columns; within FP8's error of the float64 MLP, and
// every result but the FC1 weight gradient identical to keeping the columns.
TEST_P(Fp8MlpCpu, KeepingTheRowsOfXInsteadOfItsColumns) {
  const DType dt = GetParam();
  Rng rng;
  const Routing r({3, 0, 1, 20, 2, 0, 5, 9}, 48);
  EXPECT_TRUE(expert_mlp_fp8_keeps_x_rows(48, 8));   // columns: round_up(48 + 127 * 8, 128) = 1152
  EXPECT_FALSE(expert_mlp_fp8_keeps_x_rows(4096, 8));
  const Fp8MlpCase c(rng, 48, 8, 128, 64, dt, spec_of(Activation::kSwiGLU, GluLayout::blocks(32)), false, true);
  const Fp8MlpWeights w(c, Device::cpu());
  const Fp8MlpBuffers rows(c, Device::cpu(), /*x_rows=*/true), columns(c, Device::cpu());
  rows.step(c, w, r.layout);
  columns.step(c, w, r.layout);
  expect_fp8_mlp_matches_oracle(c, r, rows.out);
  OwnedRows x_rows(c.T, c.H);
  quantize_fp8(c.x, r.layout, x_rows.view(), {});
  EXPECT_TRUE(bitwise_equal(x_rows.data, rows.out.saved_x_rows.data));
  for (auto [a, b] : {std::pair{&rows.out.y, &columns.out.y}, {&rows.out.dx, &columns.out.dx},
                      {&rows.out.dprobs, &columns.out.dprobs}, {&rows.out.dw2, &columns.out.dw2}})
    EXPECT_TRUE(bitwise_equal(*a, *b));
  EXPECT_LE(oracle::similarity_diff(experts_of(rows.out.dw1), experts_of(columns.out.dw1)), 1e-3);
  // The workspace without the room for x's columns is too small.
  const ExpertMlpFp8Saved saved = rows.saved();
  const size_t small = expert_mlp_fp8_backward_workspace_size(c.T, c.G, c.H, c.F, dt, {c.glu});
  try {
    expert_mlp_backward(c.dy, saved, c.p, w.view(), r.layout, rows.grads(), {c.glu}, {},
                        {nullptr, {rows.bws.data(), small, Device::cpu()}});
    ADD_FAILURE() << "no error for a workspace sized without x_rows";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kWorkspace) << e.what();
    EXPECT_NE(std::string(e.what()).find("x_rows = true"), std::string::npos) << e.what();
  }
  // Both forms at once are ambiguous.
  ExpertMlpFp8Saved both = saved;
  both.x = columns.out.saved_x.view();
  try {
    expert_mlp_backward(c.dy, both, c.p, w.view(), r.layout, rows.grads(), {c.glu}, {},
                        {nullptr, {rows.bws.data(), rows.bws.nbytes(), Device::cpu()}});
    ADD_FAILURE() << "no error for both forms of x";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at most one form of x"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Fp8MlpCpu, ::testing::Values(DType::kBFloat16, DType::kFloat32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// main_grad accumulation adds exactly what a write gives: from zero, twice is 2x the written
// gradient, bit for bit; overwrite equals write.
TEST(Fp8MlpCpuModes, AccumulateAndOverwriteAgreeWithWrite) {
  Rng rng;
  const Routing r({30, 0, 17}, 50);
  const Fp8MlpCase c(rng, 50, 3, 128, 48, DType::kBFloat16, spec_of(Activation::kSwiGLU, GluLayout::pairs()),
                     true, true);
  const Fp8MlpWeights w(c, Device::cpu());
  const Fp8MlpBuffers written(c, Device::cpu()), accumulated(c, Device::cpu()), overwritten(c, Device::cpu());
  written.step(c, w, r.layout);
  for (const Tensor* t : {&accumulated.out.dw1, &accumulated.out.dw2}) fill_bytes(*t, 0);
  accumulated.step(c, w, r.layout, nullptr, GradMode::kAccumulate);
  accumulated.step(c, w, r.layout, nullptr, GradMode::kAccumulate);
  overwritten.step(c, w, r.layout, nullptr, GradMode::kOverwrite);
  for (int which = 0; which < 2; ++which) {
    const Tensor& once = which ? written.out.dw2 : written.out.dw1;
    const Tensor& twice = which ? accumulated.out.dw2 : accumulated.out.dw1;
    const oracle::Matrix a = stacked(experts_of(once)), b = stacked(experts_of(twice));
    ASSERT_EQ(a.data.size(), b.data.size());
    for (size_t i = 0; i < a.data.size(); ++i) ASSERT_EQ(2 * a.data[i], b.data[i]) << "dw" << which + 1 << " at " << i;
    EXPECT_TRUE(bitwise_equal(which ? overwritten.out.dw2 : overwritten.out.dw1, once));
  }
}

// Forward without backward keeps nothing; backward without an FC1 weight gradient needs no columns of x.
TEST(Fp8MlpCpuModes, KeptTensorsAreOptionalWhereNothingNeedsThem) {
  Rng rng;
  const Routing r({9, 40}, 64);
  const Fp8MlpCase c(rng, 64, 2, 64, 32, DType::kBFloat16, spec_of(Activation::kSwiGLU, GluLayout::pairs()),
                     false, false);
  const Fp8MlpWeights w(c, Device::cpu());
  const Fp8MlpBuffers full(c, Device::cpu());
  full.step(c, w, r.layout);
  Tensor fws = Tensor::empty({int64_t(expert_mlp_fp8_forward_workspace_size(64, 64, 32, c.dt, {c.glu}))}, DType::kUInt8);
  const ExecContext fctx{nullptr, {fws.data(), fws.nbytes(), Device::cpu()}};
  Tensor y = poisoned({64, 64}, c.dt);
  expert_mlp_forward(c.x, {}, w.view(), r.layout, y, {}, {c.glu}, {}, fctx);
  EXPECT_TRUE(bitwise_equal(y, full.out.y));

  OwnedRows h(c.T, 2 * c.F);
  expert_mlp_forward(c.x, {}, w.view(), r.layout, y, {{}, h.view()}, {c.glu}, {}, fctx);
  Tensor bws = Tensor::empty({int64_t(expert_mlp_fp8_backward_workspace_size(64, 2, 64, 32, c.dt, {c.glu}))},
                             DType::kUInt8);
  Tensor dx = poisoned({64, 64}, c.dt);
  ExpertMlpGrads g;
  g.dx = dx;
  expert_mlp_backward(c.dy, {{}, h.view()}, {}, w.view(), r.layout, g, {c.glu}, {},
                      {nullptr, {bws.data(), bws.nbytes(), Device::cpu()}});
  EXPECT_TRUE(bitwise_equal(dx, full.out.dx));
}

// Bad input: a clear error naming the argument, and nothing written.
TEST(Fp8MlpCpuValidation, BadInputFailsBeforeAnythingIsWritten) {
  Rng rng;
  const Routing r({10, 20}, 32);
  const Fp8MlpCase c(rng, 32, 2, 64, 32, DType::kBFloat16, spec_of(Activation::kSwiGLU, GluLayout::pairs()),
                     false, false);
  const Fp8MlpWeights w(c, Device::cpu());
  const Fp8MlpBuffers b(c, Device::cpu());
  const ExecContext fctx{nullptr, {b.fws.data(), b.fws.nbytes(), Device::cpu()}};
  const ExecContext bctx{nullptr, {b.bws.data(), b.bws.nbytes(), Device::cpu()}};
  const ExpertMlpFp8Saved saved{b.out.saved_x.view(), b.out.saved_h.view()};
  const auto expect_error = [&](auto&& call, ErrorCode code, const std::string& mentions) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one mentioning " << mentions;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(mentions), std::string::npos) << e.what();
    }
    EXPECT_TRUE(tail_untouched(b.out.y, 0));
    EXPECT_TRUE(tail_untouched(b.out.dx, 0));
    EXPECT_TRUE(tail_untouched(b.out.saved_h.data, 0));
  };
  const Tensor x16 = random_tensor({32, 64}, DType::kFloat16, rng);
  expect_error([&] { expert_mlp_forward(x16, {}, w.view(), r.layout, b.out.y, saved, {c.glu}, {}, fctx); },
               ErrorCode::kDType, "x: expected bfloat16 or float32");
  const Tensor x_wide = random_tensor({32, 80}, DType::kBFloat16, rng);
  expect_error([&] { expert_mlp_forward(x_wide, {}, w.view(), r.layout, b.out.y, saved, {c.glu}, {}, fctx); },
               ErrorCode::kShape, "x");
  ExpertMlpFp8Weights no_t = w.view();
  no_t.fc1.data_t = {};
  expect_error([&] { expert_mlp_backward(c.dy, saved, {}, no_t, r.layout, b.grads(), {c.glu}, {}, bctx); },
               ErrorCode::kInvalidArgument, "fc1.data_t");
  expect_error(
      [&] {
        expert_mlp_backward(c.dy, {{}, b.out.saved_h.view()}, {}, w.view(), r.layout, b.grads(), {c.glu}, {}, bctx);
      },
      ErrorCode::kInvalidArgument, "saved.x");
  expect_error(
      [&] {
        expert_mlp_forward(c.x, {}, w.view(), r.layout, b.out.y, saved, {c.glu}, {},
                           {nullptr, {b.fws.data(), b.fws.nbytes() - 1, Device::cpu()}});
      },
      ErrorCode::kWorkspace, "expert_mlp_fp8_forward_workspace_size");
  ExpertMlpGrads with_db1 = b.grads();
  with_db1.fc1_bias = {GroupedParam::packed(poisoned({2, 64}, DType::kFloat32)), GradMode::kWrite};
  expect_error([&] { expert_mlp_backward(c.dy, saved, {}, w.view(), r.layout, with_db1, {c.glu}, {}, bctx); },
               ErrorCode::kInvalidArgument, "fc1_bias");
  ExpertMlpGrads with_d_fc1 = b.grads();
  Tensor d_fc1 = poisoned({c.dy.size(0), 64}, DType::kBFloat16);
  with_d_fc1.d_fc1 = d_fc1;
  expect_error([&] { expert_mlp_backward(c.dy, saved, {}, w.view(), r.layout, with_d_fc1, {c.glu}, {}, bctx); },
               ErrorCode::kInvalidArgument, "d_fc1: the FP8 backward");
  ExpertMlpGrads with_act = b.grads();
  Tensor act = poisoned({c.dy.size(0), 32}, DType::kBFloat16);
  with_act.act = act;
  expect_error([&] { expert_mlp_backward(c.dy, saved, {}, w.view(), r.layout, with_act, {c.glu}, {}, bctx); },
               ErrorCode::kInvalidArgument, "act: the FP8 backward");
}

}  // namespace
}  // namespace moe::test
