// Single IEEE float operations, rounded to nearest even, that compute the same bits on the host and
// on the device: nvcc contracts a product and a sum into one fused multiply-add unless told not to
// (the intrinsics are never fused), and its `/` is IEEE only without -prec-div=false. Host code
// that must match the device bit for bit is compiled with -ffp-contract=off (src/CMakeLists.txt).
#pragma once

#include "moe_engine/dtype.hpp"  // MOE_HOST_DEVICE

namespace moe::detail {

MOE_HOST_DEVICE inline float ieee_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

MOE_HOST_DEVICE inline float ieee_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

MOE_HOST_DEVICE inline float ieee_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MOE_HOST_DEVICE inline float ieee_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

}  // namespace moe::detail
