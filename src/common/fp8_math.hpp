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
// it there is no finite E4M3; NaN -> 0x7f. The sign of zero is kept.
MOE_HOST_DEVICE inline uint8_t e4m3_from_float(float v) {
  const uint32_t u = float_bits(v);
  const auto sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > kFloatInfBits) return kE4M3Nan;
  if (a >= 0x43e00000u) return uint8_t(sign | 0x7eu);  // |v| >= 448
  if (a >= 0x3c800000u) {                               // |v| >= 2^-6: a normal E4M3 value
    // Drop 20 of the 23 mantissa bits, to nearest even (a carry moves into the exponent), then
    // rebias the exponent from 127 to 7: (e << 3 | m) - (120 << 3).
    const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    return uint8_t(sign | ((r >> 20) - (120u << 3)));
  }
  // Subnormal E4M3: |v| / 2^-9 rounded to the nearest even integer (8 is 2^-6, code 0x08, the
  // smallest normal: the encoding continues). Below 2^-10 everything rounds to zero; 2^-10 itself
  // is a tie that goes to the even 0.
  if (a < 0x3a800000u) return sign;
  const uint32_t e = a >> 23;  // biased exponent, 117..120
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 141u - e;  // m * 2^(e - 150) / 2^-9 = m >> (141 - e)
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return uint8_t(sign | q);
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

// One element: E4M3(v / s). A NaN scale (non-finite tile) gives NaN quotients, hence 0x7f.
MOE_HOST_DEVICE inline uint8_t fp8_quantize(float v, float s) { return e4m3_from_float(ieee_div(v, s)); }

// Columns an expert of `rows` tokens occupies in the columnwise layout: whole 128-token blocks.
MOE_HOST_DEVICE inline int64_t fp8_column_span(int64_t rows) {
  return (rows + kFp8Block - 1) / kFp8Block * kFp8Block;
}

}  // namespace moe::detail
