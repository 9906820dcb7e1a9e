// Thin PTX wrappers: thread-block clusters (rank, id, cluster-wide barrier, remote mbarrier arrive).
#pragma once

#include <cstdint>

#include "cuda/ptx/sync.cuh"

namespace moe::cuda::ptx {

// This block's rank within its cluster.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Index of this block's cluster along x, and the number of clusters along x.
__device__ __forceinline__ uint32_t cluster_id_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_count_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}

// All threads of all blocks of the cluster meet here: shared-memory writes (and mbarrier inits)
// before it are visible to every block of the cluster after it. Not `.aligned`: warps may arrive
// diverged (the producer warp's elected lane arrives later than its other lanes).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// Arrives on the mbarrier at the same shared-memory offset as `bar` in the cluster block `rank`
// (this block included). Default (.release.cta) semantics: what the arrival publishes is that this
// warp's wgmma reads of a stage have completed, and the next writer is TMA. The `.release.cluster`
// form would put MEMBAR.ALL.GPU before every arrival, stalling the consumers (measured: -40%).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_address(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

}  // namespace moe::cuda::ptx
