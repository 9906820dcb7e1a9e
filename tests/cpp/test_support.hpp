// Helpers shared by the GoogleTest suites: seeded random tensors, poisoned outputs, routings.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "moe_engine/moe_engine.hpp"
#include "oracle/oracle.hpp"

namespace moe {
// gtest prints parameters with these in failure messages ("GetParam() = packed", not the bytes).
inline void PrintTo(DType dtype, std::ostream* os) { *os << dtype_name(dtype); }
inline void PrintTo(ExpertLayout layout, std::ostream* os) { *os << expert_layout_name(layout); }
inline void PrintTo(MlpFusion fusion, std::ostream* os) { *os << fusion_name(fusion); }
}  // namespace moe

namespace moe::test {

// Every test draws fresh random inputs from its own seed: the test's name mixed with
// MOE_TEST_SEED (default 20261121), so a failure is reproducible and a new seed explores new data.
inline uint64_t test_seed() {
  const char* env = std::getenv("MOE_TEST_SEED");
  const uint64_t base = env ? std::strtoull(env, nullptr, 10) : 20261121ull;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  return base ^ std::hash<std::string>{}(name);
}

// An activation spec with default activation parameters (a non-gated activation takes halves).
inline GluSpec spec_of(Activation activation, GluLayout layout = GluLayout::halves()) {
  GluSpec s;
  s.activation = activation;
  s.layout = layout;
  return s;
}

inline constexpr Activation kGluActivations[] = {Activation::kSwiGLU, Activation::kClampedQGeGLU};
inline constexpr Activation kElementwiseActivations[] = {Activation::kSReLU, Activation::kGeluTanh};

// Every valid spec over `layouts`: each GLU in each layout, each non-gated activation once.
inline std::vector<GluSpec> activation_specs(const std::vector<GluLayout>& layouts) {
  std::vector<GluSpec> specs;
  for (Activation a : kGluActivations)
    for (const GluLayout& l : layouts) specs.push_back(spec_of(a, l));
  for (Activation a : kElementwiseActivations) specs.push_back(spec_of(a));
  return specs;
}

struct Rng {
  std::mt19937_64 gen{test_seed()};
  double normal(double stddev = 1.0) { return std::normal_distribution<double>(0.0, stddev)(gen); }
  double uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(gen);
  }
  int64_t integer(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen);
  }
};

inline Tensor random_tensor(Shape shape, DType dtype, Rng& rng, double stddev = 1.0) {
  Tensor t = Tensor::empty(shape, dtype);
  oracle::Vector v(static_cast<size_t>(t.numel()));
  for (double& x : v) x = rng.normal(stddev);
  oracle::assign(t, v);
  return t;
}

inline Tensor uniform_tensor(Shape shape, DType dtype, Rng& rng, double lo, double hi) {
  Tensor t = Tensor::empty(shape, dtype);
  oracle::Vector v(static_cast<size_t>(t.numel()));
  for (double& x : v) x = rng.uniform(lo, hi);
  oracle::assign(t, v);
  return t;
}

// Outputs start poisoned so an unwritten element fails the comparison, and rows that must stay
// untouched can be checked byte for byte. 0x7f bytes are large finite values in every float dtype.
inline constexpr uint8_t kPoison = 0x7f;

inline Tensor poisoned(Shape shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  fill_bytes(t, kPoison);
  return t;
}

// True if every byte of rows [from_row, rows) of a contiguous CPU tensor is still poison.
inline bool tail_untouched(const TensorView& t, int64_t from_row) {
  const int64_t row_bytes =
      t.dim() >= 2 ? t.size(1) * int64_t(t.element_size()) : int64_t(t.element_size());
  const auto* p = static_cast<const uint8_t*>(t.data());
  for (int64_t i = from_row * row_bytes; i < int64_t(t.nbytes()); ++i)
    if (p[i] != kPoison) return false;
  return true;
}

inline bool bitwise_equal(const TensorView& a, const TensorView& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

inline bool bitwise_equal(const GroupedParam& a, const GroupedParam& b) {
  if (a.num_groups() != b.num_groups()) return false;
  for (int64_t g = 0; g < a.num_groups(); ++g)
    if (!bitwise_equal(a.expert(g), b.expert(g))) return false;
  return true;
}

// A host int64 tensor holding `splits`.
inline Tensor splits_tensor_for(const std::vector<int64_t>& splits) {
  Tensor t = Tensor::empty({int64_t(splits.size())}, DType::kInt64);
  std::memcpy(t.data(), splits.data(), splits.size() * sizeof(int64_t));
  return t;
}

// A routing on the CPU: splits, offsets and the layout over them.
struct Routing {
  std::vector<int64_t> splits;
  int64_t capacity = 0;
  Tensor splits_tensor, offsets_tensor;
  GroupLayout layout;

  Routing(std::vector<int64_t> s, int64_t cap) : splits(std::move(s)), capacity(cap) {
    const auto G = int64_t(splits.size());
    splits_tensor = splits_tensor_for(splits);
    offsets_tensor = Tensor::empty({G + 1}, DType::kInt64);
    layout = GroupLayout::compute(splits_tensor, capacity, offsets_tensor);
  }
  int64_t rows() const {
    int64_t t = 0;
    for (int64_t s : splits) t += s;
    return t;
  }
  int64_t num_groups() const { return int64_t(splits.size()); }
};

// A per-expert tensor stored packed or as separate tensors (which this object keeps alive).
struct OwnedParam {
  Tensor packed;
  std::vector<Tensor> experts;
  GroupedParam param;

  OwnedParam() = default;
  OwnedParam(const Tensor& packed_tensor, bool per_expert) : packed(packed_tensor) {
    if (!per_expert) {
      param = GroupedParam::packed(packed);
      return;
    }
    std::vector<TensorView> views;
    for (int64_t g = 0; g < packed.size(0); ++g) {
      const TensorView src = packed.view().select(g);
      experts.push_back(Tensor::empty(src.shape(), src.dtype()));
      copy_tensor(experts.back(), src);
      views.push_back(experts.back());
    }
    param = GroupedParam::per_expert(views);
  }
  bool defined() const { return param.defined(); }
};

// Splits with empty experts, 1-row experts and odd sizes, summing to at most `max_rows`.
inline std::vector<int64_t> random_splits(Rng& rng, int64_t G, int64_t max_per_expert) {
  std::vector<int64_t> s(static_cast<size_t>(G));
  for (auto& v : s) {
    const int64_t kind = rng.integer(0, 5);
    v = kind == 0 ? 0 : kind == 1 ? 1 : rng.integer(2, max_per_expert);
  }
  return s;
}

// Skewed random splits (up to 2T/G rows per expert, some experts empty or of one row) that fit a
// buffer of T rows: where the draw sums past T, experts are cut from the last one back.
inline std::vector<int64_t> random_splits_within(Rng& rng, int64_t G, int64_t T) {
  std::vector<int64_t> s = random_splits(rng, G, 2 * T / G);
  int64_t excess = -T;
  for (int64_t v : s) excess += v;
  for (size_t i = s.size(); i-- > 0 && excess > 0;) {
    const int64_t cut = std::min(excess, s[i]);
    s[i] -= cut;
    excess -= cut;
  }
  return s;
}

using oracle::head;

// The tolerance for one op against the oracle.
inline double tolerance(DType dtype) { return oracle::op_tolerance(dtype); }

// EXPECT_MOE_ERROR(statement, ErrorCode::kShape, "substring of the message")
#define EXPECT_MOE_ERROR(statement, expected_code, substring)                      \
  do {                                                                             \
    try {                                                                          \
      statement;                                                                   \
      ADD_FAILURE() << "expected moe::Error containing \"" << (substring) << "\""; \
    } catch (const ::moe::Error& e) {                                              \
      EXPECT_EQ(e.code(), (expected_code)) << e.what();                            \
      EXPECT_NE(std::string(e.what()).find(substring), std::string::npos)          \
          << "message: " << e.what() << "\nexpected to contain: " << (substring);  \
    }                                                                              \
  } while (0)

}  // namespace moe::test
