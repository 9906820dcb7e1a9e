// Does compute-sanitizer's racecheck order cp.async copies through mbarriers? The FP8 GEMM's scale
// warp copies each step's scales into a stage with cp.async and arrives on the stage's full
// barrier; the math threads read them after their wait and release the stage on its empty
// barrier; racecheck reports the pairs (docs/design.md, FP8 kernel). This program runs the same
// two-stage protocol in five ways, and racecheck is run on each. The producer warp fills a stage:
//   plain        with st.shared, then mbarrier.arrive (the control: mbarrier ordering of ordinary
//                stores);
//   noinc        with cp.async, then cp.async.mbarrier.arrive.noinc (the FP8 kernel's way);
//   wait         with cp.async, cp.async.wait_group 0, then mbarrier.arrive;
// and each consumer thread arrives on the empty barrier after its read. The FP8 kernel's consumer
// warps release a stage by one lane's arrive instead (the empty barrier counts warps):
//   lane0        noinc's producer, lane 0 of each consumer warp arrives right after the reads: the
//                other lanes' reads are not ordered before the release by the PTX memory model;
//   lane0_sync   the same with __syncwarp() before lane 0's arrive, which orders them.
// Every variant checks its sums on the host, so a run that races visibly fails by itself.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a bench/experiments/racecheck_cp_async_mbarrier.cu \
//     -o racecheck_probe
//   for v in plain noinc wait lane0 lane0_sync; do compute-sanitizer --tool racecheck ./racecheck_probe $v; done
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_check.hpp"

constexpr int kStages = 2, kValues = 128, kSteps = 64, kConsumers = 128;

__device__ __forceinline__ uint32_t smem(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void wait_parity(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }" ::"r"(smem(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(bar)) : "memory");
}

// Warp 0 fills stage s with step t's 128 floats (4 a lane); warps 1..4 (128 threads) each read one
// value of every step and sum them. kVariant: 0 plain, 1 noinc, 2 wait, 3 lane0, 4 lane0_sync.
template <int kVariant>
__global__ void probe_kernel(const float* __restrict__ src, float* __restrict__ sums) {
  __shared__ __align__(16) float buf[kStages][kValues];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int tid = threadIdx.x;
  if (tid == 0)
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(&full[s])), "r"(32));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(&empty[s])),
                   "r"(kVariant >= 3 ? kConsumers / 32 : kConsumers));
    }
  __syncthreads();
  if (tid < 32) {
    for (int t = 0; t < kSteps; ++t) {
      const int s = t % kStages;
      if (t >= kStages) wait_parity(&empty[s], uint32_t((t / kStages - 1) & 1));
      const float* from = src + int64_t(t) * kValues + 4 * tid;
      float* to = &buf[s][4 * tid];
      if constexpr (kVariant == 0) {
        *reinterpret_cast<float4*>(to) = *reinterpret_cast<const float4*>(from);
        arrive(&full[s]);
      } else {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem(to)), "l"(from) : "memory");
        if constexpr (kVariant != 2) {
          asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem(&full[s])) : "memory");
        } else {
          asm volatile("cp.async.commit_group;" ::: "memory");
          asm volatile("cp.async.wait_group 0;" ::: "memory");
          arrive(&full[s]);
        }
      }
    }
  } else if (tid < 32 + kConsumers) {
    const int c = tid - 32;
    float sum = 0.f;
    for (int t = 0; t < kSteps; ++t) {
      const int s = t % kStages;
      wait_parity(&full[s], uint32_t((t / kStages) & 1));
      sum += buf[s][c];
      if constexpr (kVariant == 4) __syncwarp();
      if (kVariant < 3 || c % 32 == 0) arrive(&empty[s]);
    }
    sums[c] = sum;
  }
}

int main(int argc, char** argv) {
  const char* variant = argc > 1 ? argv[1] : "noinc";
  std::vector<float> host(size_t(kSteps) * kValues);
  for (size_t i = 0; i < host.size(); ++i) host[i] = float(i % 97) + 0.25f * float(i % 5);
  float *src, *sums;
  CK(cudaMalloc(&src, host.size() * sizeof(float)));
  CK(cudaMalloc(&sums, kConsumers * sizeof(float)));
  CK(cudaMemcpy(src, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  if (!std::strcmp(variant, "plain")) probe_kernel<0><<<1, 32 + kConsumers>>>(src, sums);
  else if (!std::strcmp(variant, "noinc")) probe_kernel<1><<<1, 32 + kConsumers>>>(src, sums);
  else if (!std::strcmp(variant, "wait")) probe_kernel<2><<<1, 32 + kConsumers>>>(src, sums);
  else if (!std::strcmp(variant, "lane0")) probe_kernel<3><<<1, 32 + kConsumers>>>(src, sums);
  else if (!std::strcmp(variant, "lane0_sync")) probe_kernel<4><<<1, 32 + kConsumers>>>(src, sums);
  else {
    std::printf("unknown variant %s (plain, noinc, wait, lane0, lane0_sync)\n", variant);
    return 2;
  }
  CK(cudaGetLastError());
  std::vector<float> got(kConsumers);
  CK(cudaMemcpy(got.data(), sums, kConsumers * sizeof(float), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int c = 0; c < kConsumers; ++c) {
    float want = 0.f;
    for (int t = 0; t < kSteps; ++t) want += host[size_t(t) * kValues + c];
    bad += got[c] != want;
  }
  std::printf("%s: %s (%d of %d sums wrong)\n", variant, bad ? "FAILED" : "ok", bad, kConsumers);
  return bad ? 1 : 0;
}
