// Seeded random tensors for the CLI's benchmarks and self-checks (values rounded to the dtype).
#pragma once

#include <cstdint>
#include <random>

#include "moe_engine/moe_engine.hpp"
#include "oracle/oracle.hpp"

namespace moe::tools {

class RandomFill {
 public:
  explicit RandomFill(uint64_t seed) : gen_(seed) {}
  Tensor normal(Shape shape, DType dtype, double stddev = 1.0) {
    std::normal_distribution<double> d(0.0, stddev);
    return fill(shape, dtype, [&] { return d(gen_); });
  }
  Tensor uniform(Shape shape, DType dtype, double lo, double hi) {
    std::uniform_real_distribution<double> d(lo, hi);
    return fill(shape, dtype, [&] { return d(gen_); });
  }
  int64_t integer(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen_);
  }

 private:
  template <class Draw>
  Tensor fill(Shape shape, DType dtype, Draw draw) {
    Tensor t = Tensor::empty(shape, dtype);
    oracle::Vector values(static_cast<size_t>(t.numel()));
    for (double& v : values) v = draw();
    oracle::assign(t, values);
    return t;
  }
  std::mt19937_64 gen_;
};

}  // namespace moe::tools
