// The FP8 quantization rule of moe_engine/fp8.hpp (E4M3 conversion, the tile multiplier m and
// scale s, q = E4M3(v * m)), shared by the CPU and CUDA quantizers so that both produce the same
// bytes and scale bits by construction: integer bit operations, IEEE division and multiplication
// only. No fast-math; the hardware conversion instruction is used only where a GPU test proves it
// equal to the software conversion on every float.
#pragma once

#include <cstdint>

#include "common/ieee_math.hpp"  // ieee_div
#include "moe_engine/dtype.hpp"  // MOE_HOST_DEVICE, float_bits / bits_float
#include "moe_engine/fp8.hpp"    // kFp8E4M3Max, kFp8Block

namespace moe::detail {

inline constexpr uint8_t kE4M3Nan = 0x7f;           // E4M3 has no infinity; 0x7f / 0xff are NaN
inline constexpr uint32_t kFloatInfBits = 0x7f800000u;
inline constexpr uint32_t kFloatQuietNanBits = 0x7fc00000u;
inline constexpr uint32_t kFp8MaxMultiplierBits = 0x7e800000u;  // 2^126: 1 / m is never a denormal

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

// Two values (`first` in the low byte), exact. On sm_89+ one hardware conversion to two fp16s
// (every E4M3 value is one), then two exact widenings; elsewhere e4m3_to_float. A NaN code gives
// NaNs of other bits on the two ways: fp8_dequantize makes every NaN result one bit pattern.
MOE_HOST_DEVICE inline void e4m3x2_to_float(uint16_t pair, float& first, float& second) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(MOE_FP8_SOFTWARE_CONVERSION)
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
  asm("{\n\t.reg .b16 lo, hi;\n\t"
      "mov.b32 {lo, hi}, %2;\n\t"
      "cvt.f32.f16 %0, lo;\n\t"
      "cvt.f32.f16 %1, hi;\n\t}"
      : "=f"(first), "=f"(second)
      : "r"(halves));
#else
  first = e4m3_to_float(uint8_t(pair & 0xffu));
  second = e4m3_to_float(uint8_t(pair >> 8));
#endif
}

// The GPU's NaN: every payload bit set.
inline constexpr uint32_t kFloatCanonicalNanBits = 0x7fffffffu;

// One value dequantized, q * s: the IEEE product, rounded once (nothing to fuse with). A NaN result
// is the canonical NaN 0x7fffffff, whose bf16 and fp16 roundings are 0x7fff on the host
// (dtype.hpp) and on the device (cvt): which NaN an operation returns is the hardware's choice
// (the host keeps an operand's payload, the GPU returns its canonical NaN), so the CPU and CUDA
// outputs are the same bits only if every NaN is made one.
MOE_HOST_DEVICE inline float fp8_dequantize(float q, float scale) {
  const float v = q * scale;
  return v != v ? bits_float(kFloatCanonicalNanBits) : v;
}

// |v| as the bits of a non-negative float. Their unsigned order is the order of magnitudes, with
// infinity above every finite value and NaN above infinity: a tile's amax is an integer max (exact
// and the same in any reduction order), and the tile holds a NaN or an infinity exactly when its
// amax bits are >= kFloatInfBits.
MOE_HOST_DEVICE inline uint32_t fp8_abs_bits(float v) { return float_bits(v) & 0x7fffffffu; }

// What a tile quantizes with: q = E4M3(v * multiplier), dequantized as q * scale.
struct Fp8TileScale {
  float multiplier;
  float scale;
};

// The multiplier and scale of a tile from its amax bits (fp8.hpp; TransformerEngine's
// Float8BlockScaling): amax = max(amax, epsilon); m = 448 / amax, at most 2^126 (so that s is never
// a denormal; 448 / amax overflows to infinity below amax ~ 1.3e-36), with pow2 rounded down to a
// power of two (the mantissa bits cleared: m is a normal float, at least 448 / FLT_MAX);
// s = 1 / m. Two IEEE divisions per tile, and per value a multiplication. An all-zero tile gets
// m = s = 1, a non-finite one NaN (every q NaN).
MOE_HOST_DEVICE inline Fp8TileScale fp8_tile_scale(uint32_t amax_bits, bool pow2, float epsilon) {
  if (amax_bits >= kFloatInfBits) {
    const float nan = bits_float(kFloatQuietNanBits);
    return {nan, nan};
  }
  float amax = bits_float(amax_bits);
  if (amax < epsilon) amax = epsilon;
  if (amax == 0.f) return {1.f, 1.f};
  uint32_t m = float_bits(ieee_div(kFp8E4M3Max, amax));
  if (m > kFp8MaxMultiplierBits) m = kFp8MaxMultiplierBits;
  if (pow2) m &= 0xff800000u;
  const float multiplier = bits_float(m);
  return {multiplier, ieee_div(1.f, multiplier)};
}

// One element: E4M3(v * m). A NaN multiplier (non-finite tile) gives NaN products, hence 0x7f. The
// product of two floats, rounded once: the same on the host and the device (nothing to fuse with).
MOE_HOST_DEVICE inline uint8_t fp8_quantize(float v, float multiplier) { return e4m3_from_float(v * multiplier); }

// Columns an expert of `rows` tokens occupies in the columnwise layout: whole 128-token blocks.
MOE_HOST_DEVICE inline int64_t fp8_column_span(int64_t rows) {
  return (rows + kFp8Block - 1) / kFp8Block * kFp8Block;
}

}  // namespace moe::detail
