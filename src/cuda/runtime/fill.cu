#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/hash_random.hpp"
#include "core/cuda_api.hpp"
#include "cuda/runtime/check.hpp"

namespace moe::cuda_api {
namespace {

__device__ __forceinline__ void put(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void put(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(double* p, float v) { *p = v; }

template <class T>
__global__ void fill_uniform_kernel(T* data, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    put(data + i, detail::hash_uniform(seed, uint64_t(i), lo, hi));
}

}  // namespace

void fill_uniform(void* data, DType dtype, int64_t n, uint64_t seed, float lo, float hi,
                  Stream stream) {
  if (n == 0) return;
  const int blocks = int(std::min<int64_t>((n + 255) / 256, 4096));
  switch (dtype) {
    case DType::kBFloat16:
      fill_uniform_kernel<<<blocks, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(data), n, seed,
                                                      lo, hi);
      break;
    case DType::kFloat16:
      fill_uniform_kernel<<<blocks, 256, 0, stream>>>(static_cast<__half*>(data), n, seed, lo, hi);
      break;
    case DType::kFloat32:
      fill_uniform_kernel<<<blocks, 256, 0, stream>>>(static_cast<float*>(data), n, seed, lo, hi);
      break;
    case DType::kFloat64:
      fill_uniform_kernel<<<blocks, 256, 0, stream>>>(static_cast<double*>(data), n, seed, lo, hi);
      break;
    default:
      throw_error(ErrorCode::kDType, "fill_uniform: not a float dtype: ", dtype_name(dtype));
  }
  MOE_CUDA_CHECK_LAUNCH("fill_uniform_kernel");
}

}  // namespace moe::cuda_api
