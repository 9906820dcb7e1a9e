// The memory ceilings the memory-bound steps are held against, measured in one run on the device:
// a device-to-device copy (1 read : 1 write, two arrays), an in-place read-modify-write of one
// array (what a float32 main_grad accumulation does: y = y * a + b) by 16-byte loads and by bulk
// copies through shared memory, an add of a second array into the first (y += z: 2 reads : 1
// write, torch's `.grad += g`), a read-only reduction (also in the grouped GEMM's B-box pattern:
// 256 rows, 128 or 256 bytes of each a step) and a write-only fill. Each: the median of 7 rounds of
// 10 launches, TB/s of the bytes read + written. No library needed.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a bench/experiments/memory_ceilings.cu \
//     -o memory_ceilings && ./memory_ceilings [MiB of the array, default 1536]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.hpp"

__global__ void rmw_kernel(float4* y, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float4 v = y[i];
    v.x = v.x * 0.5f + 1.f, v.y = v.y * 0.5f + 1.f, v.z = v.z * 0.5f + 1.f, v.w = v.w * 0.5f + 1.f;
    y[i] = v;
  }
}

__global__ void add_kernel(float4* y, const float4* z, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float4 v = y[i];
    const float4 w = z[i];
    v.x += w.x, v.y += w.y, v.z += w.z, v.w += w.w;
    y[i] = v;
  }
}

__global__ void read_kernel(const float4* y, int64_t n4, float* sink) {
  float s = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = y[i];
    s += v.x + v.y + v.z + v.w;
  }
  if (s == 12345.f) sink[blockIdx.x] = s;  // never true for the zeros read: keeps the loads
}

// Makes the 16 loaded vectors live at once, so that ptxas issues all 16 loads before the first
// wait instead of interleaving loads and adds (4 in flight).
__device__ __forceinline__ void all_loaded(uint4 (&v)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(v[i].x), "+r"(v[i].y), "+r"(v[i].z), "+r"(v[i].w));
}

// Reads in a TMA box's pattern: bands of 256 rows `stride16` 16-byte units apart (a weight's rows),
// each step kPiece bytes of every row of the band (the GEMM's k step), the next kPiece bytes next;
// each thread keeps 16 loads (256 bytes) in flight. seq_read_kernel: the same bytes in flight per
// thread, reading contiguous 64 KiB chunks.
template <int kPiece>
__global__ void __launch_bounds__(256, 2) box_read_kernel(const uint4* y, int64_t bands, int64_t stride16, float* sink) {
  constexpr int kLanesPerRow = kPiece / 16, kRowsPerPass = 256 / kLanesPerRow, kSteps = 256 / kPiece;
  const int r0 = int(threadIdx.x) / kLanesPerRow, c = int(threadIdx.x) % kLanesPerRow;
  const int64_t steps = stride16 / kLanesPerRow;
  float s = 0.f;
  for (int64_t band = blockIdx.x; band < bands; band += gridDim.x) {
    const uint4* base = y + band * 256 * stride16;
    for (int64_t step = 0; step < steps; step += kSteps) {
      uint4 v[16];
#pragma unroll
      for (int u = 0; u < kSteps; ++u)
#pragma unroll
        for (int i = 0; i < kLanesPerRow; ++i)
          v[u * kLanesPerRow + i] = base[(r0 + i * kRowsPerPass) * stride16 + (step + u) * kLanesPerRow + c];
      all_loaded(v);
#pragma unroll
      for (int i = 0; i < 16; ++i) s += __uint_as_float(v[i].x) + __uint_as_float(v[i].y) + __uint_as_float(v[i].z) + __uint_as_float(v[i].w);
    }
  }
  if (s == 12345.f) sink[blockIdx.x] = s;
}

__global__ void __launch_bounds__(256, 2) seq_read_kernel(const uint4* y, int64_t chunks, float* sink) {
  float s = 0.f;
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const uint4* base = y + chunk * 256 * 16;
    uint4 v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = base[i * 256 + threadIdx.x];
    all_loaded(v);
#pragma unroll
    for (int i = 0; i < 16; ++i) s += __uint_as_float(v[i].x) + __uint_as_float(v[i].y) + __uint_as_float(v[i].z) + __uint_as_float(v[i].w);
  }
  if (s == 12345.f) sink[blockIdx.x] = s;
}

__global__ void write_kernel(float4* y, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = make_float4(1.f, 1.f, 1.f, 1.f);
}

// In place by bulk copies: a persistent grid, each block a ring of kStages 16 KiB chunks loaded by
// cp.async.bulk (mbarrier completion), changed in shared memory, stored back by cp.async.bulk; a
// stage is loaded again once its store has read it.
constexpr int kStages = 4, kChunk = 16384;
__global__ void rmw_bulk_kernel(float* y, int64_t chunks) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bar[kStages];
  constexpr int kFloats = kChunk / 4;
  float* buf = reinterpret_cast<float*>(smem);
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(uint32_t(__cvta_generic_to_shared(&bar[s]))));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int64_t count = chunks > blockIdx.x ? (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto load = [&](int64_t it) {
    const int s = int(it % kStages);
    const int64_t c = blockIdx.x + it * gridDim.x;
    const uint32_t b = uint32_t(__cvta_generic_to_shared(&bar[s]));
    const uint32_t d = uint32_t(__cvta_generic_to_shared(buf + s * kFloats));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(kChunk) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d),
                 "l"(y + c * kFloats), "r"(kChunk), "r"(b)
                 : "memory");
  };
  if (tid == 0)
    for (int64_t it = 0; it < kStages && it < count; ++it) load(it);
  for (int64_t it = 0; it < count; ++it) {
    const int s = int(it % kStages);
    const uint32_t parity = uint32_t((it / kStages) & 1);
    const uint32_t b = uint32_t(__cvta_generic_to_shared(&bar[s]));
    asm volatile(
        "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(b),
        "r"(parity)
        : "memory");
    float4* v4 = reinterpret_cast<float4*>(buf + s * kFloats);
    for (int i = tid; i < kFloats / 4; i += blockDim.x) {
      float4 v = v4[i];
      v.x = v.x * 0.5f + 1.f, v.y = v.y * 0.5f + 1.f, v.z = v.z * 0.5f + 1.f, v.w = v.w * 0.5f + 1.f;
      v4[i] = v;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (tid == 0) {
      const int64_t c = blockIdx.x + it * gridDim.x;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(y + c * kFloats),
                   "r"(uint32_t(__cvta_generic_to_shared(buf + s * kFloats))), "r"(kChunk)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      if (it >= 1 && it - 1 + kStages < count) {
        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        load(it - 1 + kStages);
      }
    }
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <class F>
float median_ms(F&& f) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  f();
  for (int round = 0; round < 7; ++round) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < 10; ++i) f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / 10);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  const int64_t mib = argc > 1 ? std::atoll(argv[1]) : 1536;
  const int64_t bytes = mib << 20, n4 = bytes / 16;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  float *y, *z, *sink;
  CK(cudaMalloc(&y, bytes));
  CK(cudaMalloc(&z, bytes));
  CK(cudaMalloc(&sink, 4096 * sizeof(float)));
  CK(cudaMemset(y, 0, bytes));
  CK(cudaMemset(z, 0, bytes));
  const int grid = sms * 8, threads = 256;
  const int bulk_smem = kStages * kChunk;
  CK(cudaFuncSetAttribute(rmw_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bulk_smem));
  std::printf("%s, %d SMs, array %lld MiB; TB/s of bytes read + written\n", prop.name, sms, (long long)mib);
  auto report = [&](const char* what, double moved, float ms) {
    std::printf("  %-44s %8.4f ms  %5.2f TB/s\n", what, ms, moved / ms / 1e9);
  };
  report("copy (cudaMemcpy, 1 read : 1 write)", 2.0 * bytes,
         median_ms([&] { CK(cudaMemcpyAsync(z, y, bytes, cudaMemcpyDeviceToDevice)); }));
  report("in place y = y a + b (16-byte loads)", 2.0 * bytes,
         median_ms([&] { rmw_kernel<<<grid, threads>>>(reinterpret_cast<float4*>(y), n4); }));
  for (int per_sm : {1, 2, 3}) {
    char what[64];
    std::snprintf(what, sizeof what, "in place, bulk copies (%d blocks/SM)", per_sm);
    report(what, 2.0 * bytes,
           median_ms([&] { rmw_bulk_kernel<<<sms * per_sm, 128, bulk_smem>>>(y, bytes / kChunk); }));
  }
  report("y += z (2 reads : 1 write)", 3.0 * bytes,
         median_ms([&] { add_kernel<<<grid, threads>>>(reinterpret_cast<float4*>(y), reinterpret_cast<const float4*>(z), n4); }));
  report("read only (sum)", 1.0 * bytes,
         median_ms([&] { read_kernel<<<grid, threads>>>(reinterpret_cast<const float4*>(z), n4, sink); }));
  // A bf16 weight of K = 2048 (4 KiB rows) read as the GEMM's B boxes, 2 blocks per SM of 16 loads a
  // thread in flight (128 KiB per SM, about the GEMM's ring).
  const int64_t stride16 = 4096 / 16, bands = bytes / (256 * 4096);
  report("read, 64 KiB chunks (2 blocks/SM x 64 KiB in flight)", double(bands) * 256 * 4096,
         median_ms([&] { seq_read_kernel<<<sms * 2, 256>>>(reinterpret_cast<const uint4*>(z), bands * 16, sink); }));
  report("read, boxes of 256 rows x 128 bytes (4 KiB rows)", double(bands) * 256 * 4096,
         median_ms([&] { box_read_kernel<128><<<sms * 2, 256>>>(reinterpret_cast<const uint4*>(z), bands, stride16, sink); }));
  report("read, boxes of 256 rows x 256 bytes (4 KiB rows)", double(bands) * 256 * 4096,
         median_ms([&] { box_read_kernel<256><<<sms * 2, 256>>>(reinterpret_cast<const uint4*>(z), bands, stride16, sink); }));
  report("write only (16-byte stores)", 1.0 * bytes,
         median_ms([&] { write_kernel<<<grid, threads>>>(reinterpret_cast<float4*>(y), n4); }));
  report("write only (cudaMemset)", 1.0 * bytes, median_ms([&] { CK(cudaMemsetAsync(y, 0, bytes)); }));
  CK(cudaFree(y));
  CK(cudaFree(z));
  CK(cudaFree(sink));
  return 0;
}
