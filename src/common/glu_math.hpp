// The GLU activations' math, shared by the CPU backend and the CUDA kernels so that both compute
// the same function. swiglu is the clamped form with limit = inf, alpha = 1, offset = 0.
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

#include "moe_engine/dtype.hpp"  // MOE_HOST_DEVICE
#include "moe_engine/glu_spec.hpp"

namespace moe::detail {

MOE_HOST_DEVICE inline float exp_of(float x) { return expf(x); }
MOE_HOST_DEVICE inline double exp_of(double x) { return exp(x); }

template <class T>
struct GluMath {
  T limit;   // gate clamped from above, linear to [-limit, limit]
  T alpha;   // sigmoid slope
  T offset;  // added to the clamped linear value
  T neg_alpha_log2e;  // -alpha * log2(e): sigmoid(alpha * g) = 1 / (1 + 2^(g * neg_alpha_log2e))

  static GluMath from(const GluSpec& spec) {
    constexpr double kLog2e = 1.4426950408889634;
    if (spec.activation == GluActivation::kSwiGLU)
      return {std::numeric_limits<T>::infinity(), T(1), T(0), T(-kLog2e)};
    return {T(spec.limit), T(spec.alpha), T(spec.offset), T(-double(spec.alpha) * kLog2e)};
  }

  // sigmoid(alpha * g). On the GPU in float: the hardware exp2 (flushing results below 2^-126,
  // where 1 + e rounds to 1 anyway) of g times one folded constant, and the hardware reciprocal:
  // a few ulp, far below the 16-bit output rounding, and 4 instructions where expf / division
  // take 8 (the fused FC1 epilogue runs this 64 times per thread per tile with the tensor pipe
  // idle). Every CUDA path (GLU kernels, fused epilogues) computes this same function.
  MOE_HOST_DEVICE T gate_sigmoid(T g) const {
#ifdef __CUDA_ARCH__
    if constexpr (std::is_same_v<T, float>) {
      float e;
      asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * neg_alpha_log2e));
      return __fdividef(1.f, 1.f + e);
    }
#endif
    return T(1) / (T(1) + exp_of(-(alpha * g)));
  }

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

}  // namespace moe::detail
