// Thin PTX wrappers: warpgroup matrix multiply-accumulate (wgmma) and its shared-memory matrix
// descriptors. Both operands come from 128-byte-swizzled shared memory tiles written by TMA.
#pragma once

#include <cstdint>

namespace moe::cuda::ptx {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most kPending committed wgmma groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma fence or wait.
template <int kRegs>
__device__ __forceinline__ void fence_accumulators(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Matrix descriptor of a 128-byte-swizzled shared-memory operand (tiles 1024-byte aligned):
//   K-major (rows of 128 bytes along K: 64 16-bit or 128 8-bit values): stride = 1024 (between 8-row groups), leading unused;
//   MN-major (rows of 64 values along M or N):  stride = 1024 (between 8-row groups along K),
//                                               leading = bytes between 64-wide M/N panels.
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t smem_address, uint32_t leading_bytes,
                                                    uint32_t stride_bytes) {
  uint64_t desc = uint64_t((smem_address & 0x3ffffu) >> 4);
  desc |= uint64_t((leading_bytes >> 4) & 0x3fffu) << 16;
  desc |= uint64_t((stride_bytes >> 4) & 0x3fffu) << 32;
  desc |= uint64_t(1) << 62;  // layout: 128-byte swizzle
  return desc;
}

// The descriptor of the operand `bytes` further on: its address field holds address >> 4 in the
// low 14 bits, and shared addresses (< 256 KiB) never carry out of it, so one add moves it.
__device__ __forceinline__ uint64_t descriptor_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// WgmmaSS<N, is_fp16>::mma<kTransA, kTransB>(acc, desc_a, desc_b, scale_d): acc (+)= A B for a
// 64 x N x 16 step; scale_d = 0 overwrites the accumulators instead of adding.
template <int kN, bool kFp16>
struct WgmmaSS;

// WgmmaFp8SS<N>::mma(acc, desc_a, desc_b, scale_d): acc (+)= A B for a 64 x N x 32 step of E4M3
// operands, both K-major (rows of 128 values along K).
template <int kN>
struct WgmmaFp8SS;

#include "cuda/ptx/wgmma_ops.inc"

}  // namespace moe::cuda::ptx
