// The FP8 quantization rule of moe_engine/fp8.hpp (E4M3 conversion, the tile scale, q = E4M3(v / s)),
// shared by the CPU and CUDA quantizers so that both produce the same bytes and scale bits by
// construction: integer bit operations and IEEE division only. No fast-math and no hardware
// conversion instruction, whose rounding would have to be proven equal on every input.
#pragma once

#include <cstdint>

#include "moe_engine/dtype.hpp"  // MOE_HOST_DEVICE, float_bits / bits_float
#include "moe_engine/fp8.hpp"    // kFp8E4M3Max, kFp8Block

namespace moe::detail {

inline constexpr uint8_t kE4M3Nan = 0x7f;           // E4M3 has no infinity; 0x7f / 0xff are NaN
inline constexpr uint32_t kFloatInfBits = 0x7f800000u;
inline constexpr uint32_t kFloatQuietNanBits = 0x7fc00000u;
inline constexpr uint32_t kFloatMinNormalBits = 0x00800000u;  // 2^-126

// a / b rounded to nearest even, on the host and on the device (nvcc's `/` is IEEE too unless
// -prec-div=false; the intrinsic makes it independent of the flags).
MOE_HOST_DEVICE inline float ieee_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// float -> E4M3 (exponent bias 7, 3 mantissa bits): round to nearest even; magnitudes from 448 up
// (infinity included) saturate to +-448, since everything in (448, 464] rounds to 448 and above
// it there is no finite E4M3; NaN -> 0x7f. The sign of zero is kept. Both candidate encodings are
// computed and one selected: no branches, so a warp never diverges over its values.
MOE_HOST_DEVICE inline uint8_t e4m3_from_float(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // |v| >= 2^-6, a normal E4M3 value: drop 20 of the 23 mantissa bits to nearest even (a carry
  // moves into the exponent), then rebias the exponent from 127 to 7: (e << 3 | m) - (120 << 3).
  const uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  // |v| < 2^-6, a subnormal E4M3 value (or zero): |v| / 2^-9 < 8 rounded to the nearest even
  // integer, which adding 2^23 does exactly (the sum's unit is 1); 8 is 2^-6, code 0x08, the
  // smallest normal: the encoding continues. Exact whatever the rounding of the product
  // (a power-of-two scaling) and whether or not the compiler fuses it with the addition.
  const uint32_t subnormal = float_bits(bits_float(a) * 512.f + 8388608.f) - 0x4b000000u;
  uint32_t code = a >= 0x3c800000u ? normal : subnormal;
  code = a >= 0x43e00000u ? 0x7eu : code;  // |v| >= 448
  return a > kFloatInfBits ? kE4M3Nan : uint8_t(sign | code);
}

// Two values: `first` in the low byte. On sm_89+ one hardware conversion (round to nearest even,
// satfinite: +-448 for larger magnitudes and infinities, 0x7f for NaN) does both; the GPU suite
// checks it against e4m3_from_float on every float (test_gpu_fp8_math.cu), so both paths give the
// same bytes.
MOE_HOST_DEVICE inline uint16_t e4m3x2_from_float(float first, float second) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(MOE_FP8_SOFTWARE_CONVERSION)
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(second), "f"(first));
  return pair;
#else
  return uint16_t(e4m3_from_float(first) | e4m3_from_float(second) << 8);
#endif
}

// E4M3 -> float (exact); 0x7f / 0xff -> NaN.
MOE_HOST_DEVICE inline float e4m3_to_float(uint8_t q) {
  const uint32_t sign = uint32_t(q & 0x80u) << 24;
  if ((q & 0x7fu) == 0x7fu) return bits_float(sign | kFloatQuietNanBits);
  const uint32_t e = (q >> 3) & 0xfu, m = q & 7u;
  if (e != 0) return bits_float(sign | ((e + 120u) << 23) | (m << 20));
  return bits_float(sign | float_bits(float(m) * 0.001953125f));  // m * 2^-9
}

// |v| as the bits of a non-negative float. Their unsigned order is the order of magnitudes, with
// infinity above every finite value and NaN above infinity: a tile's amax is an integer max (exact
// and the same in any reduction order), and the tile holds a NaN or an infinity exactly when its
// amax bits are >= kFloatInfBits.
MOE_HOST_DEVICE inline uint32_t fp8_abs_bits(float v) { return float_bits(v) & 0x7fffffffu; }

// The scale of a tile from its amax bits (fp8.hpp): amax = max(amax, epsilon); s = amax / 448, at
// least 2^-126 (never a denormal), with pow2 the smallest power of two >= that (the exponent
// field bumped when any mantissa bit is set); an all-zero tile gets 1, a non-finite one NaN.
MOE_HOST_DEVICE inline float fp8_tile_scale(uint32_t amax_bits, bool pow2, float epsilon) {
  if (amax_bits >= kFloatInfBits) return bits_float(kFloatQuietNanBits);
  float amax = bits_float(amax_bits);
  if (amax < epsilon) amax = epsilon;
  if (amax == 0.f) return 1.f;
  uint32_t s = float_bits(ieee_div(amax, kFp8E4M3Max));
  if (s < kFloatMinNormalBits) s = kFloatMinNormalBits;
  if (pow2 && (s & 0x7fffffu) != 0) s = (s & 0xff800000u) + 0x800000u;
  return bits_float(s);
}

// Division by one tile's scale s. A power of two (every scale of a pow2 recipe, and 1) has an exact
// reciprocal in float for every scale the rule produces (2^-126 .. 2^126), and v * (1 / s) is then
// the same real number as v / s, rounded once: the same float, for a multiplication instead of a
// division. Other scales divide (IEEE, round to nearest even).
struct Fp8Divisor {
  float scale;
  float inverse;        // 1 / scale where exact
  bool exact_inverse;

  MOE_HOST_DEVICE explicit Fp8Divisor(float s) : scale(s) {
    const uint32_t b = float_bits(s);
    exact_inverse = (b & 0x807fffffu) == 0 && b >= kFloatMinNormalBits && b <= 0x7e800000u;  // 2^-126 .. 2^126
    inverse = bits_float((254u << 23) - b);  // 2^(127 - e) for s = 2^(e - 127)
  }
  MOE_HOST_DEVICE float quotient(float v) const { return exact_inverse ? v * inverse : ieee_div(v, scale); }
};

// One element: E4M3(v / s). A NaN scale (non-finite tile) gives NaN quotients, hence 0x7f.
MOE_HOST_DEVICE inline uint8_t fp8_quantize(float v, const Fp8Divisor& s) { return e4m3_from_float(s.quotient(v)); }
MOE_HOST_DEVICE inline uint8_t fp8_quantize(float v, float s) { return fp8_quantize(v, Fp8Divisor(s)); }

// Columns an expert of `rows` tokens occupies in the columnwise layout: whole 128-token blocks.
MOE_HOST_DEVICE inline int64_t fp8_column_span(int64_t rows) {
  return (rows + kFp8Block - 1) / kFp8Block * kFp8Block;
}

}  // namespace moe::detail
