// Turning CUDA runtime errors into moe::Error, and the launchers' alignment test.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moe_engine/error.hpp"

#include <string>

namespace moe::cuda {

// What a failed CUDA runtime call means, for messages: "cudaErrorX (its description)", and for the
// errors of a machine without a usable GPU what the user can do about it ("no NVIDIA GPU/driver
// found", or a driver older than this build's runtime) rather than the runtime's wording.
std::string describe_cuda_error(cudaError_t status);

}  // namespace moe::cuda

#define MOE_CUDA_CHECK(call, ...)                                                    \
  do {                                                                               \
    const cudaError_t moe_cuda_status_ = (call);                                     \
    if (moe_cuda_status_ != cudaSuccess)                                             \
      ::moe::throw_error(::moe::ErrorCode::kCuda, __VA_ARGS__, ": ",                 \
                         ::moe::cuda::describe_cuda_error(moe_cuda_status_));       \
  } while (0)

// After a kernel launch: reports a launch-configuration error at the call site.
#define MOE_CUDA_CHECK_LAUNCH(what) MOE_CUDA_CHECK(cudaGetLastError(), "launching ", what)

namespace moe::cuda {

// Whether `p` is a multiple of `bytes` (a power of two): what vector and TMA accesses need.
inline bool is_aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

}  // namespace moe::cuda
