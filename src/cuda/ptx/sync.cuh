// Thin PTX wrappers: mbarriers, named barriers, proxy fences, warp election, register reallocation.
#pragma once

#include <cstdint>

namespace moe::cuda::ptx {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- shared memory by 32-bit address ----

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_v2_f32(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// Two adjacent floats (8-byte aligned). Volatile, so never moved across the barrier waits that
// publish them; no memory clobber, so other loads may still be scheduled around it.
__device__ __forceinline__ void ld_shared_v2_f32(uint32_t addr, float& a, float& b) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(a), "=f"(b) : "r"(addr));
}

// ---- mbarrier ----

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(arrivals));
}

// Makes mbarrier.init visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

// Arrives and announces `bytes` that asynchronous copies will deliver to this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Ends the kernel with an error (cudaErrorIllegalAddress): a volatile store to address 0, which
// is never mapped. Not `trap`: in a kernel whose warpgroups resize their register files with
// setmaxnreg, a trap anywhere in the math warpgroups' code keeps ptxas from allocating past the
// launch's 168 registers there (a reduced kernel spilled 184 bytes with trap, none without).
__device__ __forceinline__ void abort_kernel() {
  asm volatile("{ .reg .u64 null; mov.u64 null, 0; st.volatile.global.u32 [null], 0; }" ::: "memory");
}

// Debug builds for kernel development can abort a kernel that waits on one barrier for longer
// than MOE_DEADLOCK_WATCHDOG_NS (CMake: -DMOE_ENGINE_DEADLOCK_WATCHDOG_SECONDS=N), so a protocol
// bug fails with an error instead of hanging the GPU. Off by default: a fixed limit cannot tell a
// deadlock from a healthy run slowed down by a sanitizer (racecheck runs kernels 100x slower).
#ifndef MOE_DEADLOCK_WATCHDOG_NS
#define MOE_DEADLOCK_WATCHDOG_NS 0ull
#endif
inline constexpr uint64_t kDeadlockWatchdogNs = MOE_DEADLOCK_WATCHDOG_NS;

// Waits until the phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_address(bar);
  uint32_t done = 0;
  [[maybe_unused]] uint64_t since = 0;
  for ([[maybe_unused]] uint32_t polls = 1;; ++polls) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
    if (done) return;
    if constexpr (kDeadlockWatchdogNs > 0) {
      if ((polls & 1023u) == 0) {
        const uint64_t now = global_timer_ns();
        if (since == 0) since = now;
        else if (now - since > kDeadlockWatchdogNs) abort_kernel();
      }
    }
  }
}

// ---- CTA-level synchronization ----

// bar.sync on a named barrier among `threads` threads (a multiple of 32); id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// bar.arrive: counts this thread toward the barrier's `threads` without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy (TMA, wgmma) reads.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- warps and registers ----

__device__ __forceinline__ uint32_t lane_index() { return threadIdx.x & 31u; }

// The warp index, made warp-uniform so branches on it do not diverge.
__device__ __forceinline__ uint32_t warp_index() { return __shfl_sync(0xffffffffu, threadIdx.x / 32u, 0); }

template <uint32_t kRegisters>
__device__ __forceinline__ void setmaxnreg_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

template <uint32_t kRegisters>
__device__ __forceinline__ void setmaxnreg_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

}  // namespace moe::cuda::ptx
