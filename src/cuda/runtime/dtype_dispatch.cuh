// Device-side conversions between the 16/32-bit float types and float, and the host-side switch
// from a DType to the matching CUDA type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "moe_engine/dtype.hpp"
#include "moe_engine/error.hpp"

namespace moe::cuda {

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ void from_float(float v, __nv_bfloat16* p) {
  *p = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void from_float(float v, __half* p) { *p = __float2half_rn(v); }
__device__ __forceinline__ void from_float(float v, float* p) { *p = v; }

// Calls f(T{}) with the CUDA type of a bf16, fp16 or fp32 dtype.
template <class F>
void with_cuda_type(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
    case DType::kFloat16:
      return f(__half{});
    case DType::kFloat32:
      return f(float{});
    default:
      throw_error(ErrorCode::kNotImplemented, what, ": no CUDA kernel for ", dtype_name(dtype));
  }
}

}  // namespace moe::cuda
