// Seeded random tensors for the CLI's benchmarks and self-checks (values rounded to the dtype).
#pragma once

#include <cstdint>
#include <random>

#include "moe_engine/moe_engine.hpp"

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
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double v = draw();
      switch (dtype) {
        case DType::kFloat64:
          t.data_as<double>()[i] = v;
          break;
        case DType::kFloat32:
          t.data_as<float>()[i] = float(v);
          break;
        case DType::kBFloat16:
          t.data_as<BFloat16>()[i] = BFloat16(float(v));
          break;
        case DType::kFloat16:
          t.data_as<Float16>()[i] = Float16(float(v));
          break;
        default:
          throw_error(ErrorCode::kDType, "RandomFill: not a float dtype: ", dtype_name(dtype));
      }
    }
    return t;
  }
  std::mt19937_64 gen_;
};

}  // namespace moe::tools
