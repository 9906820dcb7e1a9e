#include <algorithm>
#include <climits>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/runtime/check.hpp"
#include "cuda/runtime/device_traits.hpp"
#include "cuda/backend.hpp"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;  // one chunk covers G <= 256; larger G loops

struct Minimum {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return b < a ? b : a; }
};

// Sum of non-negative values that sticks at INT64_MAX instead of overflowing (still associative).
struct SaturatingAdd {
  __device__ int64_t operator()(int64_t a, int64_t b) const {
    return a > LLONG_MAX - b ? LLONG_MAX : a + b;
  }
};

template <class SplitT>
__global__ void __launch_bounds__(kThreads)
    group_offsets_kernel(const SplitT* __restrict__ splits, int64_t num_groups, int64_t capacity,
                         int64_t* __restrict__ offsets, DeviceErrorRecord* __restrict__ record) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;

  int64_t carry = 0;  // sum of the sanitized splits before this chunk (same in all threads)
  int64_t first_negative = LLONG_MAX;
  for (int64_t base = 0; base < num_groups; base += kThreads) {
    const int64_t g = base + threadIdx.x;
    const int64_t raw = g < num_groups ? int64_t(splits[g]) : 0;
    int64_t prefix = 0, chunk_total = 0;
    Scan(temp.scan).ExclusiveScan(raw < 0 ? 0 : raw, prefix, int64_t(0), SaturatingAdd(),
                                  chunk_total);
    if (g < num_groups) {
      const int64_t off = SaturatingAdd()(carry, prefix);
      offsets[g] = off < capacity ? off : capacity;
    }
    carry = SaturatingAdd()(carry, chunk_total);
    __syncthreads();  // temp storage is reused by the reduction
    const int64_t neg = Reduce(temp.reduce).Reduce(raw < 0 ? g : LLONG_MAX, Minimum());
    if (threadIdx.x == 0 && neg < first_negative) first_negative = neg;
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  offsets[num_groups] = carry < capacity ? carry : capacity;
  uint32_t bits = 0;
  if (first_negative != LLONG_MAX) bits |= kNegativeSplit;
  if (carry > capacity) bits |= kSplitsExceedCapacity;
  if (bits == 0) return;
  // The first kernel to report a splits error fills in the details; later ones only add their bits.
  if ((atomicOr(&record->bits, bits) & (kNegativeSplit | kSplitsExceedCapacity)) == 0) {
    record->group = first_negative != LLONG_MAX ? int32_t(first_negative) : -1;
    record->value = first_negative != LLONG_MAX ? int64_t(splits[first_negative]) : 0;
    record->total = carry;
    record->capacity = capacity;
  }
}

}  // namespace

void launch_group_offsets(const void* splits, bool splits_are_int32, int64_t num_groups,
                          int64_t capacity, int64_t* offsets, DeviceErrorRecord* record,
                          Stream stream) {
  if (splits_are_int32)
    group_offsets_kernel<<<1, kThreads, 0, stream>>>(static_cast<const int32_t*>(splits),
                                                     num_groups, capacity, offsets, record);
  else
    group_offsets_kernel<<<1, kThreads, 0, stream>>>(static_cast<const int64_t*>(splits),
                                                     num_groups, capacity, offsets, record);
  MOE_CUDA_CHECK_LAUNCH("group_offsets_kernel");
}

namespace {

constexpr int kZeroThreads = 512;

// One block per SM, grid-striding over each target's tail: 16-byte words where the target allows
// them, bytes otherwise. When sum(splits) == T (the common case) every block reads offsets[G] and
// leaves, so the launch costs little more than its dispatch.
__global__ void __launch_bounds__(kZeroThreads)
    zero_tails_kernel(ZeroTailTargets targets, const int64_t* __restrict__ end_offset) {
  const int64_t end = *end_offset;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, lane = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int k = 0; k < targets.count; ++k) {
    uint8_t* const data = targets.data[k];
    const int64_t rows = targets.rows[k], row_bytes = targets.row_bytes[k];
    const int64_t first = (end < 0 ? 0 : end > rows ? rows : end) * row_bytes, last = rows * row_bytes;
    if (((reinterpret_cast<uintptr_t>(data) | uintptr_t(first) | uintptr_t(last)) & 15) == 0) {
      for (int64_t i = first / 16 + lane; i < last / 16; i += stride)
        reinterpret_cast<uint4*>(data)[i] = make_uint4(0, 0, 0, 0);
    } else {
      for (int64_t i = first + lane; i < last; i += stride) data[i] = 0;
    }
  }
}

}  // namespace

void launch_zero_unrouted_rows(const ZeroTailTargets& targets, const int64_t* end_offset, Stream stream) {
  int64_t words = 0;
  for (int k = 0; k < targets.count; ++k) words += (targets.rows[k] * targets.row_bytes[k] + 15) / 16;
  if (words == 0) return;
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device), "cudaGetDevice");
  const int blocks = int(std::min<int64_t>((words + kZeroThreads - 1) / kZeroThreads, device_traits(device).sm_count));
  zero_tails_kernel<<<blocks, kZeroThreads, 0, stream>>>(targets, end_offset);
  MOE_CUDA_CHECK_LAUNCH("zero_tails_kernel");
}

}  // namespace moe::cuda
