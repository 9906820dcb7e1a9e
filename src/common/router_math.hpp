// The router's per-token math (docs/design.md section 13), shared by the CPU backend and the CUDA
// kernels so that, given the same logits, both choose the same experts and compute the same scores
// and probabilities bit for bit: IEEE operations only (common/ieee_math.hpp), an exponential built
// from them, one total order for choosing, and sums over a token's values in the order a CUDA warp
// adds them, which the CPU backend follows. float64 (the CPU backend's float64 inputs) uses the
// host's exp.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/ieee_math.hpp"
#include "moe_engine/dtype.hpp"  // MOE_HOST_DEVICE, float_bits / bits_float
#include "moe_engine/router_spec.hpp"

namespace moe::detail {

// The CUDA forward sums the loss terms and counts of each 64 tokens in one block, then those
// partial sums in order; the forward workspace holds them (router_forward_workspace_size).
inline constexpr int64_t kRouterChunkTokens = 64;
// Added to the sums that normalize probabilities (Megatron-LM and DeepSeek-V3 add it too).
inline constexpr double kRouterNormEpsilon = 1e-20;

MOE_HOST_DEVICE inline float round_to_integer(float v) {
#ifdef __CUDA_ARCH__
  return rintf(v);
#else
  return std::rint(v);  // the default rounding mode: nearest even, as rintf on the device
#endif
}

// 2^k for -126 <= k <= 127, exactly.
MOE_HOST_DEVICE inline float exp2_integer(int k) { return bits_float(uint32_t(k + 127) << 23); }

// e^x from IEEE operations only, the same bits on the host and the device (CUDA's expf and the
// host's libm differ in last bits, which would let a near-tie choose other experts on the two
// backends). e^x = 2^n e^r with n = rint(x log2(e)), r = x - n ln(2) (ln(2) in fdlibm's two parts:
// n * kLn2Hi is exact for |n| < 2^8), e^r by its Taylor polynomial of degree 7 (|r| <= 0.35: the
// truncation is below 0.1 ulp), and 2^n applied in two steps, the first exact, so that a subnormal
// result is rounded once. Within 2 ulp of e^x (test_router.cpp). NaN passes unchanged; e^x is +inf
// from x = 88.72283935546875 (the smallest float whose e^x rounds to infinity) and 0 below -104.
MOE_HOST_DEVICE inline float router_exp(float x) {
  if (x != x) return x;
  if (x >= 88.72283935546875f) return bits_float(0x7f800000u);
  if (x < -104.f) return 0.f;
  constexpr float kLog2e = 1.44269502f, kLn2Hi = 6.9314575195e-01f, kLn2Lo = 1.4286067653e-06f;
  const float n = round_to_integer(ieee_mul(x, kLog2e));
  const float r = ieee_sub(ieee_sub(x, ieee_mul(n, kLn2Hi)), ieee_mul(n, kLn2Lo));
  float p = 1.f / 5040.f;  // Horner: 1 + r (1 + r (1/2 + r (1/6 + ... + r / 7!)))
  p = ieee_add(ieee_mul(p, r), 1.f / 720.f);
  p = ieee_add(ieee_mul(p, r), 1.f / 120.f);
  p = ieee_add(ieee_mul(p, r), 1.f / 24.f);
  p = ieee_add(ieee_mul(p, r), 1.f / 6.f);
  p = ieee_add(ieee_mul(p, r), 0.5f);
  p = ieee_add(ieee_mul(p, r), 1.f);
  p = ieee_add(ieee_mul(p, r), 1.f);
  const int k = int(n), half = k / 2;  // |half|, |k - half| <= 75: normal powers of two
  return ieee_mul(ieee_mul(p, exp2_integer(half)), exp2_integer(k - half));
}
inline double router_exp(double x) { return std::exp(x); }

// The sigmoid score 1 / (1 + e^-x).
MOE_HOST_DEVICE inline float router_sigmoid(float x) {
  return ieee_div(1.f, ieee_add(1.f, router_exp(-x)));
}
inline double router_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The value a score is ordered by: NaN counts as -infinity and -0 as +0.
MOE_HOST_DEVICE inline float router_canonical(float v) {
  return v != v ? -bits_float(0x7f800000u) : (v == 0.f ? 0.f : v);
}
inline double router_canonical(double v) { return v != v ? -INFINITY : (v == 0.0 ? 0.0 : v); }

// The order experts (and groups) are chosen in: the larger canonical value first, equal values by
// the lower index. A total order, so that every way of taking the best k gives the same k.
template <class T>
inline bool router_better(T a, int64_t a_index, T b, int64_t b_index) {
  const T ca = router_canonical(a), cb = router_canonical(b);
  return ca > cb || (ca == cb && a_index < b_index);
}

// The same order for float as one unsigned 64-bit key (the CUDA kernels take a warp's maximum of
// keys): the canonical value's bits mapped so that their unsigned order is the values' order, above
// the complemented index. Every key is above kRouterNoKey (-infinity maps to 0x007fffff).
inline constexpr uint64_t kRouterNoKey = 0;
MOE_HOST_DEVICE inline uint64_t router_key(float v, uint32_t index) {
  const uint32_t u = float_bits(router_canonical(v));
  const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(ordered) << 32) | uint32_t(~index);
}
MOE_HOST_DEVICE inline uint32_t router_key_index(uint64_t key) { return ~uint32_t(key); }
// The canonical value a key was made from.
MOE_HOST_DEVICE inline float router_key_value(uint64_t key) {
  const uint32_t ordered = uint32_t(key >> 32);
  return bits_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
}

// The sum of v[0..n) in the order a CUDA warp adds them (kernels/router.cu): lane l adds v[l],
// v[l + 32], ... in turn onto 0, then the 32 lane sums combine pairwise, lane l with lane l + 16,
// then l + 8, ..., l + 1 (the device's butterfly leaves this sum in every lane). The CPU backend
// sums a token's values in this order too, so that its softmax and normalizations are the device's.
template <class T>
inline T router_warp_sum(const T* v, int64_t n) {
  T lane[32];
  for (int64_t l = 0; l < 32; ++l) {
    lane[l] = T(0);
    for (int64_t i = l; i < n; i += 32) lane[l] = lane[l] + v[i];
  }
  for (int offset = 16; offset > 0; offset /= 2)
    for (int l = 0; l < offset; ++l) lane[l] = lane[l] + lane[l + offset];
  return lane[0];
}

// The loss factors from static shapes: the load-balancing loss is aux_factor * sum_e P_e c_e
// (Megatron's coeff * E / (k T^2)), the z-loss z_factor * sum_t lse_t^2 (coeff / T); both 0 for
// T = 0.
inline double router_aux_factor(const RouterSpec& spec, int64_t tokens, int64_t num_experts) {
  if (tokens == 0) return 0.0;
  return double(spec.aux_loss_coeff) * double(num_experts) /
         (double(spec.topk) * double(tokens) * double(tokens));
}
inline double router_z_factor(const RouterSpec& spec, int64_t tokens) {
  return tokens == 0 ? 0.0 : double(spec.z_loss_coeff) / double(tokens);
}

}  // namespace moe::detail
