// Thin PTX wrappers: per-thread asynchronous copies from global to shared memory (cp.async), whose
// completion an mbarrier tracks.
#pragma once

#include <cstdint>

namespace moe::cuda::ptx {

// Copies 4 bytes from src to the shared address dst; with `valid` false, writes zeros and reads
// nothing (src must still be a mapped address: pass any valid pointer).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4u : 0u)
               : "memory");
}

// The mbarrier receives one arrival from this thread once all its earlier cp.async copies have
// landed (noinc: the barrier's expected count includes this arrival).
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
               : "memory");
}

}  // namespace moe::cuda::ptx
