// Loading any float dtype into the CPU backend's accumulator type and storing it back (rounding
// to nearest even). One switch per row, typed loops inside.
#pragma once

#include <cstdint>

#include "moe_engine/dtype.hpp"
#include "moe_engine/error.hpp"
#include "moe_engine/tensor.hpp"

namespace moe::cpu {

inline double float_value(double v) { return v; }
inline float float_value(float v) { return v; }
inline float float_value(BFloat16 v) { return float(v); }
inline float float_value(Float16 v) { return float(v); }

// dst[i] = src[i * stride], i < n
template <class Acc>
void load(const void* src, DType dtype, int64_t n, int64_t stride, Acc* dst) {
  auto run = [&](const auto* p) {
    if (stride == 1)
      for (int64_t i = 0; i < n; ++i) dst[i] = Acc(float_value(p[i]));
    else
      for (int64_t i = 0; i < n; ++i) dst[i] = Acc(float_value(p[i * stride]));
  };
  switch (dtype) {
    case DType::kFloat64:
      return run(static_cast<const double*>(src));
    case DType::kFloat32:
      return run(static_cast<const float*>(src));
    case DType::kBFloat16:
      return run(static_cast<const BFloat16*>(src));
    case DType::kFloat16:
      return run(static_cast<const Float16*>(src));
    default:
      throw_error(ErrorCode::kInternal, "cpu::load: unsupported dtype ", dtype_name(dtype));
  }
}

// dst[i] = src[i], i < n, rounded to dtype
template <class Acc>
void store(const Acc* src, int64_t n, void* dst, DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      for (int64_t i = 0; i < n; ++i) static_cast<double*>(dst)[i] = double(src[i]);
      return;
    case DType::kFloat32:
      for (int64_t i = 0; i < n; ++i) static_cast<float*>(dst)[i] = float(src[i]);
      return;
    case DType::kBFloat16:
      for (int64_t i = 0; i < n; ++i) static_cast<BFloat16*>(dst)[i] = BFloat16(float(src[i]));
      return;
    case DType::kFloat16:
      for (int64_t i = 0; i < n; ++i) static_cast<Float16*>(dst)[i] = Float16(float(src[i]));
      return;
    default:
      throw_error(ErrorCode::kInternal, "cpu::store: unsupported dtype ", dtype_name(dtype));
  }
}

// Address of element (row, col) of a 2-D view with unit column stride.
inline char* element_ptr(const TensorView& t, int64_t row, int64_t col) {
  return static_cast<char*>(t.data()) + (row * t.stride(0) + col) * int64_t(t.element_size());
}

// Address of element i of a 1-D view.
inline char* element_ptr_1d(const TensorView& t, int64_t i) {
  return static_cast<char*>(t.data()) + i * t.stride(0) * int64_t(t.element_size());
}

// Element i of a 1-D view of any float dtype.
template <class Acc>
Acc load_at(const TensorView& t, int64_t i) {
  Acc v;
  load(element_ptr_1d(t, i), t.dtype(), 1, 1, &v);
  return v;
}

// Calls f(Acc{}) with the accumulator type for an input dtype: float64 inputs accumulate in
// float64, everything else in float32.
template <class F>
void with_accumulator(DType input, F&& f) {
  if (input == DType::kFloat64)
    f(double{});
  else
    f(float{});
}

}  // namespace moe::cpu
