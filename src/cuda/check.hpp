// Turning CUDA runtime errors into moe::Error, and the launchers' alignment test.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moe_engine/error.hpp"

#define MOE_CUDA_CHECK(call, ...)                                    \
  do {                                                               \
    const cudaError_t moe_cuda_status_ = (call);                     \
    if (moe_cuda_status_ != cudaSuccess)                             \
      ::moe::throw_error(::moe::ErrorCode::kCuda, __VA_ARGS__, ": ", \
                         cudaGetErrorName(moe_cuda_status_), " (",   \
                         cudaGetErrorString(moe_cuda_status_), ")"); \
  } while (0)

// After a kernel launch: reports a launch-configuration error at the call site.
#define MOE_CUDA_CHECK_LAUNCH(what) MOE_CUDA_CHECK(cudaGetLastError(), "launching ", what)

namespace moe::cuda {

// Whether `p` is a multiple of `bytes` (a power of two): what vector and TMA accesses need.
inline bool is_aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

}  // namespace moe::cuda
