// Permute and unpermute on the CPU backend: the plan against the float64 oracle's (stability inside
// each expert, empty and full experts, capacity drops), the row moves bit for bit, the combine in
// float32, the backward passes as exact adjoints, untouched tails and the errors.
#include <cmath>
#include <optional>

#include "permute_support.hpp"

namespace moe::test {
namespace {

void expect_plan_matches_oracle(const Plan& p) {
  for (int64_t i = 0; i < p.T * p.k; ++i)
    ASSERT_EQ(p.row_of.data_as<int32_t>()[i], p.expected.row_of[size_t(i)]) << "assignment " << i;
  int64_t offset = 0;
  for (int64_t e = 0; e < p.E; ++e) {
    ASSERT_EQ(p.splits.data_as<int64_t>()[e], p.expected.splits[size_t(e)]) << "expert " << e;
    ASSERT_EQ(p.dropped.data_as<int64_t>()[e], p.expected.dropped[size_t(e)]) << "expert " << e;
    ASSERT_EQ(p.offsets.data_as<int64_t>()[e], offset) << "expert " << e;
    offset += p.expected.splits[size_t(e)];
  }
  EXPECT_EQ(p.routed(), offset);
  EXPECT_LE(p.routed(), p.R());
}

struct PlanShape {
  int64_t T, k, E;
};
constexpr PlanShape kPlanShapes[] = {{0, 2, 4},   {1, 1, 1},    {1, 8, 8},
                                     {7, 2, 3},   {33, 8, 256}, {129, 2, 16},
                                     {257, 1, 1}, {64, 8, 256}, {300, 4, 64}};

TEST(PermutePlan, MatchesTheOracle) {
  Rng rng;
  for (const PlanShape& s : kPlanShapes)
    for (std::optional<double> factor :
         {std::optional<double>(), std::optional(0.5), std::optional(1.0), std::optional(1.25),
          std::optional(4.0)})
      for (DType dtype : {DType::kInt64, DType::kInt32}) {
        SCOPED_TRACE("T " + std::to_string(s.T) + " k " + std::to_string(s.k) + " E " +
                     std::to_string(s.E) + " factor " +
                     (factor ? std::to_string(*factor) : "none") + " " + dtype_name(dtype));
        const Plan p(random_choices(rng, s.T, s.k, s.E), s.T, s.k, s.E, factor, dtype);
        expect_plan_matches_oracle(p);
        EXPECT_EQ(p.R(), permuted_rows(s.T, s.k, s.E, factor));
      }
}

// Every expert's rows hold its assignments in token order, then j order (a token may name an
// expert twice: its earlier choice comes first).
TEST(PermutePlan, StableInsideEachExpert) {
  Rng rng;
  const int64_t T = 200, k = 4, E = 6;
  std::vector<int64_t> indices;
  for (int64_t i = 0; i < T * k; ++i) indices.push_back(rng.integer(0, E - 1));  // repeats allowed
  const Plan p(indices, T, k, E);
  expect_plan_matches_oracle(p);
  std::vector<int64_t> last_row(size_t(E), -1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = indices[size_t(t * k + j)], r = p.row(t, j);
      ASSERT_GE(r, p.offsets.data_as<int64_t>()[e]);
      ASSERT_LT(r, p.offsets.data_as<int64_t>()[e + 1]);
      ASSERT_EQ(
          r, last_row[size_t(e)] < 0 ? p.offsets.data_as<int64_t>()[e] : last_row[size_t(e)] + 1);
      last_row[size_t(e)] = r;
    }
}

TEST(PermutePlan, EmptyExpertsAndOneExpertTakingAllTokens) {
  const int64_t T = 9, E = 5;
  const Plan one(std::vector<int64_t>(T, 3), T, 1, E);
  expect_plan_matches_oracle(one);
  EXPECT_EQ(std::vector<int64_t>(one.splits.data_as<int64_t>(), one.splits.data_as<int64_t>() + E),
            (std::vector<int64_t>{0, 0, 0, T, 0}));
  for (int64_t t = 0; t < T; ++t) EXPECT_EQ(one.row(t, 0), t);
  // k = 2: every token picks experts 3 then 1; expert 1's rows come first.
  std::vector<int64_t> two;
  for (int64_t t = 0; t < T; ++t) two.insert(two.end(), {3, 1});
  const Plan p(two, T, 2, E);
  expect_plan_matches_oracle(p);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(p.row(t, 1), t);
    EXPECT_EQ(p.row(t, 0), T + t);
  }
}

TEST(PermutePlan, CapacityKeepsTheFirstAssignmentsInTokenOrder) {
  EXPECT_EQ(expert_capacity(10, 1, 4, 1.0), 3);       // ceil(2.5)
  EXPECT_EQ(expert_capacity(4096, 8, 64, 1.0), 512);  // exact: no rounding up
  EXPECT_EQ(expert_capacity(4096, 8, 64, 1.25), 640);
  EXPECT_EQ(expert_capacity(3, 2, 4, 1e30), 6);  // never more than T k
  EXPECT_EQ(permuted_rows(10, 1, 4), 10);
  EXPECT_EQ(permuted_rows(10, 1, 4, 1.0), 10);           // min(T k, E C) = min(10, 12)
  EXPECT_EQ(permuted_rows(4096, 8, 64, 0.5), 64 * 256);  // the buffer shrinks with the factor
  // Sizes past the plan's int32 rows are refused, not wrapped; a huge E cannot overflow E C.
  EXPECT_EQ(permuted_rows(4096, 8, int64_t(1) << 62, 1.0), 4096 * 8);
  EXPECT_EQ(permuted_rows(INT32_MAX, 1, 1, 1.0), INT32_MAX);
  EXPECT_MOE_ERROR(permuted_rows(int64_t(1) << 40, int64_t(1) << 30, 8), ErrorCode::kInvalidArgument,
                   "more than 2^31 - 1 assignments");
  EXPECT_MOE_ERROR(expert_capacity(INT32_MAX, 2, 8, 1.0), ErrorCode::kInvalidArgument,
                   "more than 2^31 - 1 assignments");
  EXPECT_MOE_ERROR(permute_plan_workspace_size(int64_t(1) << 32, 1, 8), ErrorCode::kInvalidArgument,
                   "more than 2^31 - 1 assignments");
  // Every token on expert 0: it keeps tokens 0..2, the rest are dropped.
  const Plan p(std::vector<int64_t>(10, 0), 10, 1, 4, 1.0);
  expect_plan_matches_oracle(p);
  for (int64_t t = 0; t < 10; ++t) EXPECT_EQ(p.row(t, 0), t < 3 ? t : -1);
  EXPECT_EQ(p.splits.data_as<int64_t>()[0], 3);
  EXPECT_EQ(p.dropped.data_as<int64_t>()[0], 7);
  EXPECT_EQ(p.routed(), 3);
  // A token whose choices are all dropped, one with some kept.
  const Plan q({0, 1, 0, 1, 0, 2}, 3, 2, 3, 0.5);  // C = ceil(6 / 3 * 0.5) = 1
  expect_plan_matches_oracle(q);
  EXPECT_EQ(q.row(0, 0), 0);
  EXPECT_EQ(q.row(0, 1), 1);
  EXPECT_EQ(q.row(1, 0), -1);
  EXPECT_EQ(q.row(1, 1), -1);
  EXPECT_EQ(q.row(2, 1), 2);
}

// The expert-parallel send plan (fixed capacity): against the policy written out per destination;
// uneven destinations, a capacity dropping some, none and all, assignments the layer dropped.
TEST(SendPlan, MatchesThePolicyPerDestination) {
  Rng rng;
  struct Case {
    int64_t T, k, P, L;
  };
  for (const Case& c : {Case{0, 2, 2, 3}, Case{1, 1, 1, 1}, Case{37, 2, 2, 3}, Case{64, 4, 4, 8}, Case{300, 8, 8, 4},
                        Case{129, 1, 3, 1}})
    for (double factor : {0.1, 0.5, 1.0, 1.3, double(c.P)})
      for (bool with_kept : {false, true})
        for (DType dtype : {DType::kInt64, DType::kInt32}) {
          SCOPED_TRACE("T " + std::to_string(c.T) + " k " + std::to_string(c.k) + " P " + std::to_string(c.P) +
                       " L " + std::to_string(c.L) + " factor " + std::to_string(factor) +
                       (with_kept ? " with layer drops " : " ") + dtype_name(dtype));
          const int64_t E = c.P * c.L, C = pair_capacity(c.T, c.k, c.P, factor);
          const std::vector<int64_t> idx = random_choices(rng, c.T, c.k, E);
          std::vector<int32_t> kept;
          Tensor kept_t;
          if (with_kept) {
            kept_t = Tensor::empty({c.T, c.k}, DType::kInt32);
            for (int64_t i = 0; i < c.T * c.k; ++i) kept.push_back(rng.uniform(0, 1) < 0.2 ? -1 : int32_t(i));
            std::copy(kept.begin(), kept.end(), kept_t.data_as<int32_t>());
          }
          const SendPlanRun got(index_tensor(idx, c.T, c.k, dtype), kept_t, c.P, c.L, C, Device::cpu(), nullptr);
          const ExpectedSendPlan want = expected_send_plan(idx, kept, c.P, c.L, C);
          EXPECT_EQ(std::vector<int32_t>(got.row_send.data_as<int32_t>(), got.row_send.data_as<int32_t>() + c.T * c.k),
                    want.row_send);
          EXPECT_EQ(std::vector<int32_t>(got.ids.data_as<int32_t>(), got.ids.data_as<int32_t>() + c.P * C), want.ids);
          EXPECT_EQ(std::vector<int64_t>(got.dropped.data_as<int64_t>(), got.dropped.data_as<int64_t>() + c.P),
                    want.dropped);
          for (int64_t d = 0; d <= c.P; ++d) {
            if (d < c.P) EXPECT_EQ(got.splits.data_as<int64_t>()[d], C);
            EXPECT_EQ(got.offsets.data_as<int64_t>()[d], d * C);
          }
          EXPECT_EQ(got.groups.capacity(), c.P * C);
          if (factor >= double(c.P))
            for (int64_t n : want.dropped) EXPECT_EQ(n, 0) << "a factor of P never drops";
        }
  EXPECT_EQ(pair_capacity(10, 2, 4, 1.0), 5);
  EXPECT_EQ(pair_capacity(10, 2, 4, 1.25), 7);  // ceil(6.25)
  EXPECT_EQ(pair_capacity(10, 2, 4, 100.0), 20);  // never more than T k
  EXPECT_EQ(pair_capacity(0, 2, 4, 1.0), 0);
  EXPECT_MOE_ERROR(pair_capacity(10, 2, 4, 0.0), ErrorCode::kInvalidArgument, "factor = 0");
  EXPECT_MOE_ERROR(pair_capacity(10, 2, 0, 1.0), ErrorCode::kInvalidArgument, "ranks P = 0");
}

TEST(SendPlan, BadArgumentsAreNamed) {
  const Tensor idx = index_tensor({0, 5, 3, 1}, 2, 2);
  const Tensor row_send = Tensor::empty({2, 2}, DType::kInt32), ids = Tensor::empty({4, 1}, DType::kInt32),
               splits = Tensor::empty({2}, DType::kInt64), offsets = Tensor::empty({3}, DType::kInt64);
  EXPECT_NO_THROW(send_plan(idx, {}, 3, 2, {row_send, ids, splits, offsets, {}}, nullptr));  // P L = 6 experts
  EXPECT_MOE_ERROR(send_plan(index_tensor({0, 6, 3, 1}, 2, 2), {}, 3, 2, {row_send, ids, splits, offsets, {}}, nullptr),
                   ErrorCode::kInvalidArgument, "indices");
  EXPECT_MOE_ERROR(send_plan(idx, {}, 3, 5, {row_send, ids, splits, offsets, {}}, nullptr),
                   ErrorCode::kInvalidArgument, "capacity: expected C in [0, T k] = [0, 4], got 5");
  EXPECT_MOE_ERROR(send_plan(idx, {}, 3, 3, {row_send, ids, splits, offsets, {}}, nullptr), ErrorCode::kShape,
                   "ids");
  EXPECT_MOE_ERROR(send_plan(idx, {}, 0, 2, {row_send, ids, splits, offsets, {}}, nullptr),
                   ErrorCode::kInvalidArgument, "local_experts: expected L >= 1, got 0");
  EXPECT_MOE_ERROR(send_plan(idx, Tensor::empty({2, 3}, DType::kInt32), 3, 2, {row_send, ids, splits, offsets, {}},
                             nullptr),
                   ErrorCode::kShape, "row_of_expert");
}

TEST(PermutePlan, BadArgumentsAreNamed) {
  const int64_t T = 4, k = 2, E = 4;
  Tensor row_of = Tensor::empty({T, k}, DType::kInt32), splits = Tensor::empty({E}, DType::kInt64);
  Tensor offsets = Tensor::empty({E + 1}, DType::kInt64);
  const PermutePlanOutputs out{row_of, splits, offsets, {}};
  Tensor good = index_tensor({0, 1, 2, 3, 1, 0, 3, 2}, T, k);
  EXPECT_NO_THROW(permute_plan(good, out, std::nullopt, nullptr));
  for (double factor : {0.0, -1.0, std::nan(""), double(INFINITY)})
    EXPECT_MOE_ERROR(permute_plan(good, out, factor, nullptr), ErrorCode::kInvalidArgument,
                     "permute_plan: capacity_factor = ");
  EXPECT_MOE_ERROR(expert_capacity(4, 2, 4, 0.0), ErrorCode::kInvalidArgument,
                   "expected a finite value > 0, or none for no capacity");
  EXPECT_MOE_ERROR(
      permute_plan(index_tensor({0, 1, 5, 3, 1, 0, 3, 2}, T, k), out, std::nullopt, nullptr),
      ErrorCode::kInvalidArgument,
      "permute_plan: indices[1, 0] = 5 is not an expert in [0, E = 4)");
  EXPECT_MOE_ERROR(permute_plan(index_tensor({0, 1, 2, 3, 1, 0, 3, -1}, T, k, DType::kInt32), out,
                                std::nullopt, nullptr),
                   ErrorCode::kInvalidArgument, "indices[3, 1] = -1 is not an expert");
  EXPECT_MOE_ERROR(
      permute_plan(Tensor::zeros({T, k}, DType::kBFloat16), out, std::nullopt, nullptr),
      ErrorCode::kDType, "permute_plan: indices: expected int32 or int64, got bfloat16");
  EXPECT_MOE_ERROR(permute_plan(good, {Tensor::empty({T, k}, DType::kInt64), splits, offsets, {}},
                                std::nullopt, nullptr),
                   ErrorCode::kDType, "row_of: expected int32, got int64");
  EXPECT_MOE_ERROR(permute_plan(good, {Tensor::empty({T, 3}, DType::kInt32), splits, offsets, {}},
                                std::nullopt, nullptr),
                   ErrorCode::kShape,
                   "row_of: expected a 2-D [T, k] = [4, 2] tensor, got int32[4, 3]");
  EXPECT_MOE_ERROR(permute_plan(good, {row_of, {}, offsets, {}}, std::nullopt, nullptr),
                   ErrorCode::kShape,
                   "splits: expected a 1-D [E] tensor with E >= 1 experts, got undefined");
  EXPECT_MOE_ERROR(permute_plan(good, {row_of, splits, Tensor::empty({E}, DType::kInt64), {}},
                                std::nullopt, nullptr),
                   ErrorCode::kShape, "offsets: expected a 1-D [E + 1] = [5] tensor");
  EXPECT_MOE_ERROR(permute_plan(good, {row_of, splits, offsets, Tensor::empty({E}, DType::kInt32)},
                                std::nullopt, nullptr),
                   ErrorCode::kDType, "dropped: expected int64, got int32");
  EXPECT_MOE_ERROR(permute_plan(Tensor::zeros({T, 0}, DType::kInt64), out, std::nullopt, nullptr),
                   ErrorCode::kShape, "indices: expected k >= 1 choices per token");
  // T k past int32 rows: refused before anything is read.
  const TensorView huge(good.data(), {int64_t(1) << 30, 4}, DType::kInt32);
  EXPECT_MOE_ERROR(permute_plan(huge, out, std::nullopt, nullptr), ErrorCode::kShape,
                   "T k = 4294967296 assignments; expected at most 2^31 - 1");
  Tensor both = Tensor::empty({2 * E + 1}, DType::kInt64);
  EXPECT_MOE_ERROR(
      permute_plan(good, {row_of, both.view().slice(0, E), both.view().slice(E - 1, 2 * E), {}},
                   std::nullopt, nullptr),
      ErrorCode::kInvalidArgument, "outputs splits and offsets overlap in memory");
}

class PermuteRows : public ::testing::TestWithParam<DType> {};

// permute copies rows bit for bit, carries the probs, and leaves the rows past the routed ones
// alone.
TEST_P(PermuteRows, CopiesRowsBitForBitAndCarriesTheProbs) {
  const DType dtype = GetParam();
  Rng rng;
  for (std::optional<double> factor : {std::optional<double>(), std::optional(0.75)}) {
    const int64_t T = 37, k = 3, E = 8, H = 24;
    const Plan p(random_choices(rng, T, k, E), T, k, E, factor);
    Tensor x = random_tensor({T, H}, dtype, rng);
    Tensor probs = uniform_tensor({T, k}, DType::kFloat32, rng, 0, 1);
    Tensor x_sorted = poisoned({p.R(), H}, dtype),
           probs_sorted = poisoned({p.R()}, DType::kFloat32);
    permute(x, probs, p.row_of, p.layout, x_sorted, probs_sorted);
    const int64_t routed = p.routed();
    EXPECT_EQ(oracle::rel_error(head(oracle::to_matrix(x_sorted), routed),
                                oracle::permute(oracle::to_matrix(x), p.expected, routed)),
              0.0);
    EXPECT_EQ(
        oracle::rel_error(head(oracle::to_vector(probs_sorted), routed),
                          oracle::permute_probs(oracle::to_matrix(probs), p.expected, routed)),
        0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j)
        if (p.row(t, j) >= 0)
          ASSERT_TRUE(bitwise_equal(x_sorted.view().select(p.row(t, j)), x.view().select(t)));
    EXPECT_TRUE(tail_untouched(x_sorted, routed));
    EXPECT_TRUE(tail_untouched(probs_sorted, routed));
    if (factor) EXPECT_LT(routed, T * k);  // some assignments were dropped: a real tail
  }
}

// unpermute: float32 sums against the float64 oracle, with and without probs and drops.
TEST_P(PermuteRows, UnpermuteMatchesTheOracle) {
  const DType dtype = GetParam();
  Rng rng;
  for (std::optional<double> factor : {std::optional<double>(), std::optional(0.6)})
    for (bool with_probs : {true, false}) {
      const int64_t T = 41, k = 4, E = 16, H = 40;
      const Plan p(random_choices(rng, T, k, E), T, k, E, factor);
      Tensor out = random_tensor({p.R(), H}, dtype, rng);
      Tensor probs = with_probs ? uniform_tensor({T, k}, DType::kFloat32, rng, 0, 1) : Tensor();
      Tensor y = poisoned({T, H}, dtype);
      unpermute(out, probs, p.row_of, p.layout, y);
      const oracle::Matrix expected =
          oracle::unpermute(oracle::to_matrix(out),
                            with_probs ? oracle::to_matrix(probs) : oracle::Matrix(), p.expected);
      EXPECT_LE(oracle::rel_error(oracle::to_matrix(y), expected), tolerance(dtype));
      for (int64_t t = 0; t < T; ++t) {  // a token with every choice dropped gets exact zeros
        bool any = false;
        for (int64_t j = 0; j < k; ++j) any = any || p.row(t, j) >= 0;
        if (!any)
          for (int64_t h = 0; h < H; ++h) ASSERT_EQ(oracle::to_matrix(y)(t, h), 0.0);
      }
    }
}

// The documented order: y[t] = (((0 + p0 o0) + p1 o1) + ...) in float32, each product rounded,
// then rounded once to the dtype.
TEST(Unpermute, AddsInFloat32InChoiceOrder) {
  Rng rng;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    const int64_t T = 13, k = 8, E = 8, H = 16;
    const Plan p(random_choices(rng, T, k, E), T, k, E);
    Tensor out = random_tensor({p.R(), H}, dtype, rng);
    Tensor probs = uniform_tensor({T, k}, DType::kFloat32, rng, 0, 1);
    Tensor y = poisoned({T, H}, dtype), expected = Tensor::empty({T, H}, DType::kFloat32);
    unpermute(out, probs, p.row_of, p.layout, y);
    const oracle::Matrix o = oracle::to_matrix(out), pr = oracle::to_matrix(probs);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        float sum = 0.f;
        for (int64_t j = 0; j < k; ++j) {
          const float product = float(pr(t, j)) * float(o(p.row(t, j), h));
          sum += product;
        }
        expected.data_as<float>()[t * H + h] = sum;
      }
    Tensor rounded = Tensor::empty({T, H}, dtype);
    oracle::assign(rounded, oracle::to_matrix(expected).data);
    EXPECT_TRUE(bitwise_equal(y, rounded)) << dtype_name(dtype);
  }
}

// unpermute(permute(x)) without probs adds k copies of x[t] (its kept ones with a capacity): exact
// for 16-bit x, whose small multiples float32 holds exactly.
TEST(PermuteRoundTrip, GivesKTimesX) {
  Rng rng;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16})
    for (int64_t k : {1, 2, 8})
      for (std::optional<double> factor : {std::optional<double>(), std::optional(0.5)}) {
        const int64_t T = 29, E = 8, H = 20;
        const Plan p(random_choices(rng, T, k, E), T, k, E, factor);
        Tensor x = random_tensor({T, H}, dtype, rng);
        Tensor x_sorted = poisoned({p.R(), H}, dtype), y = poisoned({T, H}, dtype);
        permute(x, {}, p.row_of, p.layout, x_sorted, {});
        unpermute(x_sorted, {}, p.row_of, p.layout, y);
        oracle::Matrix expected = oracle::to_matrix(x);
        for (int64_t t = 0; t < T; ++t) {
          int64_t kept = 0;
          for (int64_t j = 0; j < k; ++j) kept += p.row(t, j) >= 0;
          for (int64_t h = 0; h < H; ++h)
            expected(t, h) = kept ? expected(t, h) * double(kept) : 0.0;  // +0, not -0
        }
        Tensor rounded = Tensor::empty({T, H}, dtype);
        oracle::assign(rounded, expected.data);
        EXPECT_TRUE(bitwise_equal(y, rounded)) << dtype_name(dtype) << ", k = " << k;
      }
}

double dot(const oracle::Matrix& a, const oracle::Matrix& b, int64_t rows) {
  double s = 0;
  for (int64_t i = 0; i < rows * a.cols; ++i) s += a.data[size_t(i)] * b.data[size_t(i)];
  return s;
}

// The backward passes are the adjoints: <permute(x), g> = <x, permute_backward(g)> and
// <unpermute(o, p), dy> = <o, d_out>; d_probs = <dy[t], o[row(t, j)]> = the derivative in p
// (linear). float64 tensors, so the identities hold to float64 rounding.
TEST(PermuteBackward, AreTheAdjointsOfTheForwardOps) {
  Rng rng;
  for (std::optional<double> factor : {std::optional<double>(), std::optional(0.7)}) {
    const int64_t T = 45, k = 3, E = 12, H = 17;
    const Plan p(random_choices(rng, T, k, E), T, k, E, factor);
    const int64_t R = p.R(), routed = p.routed();
    const DType f64 = DType::kFloat64;
    Tensor x = random_tensor({T, H}, f64, rng), g = random_tensor({R, H}, f64, rng);
    Tensor probs = uniform_tensor({T, k}, f64, rng, 0, 1), g_probs = random_tensor({R}, f64, rng);
    Tensor x_sorted = Tensor::zeros({R, H}, f64), probs_sorted = Tensor::zeros({R}, f64);
    Tensor dx = poisoned({T, H}, f64), d_probs = poisoned({T, k}, f64);
    permute(x, probs, p.row_of, p.layout, x_sorted, probs_sorted);
    permute_backward(g, g_probs, p.row_of, p.layout, dx, d_probs);
    const oracle::Matrix xm = oracle::to_matrix(x), gm = oracle::to_matrix(g);
    EXPECT_NEAR(dot(oracle::to_matrix(x_sorted), gm, routed), dot(xm, oracle::to_matrix(dx), T),
                1e-12 * T * H);
    const oracle::Vector gp = oracle::to_vector(g_probs), ps = oracle::to_vector(probs_sorted);
    double sorted_side = 0, token_side = 0;
    for (int64_t r = 0; r < routed; ++r) sorted_side += ps[size_t(r)] * gp[size_t(r)];
    const oracle::Matrix pm = oracle::to_matrix(probs), dpm = oracle::to_matrix(d_probs);
    for (int64_t i = 0; i < T * k; ++i) token_side += pm.data[size_t(i)] * dpm.data[size_t(i)];
    EXPECT_NEAR(sorted_side, token_side, 1e-12 * T * k);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j)
        ASSERT_EQ(dpm(t, j), p.row(t, j) < 0 ? 0.0 : gp[size_t(p.row(t, j))]);

    Tensor out = random_tensor({R, H}, f64, rng), dy = random_tensor({T, H}, f64, rng);
    Tensor y = poisoned({T, H}, f64), d_out = poisoned({R, H}, f64), dp = poisoned({T, k}, f64);
    unpermute(out, probs, p.row_of, p.layout, y);
    unpermute_backward(dy, out, probs, p.row_of, p.layout, d_out, dp);
    EXPECT_NEAR(dot(oracle::to_matrix(y), oracle::to_matrix(dy), T),
                dot(oracle::to_matrix(out), oracle::to_matrix(d_out), routed), 1e-12 * T * H);
    EXPECT_TRUE(tail_untouched(d_out, routed));
    const oracle::UnpermuteGrads expected = oracle::unpermute_backward(
        oracle::to_matrix(dy), oracle::to_matrix(out), pm, p.expected, routed);
    EXPECT_LE(oracle::rel_error(head(oracle::to_matrix(d_out), routed), expected.d_out), 1e-15);
    EXPECT_LE(oracle::rel_error(oracle::to_matrix(dp), expected.d_probs), 1e-13);
    // d_probs is the derivative of <y, dy> in p: y is linear in p, so a finite step is exact up to
    // rounding.
    const double h = 1e-3, base = dot(oracle::to_matrix(y), oracle::to_matrix(dy), T);
    Tensor stepped = Tensor::empty({T, k}, f64), y2 = Tensor::empty({T, H}, f64);
    for (int64_t i : {int64_t(0), T * k / 2, T * k - 1}) {
      copy_tensor(stepped, probs);
      stepped.data_as<double>()[i] += h;
      unpermute(out, stepped, p.row_of, p.layout, y2);
      EXPECT_NEAR((dot(oracle::to_matrix(y2), oracle::to_matrix(dy), T) - base) / h,
                  dp.data_as<double>()[i], 1e-8);
    }
  }
}

// unpermute_backward in 16 and 32 bits against the oracle; without probs d_out is a copy of dy.
TEST_P(PermuteRows, UnpermuteBackwardMatchesTheOracle) {
  const DType dtype = GetParam();
  Rng rng;
  const int64_t T = 33, k = 2, E = 8, H = 300;  // H: the dot spans several vectors per lane
  const Plan p(random_choices(rng, T, k, E), T, k, E, 0.9);
  const int64_t R = p.R(), routed = p.routed();
  Tensor out = random_tensor({R, H}, dtype, rng), dy = random_tensor({T, H}, dtype, rng);
  Tensor probs = uniform_tensor({T, k}, DType::kFloat32, rng, 0, 1);
  Tensor d_out = poisoned({R, H}, dtype), d_probs = poisoned({T, k}, DType::kFloat32);
  unpermute_backward(dy, out, probs, p.row_of, p.layout, d_out, d_probs);
  const oracle::UnpermuteGrads expected = oracle::unpermute_backward(
      oracle::to_matrix(dy), oracle::to_matrix(out), oracle::to_matrix(probs), p.expected, routed);
  EXPECT_LE(oracle::rel_error(head(oracle::to_matrix(d_out), routed), expected.d_out),
            tolerance(dtype));
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(d_probs), expected.d_probs), 1e-5);
  EXPECT_TRUE(tail_untouched(d_out, routed));

  Tensor copied = poisoned({R, H}, dtype);
  unpermute_backward(dy, {}, {}, p.row_of, p.layout, copied, {});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      if (p.row(t, j) >= 0)
        ASSERT_TRUE(bitwise_equal(copied.view().select(p.row(t, j)), dy.view().select(t)));
  EXPECT_TRUE(tail_untouched(copied, routed));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PermuteRows,
                         ::testing::Values(DType::kBFloat16, DType::kFloat16, DType::kFloat32,
                                           DType::kFloat64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// The expert MLP between permute and unpermute, with the router probs in either place: carried into
// expert order as the MLP's p (Megatron's way: unpermute without probs, the MLP's dprobs back
// through permute_backward), or applied by unpermute. Both compute p (W2 act + b2) per assignment:
// the same outputs and the same gradients, to float64 rounding.
TEST(PermuteWithExpertMlp, ProbsInTheMlpOrInUnpermuteAgree) {
  Rng rng;
  const int64_t T = 24, k = 2, E = 4, H = 6, F = 5;
  const DType f64 = DType::kFloat64;
  const ExpertMlpSpec spec{spec_of(Activation::kSwiGLU)};
  const Plan p(random_choices(rng, T, k, E), T, k, E, 1.0);
  const int64_t R = p.R();
  const Tensor w1 = random_tensor({E, 2 * F, H}, f64, rng, 0.5),
               b1 = random_tensor({E, 2 * F}, f64, rng);
  const Tensor w2 = random_tensor({E, H, F}, f64, rng, 0.5), b2 = random_tensor({E, H}, f64, rng);
  const ExpertMlpWeights weights{GroupedParam::packed(w1), GroupedParam::packed(b1),
                                 GroupedParam::packed(w2), GroupedParam::packed(b2)};
  const Tensor x = random_tensor({T, H}, f64, rng), dy = random_tensor({T, H}, f64, rng);
  const Tensor probs = uniform_tensor({T, k}, f64, rng, 0, 1);
  Tensor forward_ws = Tensor::empty(
      {int64_t(expert_mlp_forward_workspace_size(R, H, F, f64, false, spec))}, DType::kUInt8);
  Tensor backward_ws = Tensor::empty(
      {int64_t(expert_mlp_backward_workspace_size(R, H, F, f64, true, spec))}, DType::kUInt8);
  const ExecContext fctx{nullptr, {forward_ws.data(), forward_ws.nbytes(), Device::cpu()}};
  const ExecContext bctx{nullptr, {backward_ws.data(), backward_ws.nbytes(), Device::cpu()}};

  Tensor x_sorted = Tensor::zeros({R, H}, f64), probs_sorted = Tensor::zeros({R}, f64);
  permute(x, probs, p.row_of, p.layout, x_sorted, probs_sorted);
  // Probs in the MLP.
  Tensor out_a = Tensor::zeros({R, H}, f64), y_a = Tensor::empty({T, H}, f64);
  expert_mlp_forward(x_sorted, probs_sorted, weights, p.layout, out_a, {}, spec, fctx);
  unpermute(out_a, {}, p.row_of, p.layout, y_a);
  Tensor d_out_a = Tensor::zeros({R, H}, f64), dx_sorted_a = Tensor::zeros({R, H}, f64);
  Tensor dprobs_sorted_a = Tensor::zeros({R}, f64), dx_a = Tensor::empty({T, H}, f64);
  Tensor d_probs_a = Tensor::empty({T, k}, f64);
  unpermute_backward(dy, {}, {}, p.row_of, p.layout, d_out_a, {});
  ExpertMlpGrads grads_a;
  grads_a.dx = dx_sorted_a;
  grads_a.dprobs = dprobs_sorted_a;
  expert_mlp_backward(d_out_a, x_sorted, probs_sorted, weights, p.layout, {}, grads_a, spec, bctx);
  permute_backward(dx_sorted_a, dprobs_sorted_a, p.row_of, p.layout, dx_a, d_probs_a);
  // Probs in unpermute.
  Tensor out_b = Tensor::zeros({R, H}, f64), y_b = Tensor::empty({T, H}, f64);
  expert_mlp_forward(x_sorted, {}, weights, p.layout, out_b, {}, spec, fctx);
  unpermute(out_b, probs, p.row_of, p.layout, y_b);
  Tensor d_out_b = Tensor::zeros({R, H}, f64), dx_sorted_b = Tensor::zeros({R, H}, f64);
  Tensor dx_b = Tensor::empty({T, H}, f64), d_probs_b = Tensor::empty({T, k}, f64);
  unpermute_backward(dy, out_b, probs, p.row_of, p.layout, d_out_b, d_probs_b);
  ExpertMlpGrads grads_b;
  grads_b.dx = dx_sorted_b;
  expert_mlp_backward(d_out_b, x_sorted, {}, weights, p.layout, {}, grads_b, spec, bctx);
  permute_backward(dx_sorted_b, {}, p.row_of, p.layout, dx_b, {});

  EXPECT_LT(p.routed(), T * k);  // the capacity dropped some assignments
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(y_a), oracle::to_matrix(y_b)), 1e-13);
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(dx_a), oracle::to_matrix(dx_b)), 1e-13);
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(d_probs_a), oracle::to_matrix(d_probs_b)), 1e-13);
}

class PermuteValidation : public ::testing::Test {
 protected:
  Rng rng;
  Plan p{{0, 1, 2, 0, 1, 1}, 3, 2, 3};  // R = 6
  Tensor x = random_tensor({3, 8}, DType::kBFloat16, rng);
  Tensor x_sorted = Tensor::empty({6, 8}, DType::kBFloat16);
  Tensor probs = uniform_tensor({3, 2}, DType::kFloat32, rng, 0, 1);
  Tensor probs_sorted = Tensor::empty({6}, DType::kFloat32);
};

TEST_F(PermuteValidation, ShapesDtypesAndPairs) {
  EXPECT_NO_THROW(permute(x, probs, p.row_of, p.layout, x_sorted, probs_sorted));
  EXPECT_MOE_ERROR(permute(x, {}, p.row_of, p.layout, Tensor::empty({5, 8}, DType::kBFloat16), {}),
                   ErrorCode::kShape,
                   "permute: x_sorted: expected [R, H] = [6, 8], got bfloat16[5, 8]");
  EXPECT_MOE_ERROR(permute(x, {}, p.row_of, p.layout, Tensor::empty({6, 8}, DType::kFloat16), {}),
                   ErrorCode::kDType, "permute: x_sorted: expected bfloat16 like x, got float16");
  EXPECT_MOE_ERROR(permute(x, probs, p.row_of, p.layout, x_sorted, {}), ErrorCode::kInvalidArgument,
                   "permute: probs is given but probs_sorted is not");
  EXPECT_MOE_ERROR(permute(x, Tensor::zeros({3, 2}, DType::kBFloat16), p.row_of, p.layout, x_sorted,
                           probs_sorted),
                   ErrorCode::kDType,
                   "permute: probs: expected float32 (or float64 on the CPU), got bfloat16");
  EXPECT_MOE_ERROR(permute(x, Tensor::zeros({3, 3}, DType::kFloat32), p.row_of, p.layout, x_sorted,
                           probs_sorted),
                   ErrorCode::kShape,
                   "permute: probs: expected [T, k] = [3, 2], got float32[3, 3]");
  EXPECT_MOE_ERROR(permute(x, {}, Tensor::zeros({3, 2}, DType::kInt64), p.layout, x_sorted, {}),
                   ErrorCode::kDType, "permute: row_of: expected int32, got int64");
  EXPECT_MOE_ERROR(permute(x, {}, Tensor::zeros({4, 2}, DType::kInt32), p.layout, x_sorted, {}),
                   ErrorCode::kShape,
                   "permute: row_of: expected a 2-D [T, k] = [3, *] tensor, got int32[4, 2]");
  EXPECT_MOE_ERROR(permute(x, {}, p.row_of, GroupLayout(), x_sorted, {}),
                   ErrorCode::kInvalidArgument, "permute: the group layout is undefined");
  EXPECT_MOE_ERROR(
      unpermute(x_sorted, {}, p.row_of, p.layout, Tensor::empty({3, 7}, DType::kBFloat16)),
      ErrorCode::kShape, "unpermute: y: expected [T, H] = [*, 8], got bfloat16[3, 7]");
  EXPECT_MOE_ERROR(permute_backward(x_sorted, probs_sorted, p.row_of, p.layout, x, {}),
                   ErrorCode::kInvalidArgument,
                   "permute_backward: d_probs_sorted is given but d_probs is not");
  Tensor d_out = Tensor::empty({6, 8}, DType::kBFloat16),
         d_probs = Tensor::empty({3, 2}, DType::kFloat32);
  EXPECT_MOE_ERROR(unpermute_backward(x, x_sorted, {}, p.row_of, p.layout, d_out, d_probs),
                   ErrorCode::kInvalidArgument,
                   "unpermute_backward: d_probs is requested but no probs were given");
  EXPECT_MOE_ERROR(unpermute_backward(x, {}, probs, p.row_of, p.layout, d_out, d_probs),
                   ErrorCode::kInvalidArgument,
                   "unpermute_backward: d_probs is requested but out is undefined");
}

TEST_F(PermuteValidation, OverlapsAndRowMapValues) {
  Tensor both = Tensor::empty({9, 8}, DType::kBFloat16);
  EXPECT_NO_THROW(
      permute(both.view().slice(0, 3), {}, p.row_of, p.layout, both.view().slice(3, 9), {}));
  EXPECT_MOE_ERROR(
      permute(both.view().slice(2, 5), {}, p.row_of, p.layout, both.view().slice(3, 9), {}),
      ErrorCode::kInvalidArgument, "permute: output x_sorted overlaps input x in memory");
  Tensor bad = Tensor::empty({3, 2}, DType::kInt32);
  copy_tensor(bad, p.row_of);
  bad.data_as<int32_t>()[3] = 6;  // routed rows are [0, 6)
  EXPECT_MOE_ERROR(
      permute(x, {}, bad, p.layout, x_sorted, {}), ErrorCode::kInvalidArgument,
      "permute: row_of[1, 1] = 6 is neither -1 nor a routed row in [0, offsets[G] = 6)");
  bad.data_as<int32_t>()[3] = -2;
  EXPECT_MOE_ERROR(unpermute(x_sorted, {}, bad, p.layout, x), ErrorCode::kInvalidArgument,
                   "unpermute: row_of[1, 1] = -2 is neither -1 nor a routed row");
}

}  // namespace
}  // namespace moe::test
