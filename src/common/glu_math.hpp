// The GLU activations' math, shared by the CPU backend and the CUDA kernels so that both compute
// the same function. swiglu is the clamped form with limit = inf, alpha = 1, offset = 0.
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

#include "moe_engine/dtype.hpp"  // MOE_HOST_DEVICE
#include "moe_engine/glu.hpp"

namespace moe::detail {

MOE_HOST_DEVICE inline float exp_of(float x) { return expf(x); }
MOE_HOST_DEVICE inline double exp_of(double x) { return exp(x); }

template <class T>
struct GluMath {
  T limit;   // gate clamped from above, linear to [-limit, limit]
  T alpha;   // sigmoid slope
  T offset;  // added to the clamped linear value

  static GluMath from(const GluSpec& spec) {
    if (spec.activation == GluActivation::kSwiGLU)
      return {std::numeric_limits<T>::infinity(), T(1), T(0)};
    return {T(spec.limit), T(spec.alpha), T(spec.offset)};
  }

  // On the GPU in float: the hardware exp2 and reciprocal (a few ulp, far below the 16-bit output
  // rounding). Every CUDA path (GLU kernels, fused epilogues) computes this same function.
  MOE_HOST_DEVICE static T sigmoid(T x) {
#ifdef __CUDA_ARCH__
    if constexpr (std::is_same_v<T, float>) return __fdividef(1.f, 1.f + __expf(-x));
#endif
    return T(1) / (T(1) + exp_of(-x));
  }

  // Comparisons are written so that NaN inputs propagate instead of being clamped away.
  MOE_HOST_DEVICE T clamp_gate(T gate) const { return gate > limit ? limit : gate; }
  MOE_HOST_DEVICE T clamp_linear(T linear) const {
    return linear > limit ? limit : (linear < -limit ? -limit : linear);
  }

  MOE_HOST_DEVICE T forward(T gate, T linear) const {
    const T g = clamp_gate(gate);
    return g * sigmoid(alpha * g) * (clamp_linear(linear) + offset);
  }

  // act = forward(gate, linear); d_gate / d_linear = d_act * the partial derivatives, which are 0
  // where gate > limit and where |linear| > limit respectively.
  MOE_HOST_DEVICE void backward(T gate, T linear, T d_act, T& act, T& d_gate, T& d_linear) const {
    const T g = clamp_gate(gate);
    const T l = clamp_linear(linear) + offset;
    const T s = sigmoid(alpha * g);
    const T silu = g * s;
    act = silu * l;
    d_gate = gate > limit ? T(0) : d_act * l * s * (T(1) + alpha * g * (T(1) - s));
    d_linear = (linear > limit || linear < -limit) ? T(0) : d_act * silu;
  }
};

}  // namespace moe::detail
