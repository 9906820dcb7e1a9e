// The CPU grouped linear ops against the float64 oracle, on odd routings and every dtype, weight
// layout, bias mode and gradient mode.
#include "test_support.hpp"

namespace moe::test {
namespace {

struct Case {
  const char* name;
  std::vector<int64_t> splits;
  int64_t capacity, n, k;
};

// Empty and 1-row experts, sizes off every tile multiple, one expert holding all tokens,
// G = 1 and G = 256, and capacity > sum(splits) everywhere.
std::vector<Case> cases() {
  Rng rng;
  std::vector<int64_t> many = random_splits(rng, 256, 4);
  int64_t many_rows = 0;
  for (int64_t s : many) many_rows += s;
  return {
      {"single_expert", {50}, 64, 17, 33},
      {"empty_and_one_row", {0, 1, 37, 0}, 40, 24, 40},
      {"one_expert_takes_all", {0, 0, 77, 0, 0}, 80, 65, 31},
      {"off_tile_sizes", {65, 3, 129}, 200, 130, 70},
      {"g256", many, many_rows + 7, 16, 24},
  };
}

class GroupedLinear : public ::testing::TestWithParam<DType> {};

void expect_close(double err, DType dtype, const char* what) {
  EXPECT_LE(err, tolerance(dtype)) << what << ": rel. error " << err;
}

TEST_P(GroupedLinear, ForwardMatchesOracleForEveryBiasModeAndLayout) {
  const DType dt = GetParam();
  Rng rng;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Routing r(c.splits, c.capacity);
    const int64_t G = r.num_groups(), T = c.capacity;
    Tensor x = random_tensor({T, c.k}, dt, rng);
    Tensor w = random_tensor({G, c.n, c.k}, dt, rng, 1.0 / std::sqrt(double(c.k)));
    Tensor b = random_tensor({G, c.n}, dt, rng);
    Tensor p = uniform_tensor({T}, DType::kFloat32, rng, 0.0, 1.0);
    const oracle::Matrix xm = oracle::to_matrix(x), bm = oracle::to_matrix(b);
    const auto wm = oracle::to_matrices(GroupedParam::packed(w));
    const oracle::Vector pv = oracle::to_vector(p);
    for (int bias_mode = 0; bias_mode < 3; ++bias_mode) {
      SCOPED_TRACE(bias_mode == 0 ? "no bias" : bias_mode == 1 ? "bias" : "scale_bias");
      Tensor y_ref;
      for (bool per_expert : {false, true}) {
        OwnedParam wp(w, per_expert), bp(b, per_expert);
        BiasEpilogue epi;
        if (bias_mode > 0) epi.bias = bp.param;
        if (bias_mode == 2) epi.row_scale = p;
        Tensor y = poisoned({T, c.n}, dt);
        grouped_linear_forward(x, wp.param, r.layout, y, epi);
        const auto ref = oracle::linear_forward(xm, wm, r.splits, bias_mode ? bm : oracle::Matrix{},
                                                bias_mode == 2 ? pv : oracle::Vector{});
        expect_close(oracle::rel_error(oracle::to_matrix(y), ref), dt, "y");
        EXPECT_TRUE(tail_untouched(y, r.rows())) << "rows past sum(splits) were written";
        if (per_expert)
          EXPECT_TRUE(bitwise_equal(y, y_ref)) << "per-expert and packed weights differ";
        y_ref = y;
      }
    }
  }
}

TEST_P(GroupedLinear, OutputDtypeMayDifferFromInput) {
  const DType dt = GetParam();
  Rng rng;
  Routing r({5, 0, 9}, 16);
  Tensor x = random_tensor({16, 24}, dt, rng);
  Tensor w = random_tensor({3, 8, 24}, dt, rng, 0.2);
  Tensor y = poisoned({16, 8}, DType::kFloat32);
  grouped_linear_forward(x, GroupedParam::packed(w), r.layout, y);
  const auto ref = oracle::linear_forward(
      oracle::to_matrix(x), oracle::to_matrices(GroupedParam::packed(w)), r.splits, {}, {});
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(y), ref), dt == DType::kFloat64 ? 1e-7 : 2e-5);
}

TEST_P(GroupedLinear, DgradMatchesOracle) {
  const DType dt = GetParam();
  Rng rng;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Routing r(c.splits, c.capacity);
    const int64_t G = r.num_groups(), T = c.capacity;
    Tensor dy = random_tensor({T, c.n}, dt, rng);
    Tensor w = random_tensor({G, c.n, c.k}, dt, rng, 1.0 / std::sqrt(double(c.n)));
    const auto ref = oracle::linear_dgrad(oracle::to_matrix(dy),
                                          oracle::to_matrices(GroupedParam::packed(w)), r.splits);
    Tensor dx_ref;
    for (bool per_expert : {false, true}) {
      OwnedParam wp(w, per_expert);
      Tensor dx = poisoned({T, c.k}, dt);
      grouped_linear_dgrad(dy, wp.param, r.layout, dx);
      expect_close(oracle::rel_error(oracle::to_matrix(dx), ref), dt, "dx");
      EXPECT_TRUE(tail_untouched(dx, r.rows()));
      if (per_expert) EXPECT_TRUE(bitwise_equal(dx, dx_ref));
      dx_ref = dx;
    }
  }
}

TEST_P(GroupedLinear, WgradWriteAccumulateOverwrite) {
  const DType dt = GetParam();
  Rng rng;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Routing r(c.splits, c.capacity);
    const int64_t G = r.num_groups(), T = c.capacity;
    Tensor dy = random_tensor({T, c.n}, dt, rng);
    Tensor x = random_tensor({T, c.k}, dt, rng);
    const auto ref = oracle::linear_wgrad(oracle::to_matrix(dy), oracle::to_matrix(x), r.splits);
    for (bool per_expert : {false, true}) {
      SCOPED_TRACE(per_expert ? "per-expert" : "packed");
      // write, in the input dtype: empty experts get zeros
      OwnedParam dw(poisoned({G, c.n, c.k}, dt), per_expert);
      grouped_linear_wgrad(dy, x, r.layout, dw.param, GradMode::kWrite);
      expect_close(oracle::rel_error(oracle::to_matrices(dw.param), ref), dt, "dw (write)");

      // accumulate into a float32 main_grad: += ; empty experts untouched bit for bit
      Tensor start = random_tensor({G, c.n, c.k}, DType::kFloat32, rng);
      for (int64_t i = 0; i < start.numel(); i += 3)
        start.data_as<float>()[i] = -0.0f;  // -0 + 0 = +0
      OwnedParam main_grad(start.to(Device::cpu()), per_expert);
      grouped_linear_wgrad(dy, x, r.layout, main_grad.param, GradMode::kAccumulate);
      auto expected = oracle::to_matrices(GroupedParam::packed(start));
      for (int64_t g = 0; g < G; ++g)
        for (size_t i = 0; i < expected[size_t(g)].data.size(); ++i)
          expected[size_t(g)].data[i] += ref[size_t(g)].data[i];
      EXPECT_LE(oracle::rel_error(oracle::to_matrices(main_grad.param), expected), 2e-5);
      for (int64_t g = 0; g < G; ++g)
        if (r.splits[size_t(g)] == 0)
          EXPECT_TRUE(bitwise_equal(main_grad.param.expert(g), start.view().select(g)))
              << "accumulate touched empty expert " << g;

      // overwrite: = ; empty experts get zeros
      OwnedParam over(random_tensor({G, c.n, c.k}, DType::kFloat32, rng), per_expert);
      grouped_linear_wgrad(dy, x, r.layout, over.param, GradMode::kOverwrite);
      EXPECT_LE(oracle::rel_error(oracle::to_matrices(over.param), ref), 2e-5);
      for (int64_t g = 0; g < G; ++g)
        if (r.splits[size_t(g)] == 0)
          for (double v : oracle::to_matrix(over.param.expert(g)).data) ASSERT_EQ(v, 0.0);
    }
  }
}

TEST_P(GroupedLinear, DbiasAndDscalesMatchOracle) {
  const DType dt = GetParam();
  Rng rng;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    Routing r(c.splits, c.capacity);
    const int64_t G = r.num_groups(), T = c.capacity;
    Tensor dy = random_tensor({T, c.n}, dt, rng);
    Tensor b = random_tensor({G, c.n}, dt, rng);
    Tensor p = uniform_tensor({T}, DType::kFloat32, rng, 0.0, 1.0);
    const auto dym = oracle::to_matrix(dy);
    for (bool scaled : {false, true}) {
      OwnedParam db(poisoned({G, c.n}, DType::kFloat32), true);
      grouped_linear_dbias(dy, r.layout, db.param, GradMode::kWrite, scaled ? p : Tensor{});
      const auto ref =
          oracle::linear_dbias(dym, r.splits, scaled ? oracle::to_vector(p) : oracle::Vector{});
      oracle::Matrix got(G, c.n);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t n = 0; n < c.n; ++n) got(g, n) = oracle::to_matrix(db.param.expert(g))(n, 0);
      EXPECT_LE(oracle::rel_error(got, ref), 2e-5) << (scaled ? "scaled" : "plain");
    }
    Tensor dp = poisoned({T}, DType::kFloat32);
    grouped_linear_dscales(dy, GroupedParam::packed(b), r.layout, dp);
    const auto ref = oracle::linear_dscales(dym, oracle::to_matrix(b), r.splits);
    EXPECT_LE(oracle::rel_error(oracle::to_vector(dp), ref), 2e-5);
    EXPECT_TRUE(tail_untouched(dp, r.rows()));
    // accumulate adds on top
    grouped_linear_dscales(dy, GroupedParam::packed(b), r.layout, dp, /*accumulate=*/true);
    oracle::Vector twice = ref;
    for (double& v : twice) v *= 2;
    EXPECT_LE(oracle::rel_error(oracle::to_vector(dp), twice), 2e-5);
  }
}

TEST_P(GroupedLinear, StridedRowsAreHonoured) {
  const DType dt = GetParam();
  Rng rng;
  Routing r({3, 4}, 8);
  Tensor big = random_tensor({8, 40}, dt, rng);
  const TensorView x(big.data(), {8, 24}, {40, 1}, dt, Device::cpu());  // 24 of 40 columns
  Tensor w = random_tensor({2, 5, 24}, dt, rng, 0.2);
  Tensor y = poisoned({8, 5}, dt);
  grouped_linear_forward(x, GroupedParam::packed(w), r.layout, y);
  const auto ref = oracle::linear_forward(
      oracle::to_matrix(x), oracle::to_matrices(GroupedParam::packed(w)), r.splits, {}, {});
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(y), ref), tolerance(dt));
}

TEST_P(GroupedLinear, Deterministic) {
  const DType dt = GetParam();
  Rng rng;
  Routing r(random_splits(rng, 16, 40), 700);
  Tensor x = random_tensor({700, 96}, dt, rng);
  Tensor w = random_tensor({16, 80, 96}, dt, rng, 0.1);
  Tensor y1 = poisoned({700, 80}, dt), y2 = poisoned({700, 80}, dt);
  grouped_linear_forward(x, GroupedParam::packed(w), r.layout, y1);
  grouped_linear_forward(x, GroupedParam::packed(w), r.layout, y2);
  EXPECT_TRUE(bitwise_equal(y1, y2));
  Tensor d1 = poisoned({16, 80, 96}, DType::kFloat32), d2 = poisoned({16, 80, 96}, DType::kFloat32);
  grouped_linear_wgrad(y1.view().reshape({700, 80}), x, r.layout, GroupedParam::packed(d1),
                       GradMode::kWrite);
  grouped_linear_wgrad(y2.view().reshape({700, 80}), x, r.layout, GroupedParam::packed(d2),
                       GradMode::kWrite);
  EXPECT_TRUE(bitwise_equal(d1, d2));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GroupedLinear,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                           DType::kFloat64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace moe::test
