// Thin PTX wrappers: per-thread asynchronous copies from global to shared memory (cp.async), in
// commit groups or tracked by an mbarrier.
#pragma once

#include <cstdint>

namespace moe::cuda::ptx {

// Copies 4 bytes from src to the shared address dst; with `valid` false, writes zeros and reads
// nothing (src must still be a mapped address: pass any valid pointer).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4u : 0u)
               : "memory");
}

// Copies 16 bytes from src to the shared address dst, bypassing L1 (.cg); with `valid` false,
// writes zeros and reads nothing (src must still be a mapped address).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16u : 0u)
               : "memory");
}

// Closes this thread's copies issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most kPending of this thread's committed groups are still in flight; the copies
// of the others are then visible to this thread (and, after a release such as mbarrier.arrive,
// to the threads that acquire it).
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
// The same with the count known at run time only, 0, 1 or (anything larger) 2: the instruction
// takes an immediate.
__device__ __forceinline__ void cp_async_wait_group_at_most_2(int pending) {
  switch (pending) {
    case 0:
      cp_async_wait_group<0>();
      break;
    case 1:
      cp_async_wait_group<1>();
      break;
    default:
      cp_async_wait_group<2>();
      break;
  }
}

// An arrival on the mbarrier at shared address `bar` once every cp.async this thread has issued so
// far has landed; the thread goes on at once. `.noinc`: the arrival is one of the barrier's expected
// arrivals (as mbarrier.arrive's), and the copies are visible to the threads that wait on its phase.
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

}  // namespace moe::cuda::ptx
