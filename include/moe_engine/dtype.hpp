// Element types and the host-side 16-bit float storage types (bf16, fp16) with exact
// round-to-nearest-even conversion, usable from host and device code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "moe_engine/enum_names.hpp"
#include "moe_engine/export.hpp"

#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif

namespace moe {

enum class DType : uint8_t {
  kFloat64,
  kFloat32,
  kBFloat16,
  kFloat16,
  kFloat8E4M3,  // FP8 operands of the FP8 ops (moe_engine/fp8.hpp)
  kFloat8E5M2,  // reserved: no op accepts it yet
  kInt64,
  kInt32,
  kUInt8,
};

MOE_API size_t dtype_size(DType dtype);
template <>
struct EnumNames<DType> {
  static constexpr std::string_view kWhat = "dtype";
  static constexpr EnumName<DType> kNames[] = {
      {DType::kFloat64, "float64"},         {DType::kFloat32, "float32"},
      {DType::kBFloat16, "bfloat16"},       {DType::kFloat16, "float16"},
      {DType::kFloat8E4M3, "float8_e4m3"}, {DType::kFloat8E5M2, "float8_e5m2"},
      {DType::kInt64, "int64"},             {DType::kInt32, "int32"},
      {DType::kUInt8, "uint8"},             {DType::kFloat64, "fp64"},
      {DType::kFloat32, "fp32"},            {DType::kBFloat16, "bf16"},
      {DType::kFloat16, "fp16"},
  };
};
inline const char* dtype_name(DType dtype) { return enum_name(dtype); }  // "bfloat16", "float32", ...
// The names above, bf16/fp16/fp32/fp64 included.
inline DType dtype_from_name(std::string_view name) { return parse_enum<DType>(name); }
MOE_API bool is_floating(DType dtype);   // the float types the ops compute with (not fp8)

namespace detail {
MOE_HOST_DEVICE inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
MOE_HOST_DEVICE inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
}  // namespace detail

// bfloat16 storage: the upper 16 bits of an IEEE float32.
struct BFloat16 {
  uint16_t bits = 0;

  BFloat16() = default;
  MOE_HOST_DEVICE explicit BFloat16(float f) : bits(from_float(f)) {}
  MOE_HOST_DEVICE explicit operator float() const {
    return detail::bits_float(uint32_t(bits) << 16);
  }
  static MOE_HOST_DEVICE BFloat16 from_bits(uint16_t b) {
    BFloat16 v;
    v.bits = b;
    return v;
  }

  static MOE_HOST_DEVICE uint16_t from_float(float f) {
    uint32_t u = detail::float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return uint16_t(u >> 16);
  }
};

// IEEE binary16 storage.
struct Float16 {
  uint16_t bits = 0;

  Float16() = default;
  MOE_HOST_DEVICE explicit Float16(float f) : bits(from_float(f)) {}
  MOE_HOST_DEVICE explicit operator float() const { return to_float(bits); }
  static MOE_HOST_DEVICE Float16 from_bits(uint16_t b) {
    Float16 v;
    v.bits = b;
    return v;
  }

  static MOE_HOST_DEVICE float to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) return detail::bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
    if (exp != 0) return detail::bits_float(sign | ((exp + 112u) << 23) | (man << 13));
    // zero or subnormal: man * 2^-24, exact in float
    const float mag = float(man) * 5.9604644775390625e-08f;
    return sign ? -mag : mag;
  }

  static MOE_HOST_DEVICE uint16_t from_float(float f) {
    const uint32_t u = detail::float_bits(f);
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // nan, kept quiet
    if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (a >= 0x38800000u) {                                 // normal half range (>= 2^-14)
      const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // round mantissa to 10 bits, nearest even
      return uint16_t(sign | ((r - 0x38000000u) >> 13));
    }
    // subnormal half (or zero): value / 2^-24 rounded to nearest even integer
    if (a < 0x33000000u) return sign;  // < 2^-25: rounds to zero
    const uint32_t e = a >> 23;        // biased float exponent, 102..112
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // m * 2^(e-150) / 2^-24 = m >> (126 - e)
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return uint16_t(sign | q);
  }
};

template <class T>
struct dtype_of;
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::kFloat64;
};
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::kFloat32;
};
template <>
struct dtype_of<BFloat16> {
  static constexpr DType value = DType::kBFloat16;
};
template <>
struct dtype_of<Float16> {
  static constexpr DType value = DType::kFloat16;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::kInt64;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::kInt32;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = DType::kUInt8;
};
template <class T>
inline constexpr DType dtype_of_v = dtype_of<T>::value;

}  // namespace moe
