// Two 16-bit floats in one 32-bit word (bf16x2 / half2), to and from float: the paired loads and
// stores of the GEMM epilogues and the GLU kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace moe::cuda {

template <class T>
struct Pair16;

template <>
struct Pair16<__nv_bfloat16> {
  __device__ static uint32_t pack(float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ static float2 unpack(uint32_t bits) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  }
};

template <>
struct Pair16<__half> {
  __device__ static uint32_t pack(float a, float b) {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ static float2 unpack(uint32_t bits) { return __half22float2(*reinterpret_cast<const __half2*>(&bits)); }
};

// Rounds a and b to T (nearest even) and back, through one packing conversion and integer
// unpacking: a single-value conversion would run on the SM's XU pipe (16 lanes per clock, shared
// with the MUFU transcendentals), the packing one runs on the ALU pipe. Same bits either way.
template <class T>
__device__ __forceinline__ void round_pair(float& a, float& b) {
  const float2 v = Pair16<T>::unpack(Pair16<T>::pack(a, b));
  a = v.x;
  b = v.y;
}

}  // namespace moe::cuda
