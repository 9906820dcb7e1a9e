// The activations' math, shared by the CPU backend and the CUDA kernels so that both compute the
// same function: the GLUs (GluMath; swiglu is the clamped form with limit = inf, alpha = 1,
// offset = 0) and the non-gated activations (SquaredRelu, GeluTanh), elementwise.
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

#include "moe_engine/dtype.hpp"  // MOE_HOST_DEVICE
#include "moe_engine/glu_spec.hpp"

namespace moe::detail {

MOE_HOST_DEVICE inline float exp_of(float x) { return expf(x); }
MOE_HOST_DEVICE inline double exp_of(double x) { return exp(x); }

// sigmoid(z) = 1 / (1 + e^-z), given z and w = -z log2(e) (each computed from constants the caller
// folds). On the GPU in float: the hardware exp2 of w (flushing results below 2^-126, where 1 + e
// rounds to 1 anyway) and the hardware reciprocal, a few ulp, far below the 16-bit rounding of the
// outputs, in 4 instructions where expf and a division take 8. Elsewhere exp(-z) and a division.
// Every CUDA path (the activation kernels, the fused epilogues) computes this same function.
template <class T>
MOE_HOST_DEVICE inline T sigmoid_of(T z, T w) {
#ifdef __CUDA_ARCH__
  if constexpr (std::is_same_v<T, float>) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(w));
    return __fdividef(1.f, 1.f + e);
  }
#endif
  (void)w;
  return T(1) / (T(1) + exp_of(-z));
}

template <class T>
struct GluMath {
  T limit;   // gate clamped from above, linear to [-limit, limit]
  T alpha;   // sigmoid slope
  T offset;  // added to the clamped linear value
  T neg_alpha_log2e;  // -alpha * log2(e): sigmoid(alpha * g) = 1 / (1 + 2^(g * neg_alpha_log2e))

  static constexpr double kLog2e = 1.4426950408889634;

  // SwiGLU's constants. A kernel that takes them at compile time rather than from its parameters
  // lets the compiler drop the clamps' compares and the multiplies by alpha (the same values: a
  // compare with inf is false, a product by 1 exact).
  static constexpr GluMath swiglu() { return {std::numeric_limits<T>::infinity(), T(1), T(0), T(-kLog2e)}; }

  // The math of a kernel instance: SwiGLU's constants where kSwiGLU (at compile time), else `given`.
  template <bool kSwiGLU>
  MOE_HOST_DEVICE static constexpr GluMath fixed(GluMath given) {
    return kSwiGLU ? swiglu() : given;
  }

  static GluMath from(const GluSpec& spec) {
    if (spec.activation == Activation::kSwiGLU) return swiglu();
    return {T(spec.limit), T(spec.alpha), T(spec.offset), T(-double(spec.alpha) * kLog2e)};
  }

  // sigmoid(alpha * g) (sigmoid_of: the hardware exp2 and reciprocal on the GPU; the fused FC1
  // epilogue runs this 64 times per thread per tile with the tensor pipe idle).
  MOE_HOST_DEVICE T gate_sigmoid(T g) const { return sigmoid_of(alpha * g, g * neg_alpha_log2e); }

  // Clamps that let NaN through (a NaN input must not be clamped into a number), as a compare and
  // a select: the derivatives in backward share their predicates.
  MOE_HOST_DEVICE T select_clamp_gate(T gate) const { return gate > limit ? limit : gate; }
  MOE_HOST_DEVICE T select_clamp_linear(T linear) const {
    return linear > limit ? limit : (linear < -limit ? -limit : linear);
  }
  // The same values; on sm_80+ in float one NaN-propagating min/max instruction each.
  MOE_HOST_DEVICE T clamp_gate(T gate) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same_v<T, float>) {
      float r;
      asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(gate), "f"(limit));
      return r;
    }
#endif
    return select_clamp_gate(gate);
  }
  MOE_HOST_DEVICE T clamp_linear(T linear) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same_v<T, float>) {
      float r;
      asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(linear), "f"(limit));
      asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(r), "f"(-limit));
      return r;
    }
#endif
    return select_clamp_linear(linear);
  }

  MOE_HOST_DEVICE T forward(T gate, T linear) const {
    const T g = clamp_gate(gate);
    return g * gate_sigmoid(g) * (clamp_linear(linear) + offset);
  }

  // forward() with SwiGLU's constants, without the clamps (with limit = inf they return their
  // input, but for a NaN's payload, which the min/max forms make canonical): for passes whose
  // outputs do not keep a NaN's payload (the FP8 quantizers turn any NaN tile into the same bytes
  // and scale).
  MOE_HOST_DEVICE static T swiglu_forward(T gate, T linear) {
    constexpr GluMath kSwiglu = swiglu();
    return gate * kSwiglu.gate_sigmoid(gate) * (linear + kSwiglu.offset);
  }

  // act = forward(gate, linear); d_gate / d_linear = d_act * the partial derivatives, which are 0
  // where gate > limit and where |linear| > limit respectively.
  // The select clamps here (the min/max forms made the dGLU epilogue spill).
  MOE_HOST_DEVICE void backward(T gate, T linear, T d_act, T& act, T& d_gate, T& d_linear) const {
    const T g = select_clamp_gate(gate);
    const T l = select_clamp_linear(linear) + offset;
    const T s = gate_sigmoid(g);
    const T silu = g * s;
    act = silu * l;
    d_gate = gate > limit ? T(0) : d_act * l * s * (T(1) + alpha * g * (T(1) - s));
    d_linear = (linear > limit || linear < -limit) ? T(0) : d_act * silu;
  }
};

// fn(std::bool_constant<the spec is SwiGLU>{}): picks the kernel instance that takes SwiGLU's
// constants at compile time (GluMath::fixed, swiglu_forward).
template <class Fn>
decltype(auto) with_swiglu_constants(const GluSpec& spec, Fn&& fn) {
  if (spec.activation == Activation::kSwiGLU) return fn(std::true_type{});
  return fn(std::false_type{});
}

// The non-gated activations, on one value h of FC1's output: forward(h) = f(h); backward gives
// act = f(h) and dh = d_act * f'(h). Stateless; with_elementwise picks one at run time.

// relu(h)^2, with relu as a select that lets NaN through (NaN < 0 is false): f' = 2 relu(h).
template <class T>
struct SquaredRelu {
  MOE_HOST_DEVICE static T relu(T h) { return h < T(0) ? T(0) : h; }
  MOE_HOST_DEVICE T forward(T h) const {
    const T r = relu(h);
    return r * r;
  }
  MOE_HOST_DEVICE void backward(T h, T d_act, T& act, T& dh) const {
    const T r = relu(h);
    act = r * r;
    dh = d_act * (r + r);
  }
};

// GELU, tanh approximation: 0.5 h (1 + tanh(u)), u = sqrt(2/pi) (h + 0.044715 h^3), computed as
// h * sigmoid(2u) (0.5 (1 + tanh(u)) = sigmoid(2u) exactly): no cancellation where tanh(u) nears -1
// (large negative h), and on the GPU the sigmoid_of of the GLUs instead of a tanh. With
// s = sigmoid(2u): f = h s, f' = s + h s (1 - s) (2u)', (2u)' = 2 sqrt(2/pi) (1 + 3 * 0.044715 h^2).
template <class T>
struct GeluTanh {
  // 2u = h (kA + kB h^2); the sigmoid's exp2 argument -2u log2(e) = h (kWa + kWb h^2).
  MOE_HOST_DEVICE static T sigmoid_2u(T h, T h2) {
    constexpr double kA = 1.5957691216057308;  // 2 sqrt(2/pi)
    constexpr double kB = kA * 0.044715;
    constexpr double kLog2e = 1.4426950408889634;
    return sigmoid_of(h * (T(kA) + T(kB) * h2), h * (T(-kA * kLog2e) + T(-kB * kLog2e) * h2));
  }
  MOE_HOST_DEVICE T forward(T h) const { return h * sigmoid_2u(h, h * h); }
  MOE_HOST_DEVICE void backward(T h, T d_act, T& act, T& dh) const {
    constexpr double kA = 1.5957691216057308, kB3 = 3 * kA * 0.044715;
    const T h2 = h * h, s = sigmoid_2u(h, h2);
    act = h * s;
    dh = d_act * (s + act * (T(1) - s) * (T(kA) + T(kB3) * h2));
  }
};

// fn(SquaredRelu<T>{}) or fn(GeluTanh<T>{}) for a non-gated activation.
template <class T, class Fn>
MOE_HOST_DEVICE inline void with_elementwise(Activation activation, Fn&& fn) {
  if (activation == Activation::kSReLU)
    fn(SquaredRelu<T>{});
  else
    fn(GeluTanh<T>{});
}

}  // namespace moe::detail
