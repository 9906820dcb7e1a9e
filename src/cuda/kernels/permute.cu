// Permute and unpermute on CUDA (docs/design.md section 14), with the CPU backend's bits.
//
// The plan is a stable counting sort of the T k assignments in three kernels over chunks of
// detail::kPlanChunk assignments in token order: count each chunk's assignments per expert, scan
// the counts (each chunk's first rank within every expert; the kept counts; each expert's first
// row), then rank each chunk's assignments in order. Ranks inside a chunk come from warp matching
// in lane order and per-warp counts added in warp order, never from the order in which atomics
// land, so the plan is the same every run.
//
// The row kernels take one token per block (grid-striding over T: the grid comes from T only) and
// move 16-byte vectors where the rows allow it: lane l of a block takes vectors l, l + 256, ..., so
// a warp's load or store covers 512 contiguous bytes of a row, and each thread keeps several loads in
// flight. permute loads x[t] once and stores it k times; unpermute loads the token's k rows and sums
// them in float32 in j order.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <initializer_list>
#include <type_traits>

#include "common/permute_order.hpp"
#include "cuda/backend.hpp"
#include "cuda/ptx/pair16.cuh"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"

namespace moe::cuda {
namespace {

constexpr unsigned kFullWarp = 0xffffffffu;

// ---- the plan ----

constexpr int kPlanThreads = 256;
constexpr int kPlanWarps = kPlanThreads / 32;
constexpr int kScanThreads = 1024;
static_assert(detail::kPlanChunk % kPlanThreads == 0,
              "a chunk is whole tiles of one assignment per thread");
// The rank kernel keeps two int32 counters and kPlanWarps byte counters per expert in shared memory
// (16 bytes per expert: 32 KiB at this bound, under the default 48 KiB).
constexpr int64_t kMaxPlanExperts = 2048;

// Records `entry` under `bit` unless an earlier report of that kind holds the details already.
__device__ void report_entry(DeviceErrorRecord* record, uint32_t bit, DeviceErrorEntry* details,
                             int64_t position, int64_t topk, int64_t value, int64_t bound) {
  if (record == nullptr || (atomicOr(&record->bits, bit) & bit) != 0) return;
  *details = DeviceErrorEntry{position / topk, position % topk, value, bound};
}

// A block's chunk: assignments [chunk_begin(), chunk_end(n)), walked in tiles of one per thread.
__device__ __forceinline__ int64_t chunk_begin() {
  return int64_t(blockIdx.x) * detail::kPlanChunk;
}
__device__ __forceinline__ int64_t chunk_end(int64_t assignments) {
  const int64_t end = chunk_begin() + detail::kPlanChunk;
  return end < assignments ? end : assignments;
}

// The assignment a thread takes in a tile (none past the chunk's end), and the lanes of its warp
// that hold the same expert (the lowest of them leads; out-of-range and absent ones match each
// other and lead nothing). Called by whole warps.
template <class Index>
struct TileAssignment {
  int64_t i, e;
  bool valid, in_range;
  unsigned same;
  __device__ __forceinline__ TileAssignment(const Index* __restrict__ indices, int64_t tile,
                                            int64_t end, int32_t num_experts)
      : i(tile + threadIdx.x),
        e(i < end ? int64_t(indices[i]) : -1),
        valid(i < end),
        in_range(e >= 0 && e < num_experts),
        same(__match_any_sync(kFullWarp, in_range ? int32_t(e) : -1)) {}
  __device__ __forceinline__ bool leader() const {
    return in_range && int(threadIdx.x % 32) == __ffs(same) - 1;
  }
};

// Each block counts its chunk's assignments per expert into chunk_counts[e][chunk]. Counts are
// sums, the same in any order, so shared-memory atomics (one per expert per warp) are
// deterministic.
template <class Index>
__global__ void __launch_bounds__(kPlanThreads)
    plan_count_kernel(const Index* __restrict__ indices, int64_t assignments, int32_t topk,
                      int32_t num_experts, int32_t* __restrict__ chunk_counts, int64_t chunks,
                      DeviceErrorRecord* record) {
  extern __shared__ int32_t count[];  // [E]
  __shared__ long long first_bad;
  for (int32_t e = threadIdx.x; e < num_experts; e += kPlanThreads) count[e] = 0;
  if (threadIdx.x == 0) first_bad = LLONG_MAX;
  __syncthreads();
  const int64_t end = chunk_end(assignments);
  for (int64_t tile = chunk_begin(); tile < end; tile += kPlanThreads) {  // uniform: whole warps
    const TileAssignment a(indices, tile, end, num_experts);
    if (a.valid && !a.in_range) atomicMin(&first_bad, (long long)a.i);
    if (a.leader()) atomicAdd(&count[a.e], __popc(a.same));
  }
  __syncthreads();
  for (int32_t e = threadIdx.x; e < num_experts; e += kPlanThreads)
    chunk_counts[int64_t(e) * chunks + blockIdx.x] = count[e];
  if (threadIdx.x == 0 && first_bad != LLONG_MAX)
    report_entry(record, kExpertIndexOutOfRange, &record->index, first_bad, topk,
                 int64_t(indices[first_bad]), num_experts);
}

// One block: each warp turns its experts' chunk counts into exclusive prefixes in place (the rank
// of a chunk's first assignment within the expert) and writes the kept and dropped counts; then
// expert_rows = the exclusive prefix of the kept counts (each expert's first row).
__global__ void __launch_bounds__(kScanThreads)
    plan_scan_kernel(int32_t* __restrict__ chunk_counts, int64_t chunks, int32_t num_experts,
                     int64_t expert_capacity, int64_t* __restrict__ splits,
                     int64_t* __restrict__ dropped, int32_t* __restrict__ expert_rows) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int32_t kept[kMaxPlanExperts];
  const int lane = threadIdx.x % 32;
  for (int32_t e = threadIdx.x / 32; e < num_experts; e += kScanThreads / 32) {
    int32_t* counts = chunk_counts + int64_t(e) * chunks;
    int32_t carry = 0;
    for (int64_t base = 0; base < chunks; base += 32) {
      const int64_t c = base + lane;
      const int32_t n = c < chunks ? counts[c] : 0;
      int32_t inclusive = n;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int32_t below = __shfl_up_sync(kFullWarp, inclusive, d);
        if (lane >= d) inclusive += below;
      }
      if (c < chunks) counts[c] = carry + inclusive - n;
      carry += __shfl_sync(kFullWarp, inclusive, 31);
    }
    if (lane == 0) {
      const int64_t keep = carry < expert_capacity ? carry : expert_capacity;
      kept[e] = int32_t(keep);
      splits[e] = keep;
      if (dropped) dropped[e] = carry - keep;
    }
  }
  __syncthreads();
  int32_t row = 0;
  for (int32_t base = 0; base < num_experts; base += kScanThreads) {
    const int32_t e = base + threadIdx.x;
    int32_t first = 0, total = 0;
    Scan(temp).ExclusiveSum(e < num_experts ? kept[e] : 0, first, total);
    if (e < num_experts) expert_rows[e] = row + first;
    row += total;
    __syncthreads();  // temp is reused
  }
}

// Each block ranks its chunk's assignments, a tile of one per thread at a time: the rank within
// the expert is the chunk's first rank (the scan's), plus the expert's assignments in earlier
// tiles, in earlier warps of this tile and in lower lanes of this warp. Kept ranks (below the
// capacity) give row expert_rows[e] + rank; the others -1.
template <class Index>
__global__ void __launch_bounds__(kPlanThreads)
    plan_rank_kernel(const Index* __restrict__ indices, int64_t assignments, int32_t num_experts,
                     int64_t expert_capacity, const int32_t* __restrict__ chunk_first_ranks,
                     int64_t chunks, const int32_t* __restrict__ expert_rows,
                     int32_t* __restrict__ row_of) {
  extern __shared__ int32_t shared[];
  int32_t* next_rank = shared;                // [E]: the rank of e's next assignment in this chunk
  int32_t* first_row = shared + num_experts;  // [E]
  // [kPlanWarps][E]: the tile's assignments of e in warp w; zero between tiles.
  auto* warp_count = reinterpret_cast<uint8_t*>(shared + 2 * num_experts);
  for (int32_t e = threadIdx.x; e < num_experts; e += kPlanThreads) {
    next_rank[e] = chunk_first_ranks[int64_t(e) * chunks + blockIdx.x];
    first_row[e] = expert_rows[e];
    for (int w = 0; w < kPlanWarps; ++w) warp_count[w * num_experts + e] = 0;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const unsigned lower_lanes = (1u << (threadIdx.x % 32)) - 1;
  const int64_t end = chunk_end(assignments);
  for (int64_t tile = chunk_begin(); tile < end; tile += kPlanThreads) {  // uniform: whole warps
    const TileAssignment a(indices, tile, end, num_experts);
    if (a.leader()) warp_count[warp * num_experts + a.e] = uint8_t(__popc(a.same));
    __syncthreads();
    if (a.valid) {
      int32_t row = -1;
      if (a.in_range) {
        int32_t rank = next_rank[a.e] + __popc(a.same & lower_lanes);
        for (int w = 0; w < warp; ++w) rank += warp_count[w * num_experts + a.e];
        if (rank < expert_capacity) row = first_row[a.e] + rank;
      }
      row_of[a.i] = row;
    }
    __syncthreads();  // every rank of this tile is read before the counters move on
    if (a.leader()) {
      atomicAdd(&next_rank[a.e], __popc(a.same));  // a sum: the same in any order
      warp_count[warp * num_experts + a.e] = 0;
    }
    __syncthreads();
  }
}

// ---- the row kernels ----

constexpr int kThreads = detail::kDotLanes;  // a block's threads are the dot product's lanes
constexpr int kWarps = kThreads / 32;
// Blocks per launch: a fixed bound, enough to fill the GPU; more tokens grid-stride.
constexpr int64_t kMaxBlocks = 2048;

// 16 bytes of a row: kValues elements of T, to and from float.
template <class T>
struct Vector16 {
  static constexpr int kValues = 16 / int(sizeof(T));
  static __device__ __forceinline__ void to_floats(const uint4& w, float (&v)[kValues]) {
    if constexpr (std::is_same_v<T, float>) {
      v[0] = __uint_as_float(w.x), v[1] = __uint_as_float(w.y), v[2] = __uint_as_float(w.z),
      v[3] = __uint_as_float(w.w);
    } else {
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 pair = Pair16<T>::unpack(words[i]);
        v[2 * i] = pair.x, v[2 * i + 1] = pair.y;
      }
    }
  }
  static __device__ __forceinline__ uint4 from_floats(const float (&v)[kValues]) {
    if constexpr (std::is_same_v<T, float>)
      return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                        __float_as_uint(v[3]));
    else
      return make_uint4(Pair16<T>::pack(v[0], v[1]), Pair16<T>::pack(v[2], v[3]),
                        Pair16<T>::pack(v[4], v[5]), Pair16<T>::pack(v[6], v[7]));
  }
};

// Vector v of a row of `cols` elements. kWhole: the rows allow 16-byte accesses (aligned, and cols
// a multiple of kValues); else element by element, the last vector cut at cols (`count` elements).
// load reads the vector of `row`; store writes the same vector of another row, which starts at dst.
template <class T, bool kWhole>
struct RowVector {
  using V = Vector16<T>;
  static constexpr int kValues = V::kValues;
  const T* src;
  int count;
  __device__ __forceinline__ RowVector(const T* row, int64_t v, int64_t cols)
      : src(row + v * kValues),
        count(kWhole || cols - v * kValues >= kValues ? kValues : int(cols - v * kValues)) {}

  __device__ __forceinline__ void load(float (&f)[kValues]) const {
    if constexpr (kWhole) {
      V::to_floats(__ldg(reinterpret_cast<const uint4*>(src)), f);
    } else {
#pragma unroll
      for (int i = 0; i < kValues; ++i) f[i] = i < count ? to_float(src[i]) : 0.f;
    }
  }
  __device__ __forceinline__ void store(T* dst, const float (&f)[kValues]) const {
    if constexpr (kWhole) {
      *reinterpret_cast<uint4*>(dst) = V::from_floats(f);
    } else {
#pragma unroll
      for (int i = 0; i < kValues; ++i)
        if (i < count) from_float(f[i], dst + i);
    }
  }
};

// The bits of one vector, copied unchanged.
template <class T, bool kWhole>
struct RawVector {
  static constexpr int kValues = Vector16<T>::kValues;
  uint4 word;
  T elements[kWhole ? 1 : kValues];
  int count;
  __device__ __forceinline__ RawVector(const T* row, int64_t v, int64_t cols) {
    const T* src = row + v * kValues;
    if constexpr (kWhole) {
      word = __ldg(reinterpret_cast<const uint4*>(src));
    } else {
      count = cols - v * kValues >= kValues ? kValues : int(cols - v * kValues);
#pragma unroll
      for (int i = 0; i < kValues; ++i)
        if (i < count) elements[i] = src[i];
    }
  }
  __device__ __forceinline__ void store(T* dst) const {
    if constexpr (kWhole) {
      *reinterpret_cast<uint4*>(dst) = word;
    } else {
#pragma unroll
      for (int i = 0; i < kValues; ++i)
        if (i < count) dst[i] = elements[i];
    }
  }
};

// Where the token's j-th row points: a routed row, or -1 (dropped). Anything else is reported once
// per token and choice (by one thread) and treated as dropped, so nothing is touched out of bounds.
struct RowMap {
  const int32_t* __restrict__ row_of;
  int32_t topk;
  const int64_t* __restrict__ routed_end;  // offsets[G]
  DeviceErrorRecord* record;

  __device__ __forceinline__ int64_t routed_rows() const { return *routed_end; }
  __device__ __forceinline__ int64_t row(int64_t t, int32_t j, int64_t routed) const {
    const int64_t r = __ldg(row_of + t * topk + j);
    return r >= 0 && r < routed ? r : -1;
  }
  // Called by one thread per (t, j).
  __device__ __forceinline__ void report_if_bad(int64_t t, int32_t j, int64_t routed) const {
    const int64_t r = __ldg(row_of + t * topk + j);
    if (r != -1 && (r < 0 || r >= routed))
      report_entry(record, kRowOutOfRange, &record->row, t * topk + j, topk, r, routed);
  }
};

// 16-byte loads a thread of the row kernels keeps in flight: one at a time leaves them bound by
// latency (~20 KiB in flight per SM are needed at full HBM bandwidth).
constexpr int kLoadsInFlight = 8;

// x_sorted[row(t, j)] = x[t]; probs_sorted[row(t, j)] = probs[t, j]. With whole vectors a thread
// loads kPermuteVectors vectors of the row before storing them.
constexpr int kPermuteVectors = 4;

// dst[row(t, j)] = src_row for every kept j, whole vectors: each thread loads kPermuteVectors
// vectors of the row, then stores them to the k rows. Called by the whole block.
template <class T>
__device__ __forceinline__ void scatter_row(const T* __restrict__ src_row, const RowMap& map, int64_t t,
                                            int64_t routed, int64_t vectors, T* __restrict__ dst,
                                            int64_t ld_dst) {
  const uint4* src = reinterpret_cast<const uint4*>(src_row);
  for (int64_t v0 = threadIdx.x; v0 < vectors; v0 += kThreads * kPermuteVectors) {
    uint4 words[kPermuteVectors];
#pragma unroll
    for (int u = 0; u < kPermuteVectors; ++u)
      if (v0 + u * kThreads < vectors) words[u] = __ldg(src + v0 + u * kThreads);
    for (int32_t j = 0; j < map.topk; ++j) {
      const int64_t row = map.row(t, j, routed);
      if (row < 0) continue;
      uint4* out = reinterpret_cast<uint4*>(dst + row * ld_dst);
#pragma unroll
      for (int u = 0; u < kPermuteVectors; ++u)
        if (v0 + u * kThreads < vectors) out[v0 + u * kThreads] = words[u];
    }
  }
}

template <class T, bool kWhole>
__global__ void __launch_bounds__(kThreads)
    permute_kernel(const T* __restrict__ x, int64_t ldx, int64_t tokens, int64_t cols,
                   const float* __restrict__ probs, RowMap map, T* __restrict__ x_sorted,
                   int64_t ld_sorted, float* __restrict__ probs_sorted) {
  constexpr int kValues = Vector16<T>::kValues;
  const int64_t routed = map.routed_rows(), vectors = (cols + kValues - 1) / kValues;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int32_t j = threadIdx.x; j < map.topk; j += kThreads) {
      map.report_if_bad(t, j, routed);
      const int64_t row = map.row(t, j, routed);
      if (probs && row >= 0) probs_sorted[row] = probs[t * map.topk + j];
    }
    if constexpr (kWhole) {
      scatter_row(x + t * ldx, map, t, routed, vectors, x_sorted, ld_sorted);
    } else {
      for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
        const RawVector<T, kWhole> chunk(x + t * ldx, v, cols);
        for (int32_t j = 0; j < map.topk; ++j) {
          const int64_t row = map.row(t, j, routed);
          if (row >= 0) chunk.store(x_sorted + row * ld_sorted + v * kValues);
        }
      }
    }
  }
}

// y[t] = sum_j p[t, j] out[row(t, j)] in float32, j in order;
// gathered[t, j] = sorted_probs[row(t, j)]. With whole vectors a thread sums kVecs vectors of the
// row at once, kLoadsInFlight / kVecs of the token's rows per batch of loads (unpermute picks kVecs
// from topk so that a batch has about kLoadsInFlight loads), each batch summed in j order.
template <class T, bool kWhole, int kVecs>
__global__ void __launch_bounds__(kThreads)
    unpermute_kernel(const T* __restrict__ out, int64_t ldo, const float* __restrict__ probs,
                     RowMap map, int64_t tokens, int64_t cols, T* __restrict__ y, int64_t ldy,
                     const float* __restrict__ sorted_probs, float* __restrict__ gathered) {
  constexpr int kValues = Vector16<T>::kValues;
  constexpr int kBatch = kLoadsInFlight / kVecs;
  const int64_t routed = map.routed_rows(), vectors = (cols + kValues - 1) / kValues;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int32_t j = threadIdx.x; j < map.topk; j += kThreads) {
      map.report_if_bad(t, j, routed);
      const int64_t row = map.row(t, j, routed);
      if (gathered) gathered[t * map.topk + j] = row >= 0 ? sorted_probs[row] : 0.f;
    }
    if constexpr (kWhole) {
      for (int64_t v0 = threadIdx.x; v0 < vectors; v0 += kThreads * kVecs) {
        float sum[kVecs][kValues] = {};
        for (int32_t j0 = 0; j0 < map.topk; j0 += kBatch) {
          int64_t rows[kBatch];
          uint4 words[kBatch][kVecs];
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            rows[b] = j0 + b < map.topk ? map.row(t, j0 + b, routed) : -1;
            const uint4* src = reinterpret_cast<const uint4*>(out + rows[b] * ldo);
#pragma unroll
            for (int u = 0; u < kVecs; ++u)
              if (rows[b] >= 0 && v0 + u * kThreads < vectors) words[b][u] = __ldg(src + v0 + u * kThreads);
          }
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            if (rows[b] < 0) continue;  // dropped (or past topk): no term
            const float p = probs ? __ldg(probs + t * map.topk + j0 + b) : 1.f;
#pragma unroll
            for (int u = 0; u < kVecs; ++u) {
              float term[kValues];
              Vector16<T>::to_floats(words[b][u], term);
#pragma unroll
              for (int i = 0; i < kValues; ++i)
                sum[u][i] = __fadd_rn(sum[u][i], __fmul_rn(p, term[i]));  // no FMA: the CPU's roundings
            }
          }
        }
#pragma unroll
        for (int u = 0; u < kVecs; ++u)
          if (v0 + u * kThreads < vectors)
            reinterpret_cast<uint4*>(y + t * ldy)[v0 + u * kThreads] = Vector16<T>::from_floats(sum[u]);
      }
    } else {
      for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
        float sum[kValues] = {};
        for (int32_t j = 0; j < map.topk; ++j) {
          const int64_t row = map.row(t, j, routed);
          if (row < 0) continue;  // dropped: no term
          const float p = probs ? __ldg(probs + t * map.topk + j) : 1.f;
          float term[kValues];
          RowVector<T, kWhole>(out + row * ldo, v, cols).load(term);
#pragma unroll
          for (int i = 0; i < kValues; ++i) sum[i] = __fadd_rn(sum[i], __fmul_rn(p, term[i]));
        }
        RowVector<T, kWhole>(y + t * ldy, v, cols).store(y + t * ldy + v * kValues, sum);
      }
    }
  }
}

// d_out[row(t, j)] = p[t, j] dy[t] (a copy without probs); d_probs[t, j] = <dy[t], out[row(t, j)]>
// in the lane order of common/permute_order.hpp.
template <class T, bool kWhole>
__global__ void __launch_bounds__(kThreads)
    unpermute_backward_kernel(const T* __restrict__ dy, int64_t ldd, const T* __restrict__ out,
                              int64_t ldo, const float* __restrict__ probs, RowMap map,
                              int64_t tokens, int64_t cols, T* __restrict__ d_out, int64_t ld_dout,
                              float* __restrict__ d_probs) {
  constexpr int kValues = Vector16<T>::kValues;
  __shared__ float warp_sums[kWarps];
  const int64_t routed = map.routed_rows(), vectors = (cols + kValues - 1) / kValues;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const T* g_row = dy + t * ldd;
    if constexpr (kWhole) {
      if (!probs) {  // a copy: permute's scatter (the bad rows reported as below)
        for (int32_t j = threadIdx.x; j < map.topk; j += kThreads) map.report_if_bad(t, j, routed);
        scatter_row(g_row, map, t, routed, vectors, d_out, ld_dout);
        continue;
      }
    }
    for (int32_t j = 0; j < map.topk; ++j) {  // uniform: every thread sees the same row
      const int64_t row = map.row(t, j, routed);
      if (row < 0) {
        if (threadIdx.x == 0) {
          map.report_if_bad(t, j, routed);
          if (d_probs) d_probs[t * map.topk + j] = 0.f;
        }
        continue;
      }
      T* dst = d_out + row * ld_dout;
      if (!probs) {
        for (int64_t v = threadIdx.x; v < vectors; v += kThreads)
          RawVector<T, kWhole>(g_row, v, cols).store(dst + v * kValues);
        continue;
      }
      const float p = __ldg(probs + t * map.topk + j);
      float dot = 0.f;
      for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
        const RowVector<T, kWhole> at(g_row, v, cols);
        float g[kValues], scaled[kValues];
        at.load(g);
#pragma unroll
        for (int i = 0; i < kValues; ++i) scaled[i] = __fmul_rn(p, g[i]);
        at.store(dst + v * kValues, scaled);
        if (d_probs) {
          float o[kValues];
          RowVector<T, kWhole>(out + row * ldo, v, cols).load(o);
#pragma unroll
          for (int i = 0; i < kValues; ++i)
            if (i < at.count) dot = __fadd_rn(dot, __fmul_rn(g[i], o[i]));
        }
      }
      if (!d_probs) continue;
#pragma unroll
      for (int m = detail::kDotWarpLanes / 2; m >= 1; m /= 2)
        dot = dot + __shfl_xor_sync(kFullWarp, dot, m);
      if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = dot;
      __syncthreads();
      if (threadIdx.x == 0) {
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
        d_probs[t * map.topk + j] = total;
      }
      __syncthreads();  // warp_sums is reused by the next row
    }
  }
}

unsigned grid_for(int64_t tokens) { return unsigned(std::min(tokens, kMaxBlocks)); }

// Whether every row of these 2-D tensors (undefined ones aside) allows 16-byte accesses.
bool rows_take_vectors(std::initializer_list<TensorView> tensors, int64_t cols) {
  for (const TensorView& t : tensors) {
    if (!t.defined()) continue;
    const auto bytes = int64_t(t.element_size());
    if (!is_aligned(t.data(), 16) || (t.stride(0) * bytes) % 16 != 0 || (cols * bytes) % 16 != 0)
      return false;
  }
  return true;
}

// fn(std::bool_constant<whole>) for the row kernels' vector mode.
template <class Fn>
void with_row_vectors(bool whole, Fn&& fn) {
  if (whole)
    fn(std::true_type{});
  else
    fn(std::false_type{});
}

RowMap row_map(const TensorView& row_of, const GroupLayout& groups) {
  return {row_of.data_as<const int32_t>(), int32_t(row_of.size(1)),
          groups.offsets().data_as<const int64_t>() + groups.num_groups(), groups.error_record()};
}

const float* floats_or_null(const TensorView& t) {
  return t.defined() ? t.data_as<const float>() : nullptr;
}
float* mutable_floats_or_null(const TensorView& t) {
  return t.defined() ? t.data_as<float>() : nullptr;
}

void check_topk(int64_t topk, const char* op) {
  if (topk > INT32_MAX)
    throw_error(ErrorCode::kNotImplemented, op, " on CUDA: k = ", topk,
                " choices per token (at most 2^31 - 1)");
}

// ---- the expert-parallel send plan ----
// Block d takes destination d: it walks all assignments in token order, one per thread a tile, and
// ranks the ones going to d by ballots in lane order and per-warp counts added in warp order (the
// same every run). Block 0 also writes -1 for the assignments no destination takes and reports an
// index outside [0, P L).
constexpr int kSendThreads = 256;
constexpr int kSendWarps = kSendThreads / 32;

template <class Index>
__global__ void __launch_bounds__(kSendThreads)
    send_plan_kernel(const Index* __restrict__ indices, const int32_t* __restrict__ kept, int64_t assignments,
                     int32_t topk, int64_t local_experts, int64_t ranks, int64_t capacity,
                     int32_t* __restrict__ row_send, int32_t* __restrict__ ids, int64_t* __restrict__ splits,
                     int64_t* __restrict__ dropped, DeviceErrorRecord* record) {
  __shared__ int32_t warp_counts[kSendWarps];
  __shared__ long long first_bad;
  const int64_t d = blockIdx.x, experts = ranks * local_experts;
  const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32);
  if (threadIdx.x == 0) first_bad = LLONG_MAX;
  __syncthreads();
  int64_t sent_before = 0;  // this destination's assignments in earlier tiles (uniform)
  for (int64_t tile = 0; tile < assignments; tile += kSendThreads) {
    const int64_t i = tile + threadIdx.x;
    const bool valid = i < assignments;
    const int64_t e = valid ? int64_t(indices[i]) : -1;
    const bool in_range = e >= 0 && e < experts;
    const bool taken = in_range && (kept == nullptr || kept[i] >= 0);
    const bool mine = taken && e / local_experts == d;
    if (d == 0 && valid && !taken) {
      row_send[i] = -1;
      if (!in_range) atomicMin(&first_bad, (long long)i);
    }
    const unsigned ballot = __ballot_sync(kFullWarp, mine);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int64_t rank = sent_before + __popc(ballot & ((1u << lane) - 1u));
    int64_t tile_total = 0;
    for (int w = 0; w < kSendWarps; ++w) {
      if (w < warp) rank += warp_counts[w];
      tile_total += warp_counts[w];
    }
    if (mine) {
      if (rank < capacity) {
        row_send[i] = int32_t(d * capacity + rank);
        ids[d * capacity + rank] = int32_t(e - d * local_experts);
      } else {
        row_send[i] = -1;
      }
    }
    sent_before += tile_total;
    __syncthreads();  // warp_counts is rewritten by the next tile
  }
  for (int64_t r = sent_before + threadIdx.x; r < capacity; r += kSendThreads)
    ids[d * capacity + r] = int32_t(local_experts);  // rows nothing is sent in
  if (threadIdx.x == 0) {
    splits[d] = capacity;
    if (dropped != nullptr) dropped[d] = sent_before > capacity ? sent_before - capacity : 0;
    if (first_bad != LLONG_MAX)
      report_entry(record, kExpertIndexOutOfRange, &record->index, first_bad, topk, int64_t(indices[first_bad]),
                   experts);
  }
}

}  // namespace

void permute_plan(const TensorView& indices, int64_t expert_capacity, const TensorView& row_of,
                  const TensorView& splits, const TensorView& dropped,
                  const TensorView& chunk_counts, const TensorView& expert_rows,
                  DeviceErrorRecord* record, Stream stream) {
  const int64_t assignments = indices.numel(), E = splits.size(0),
                chunks = detail::plan_chunks(assignments);
  if (E > kMaxPlanExperts)
    throw_error(ErrorCode::kNotImplemented, "permute_plan on CUDA: E = ", E, " experts (at most ",
                kMaxPlanExperts, ": the plan keeps counters per expert in shared memory)");
  auto launch = [&](const auto* idx) {
    if (chunks > 0) {
      plan_count_kernel<<<unsigned(chunks), kPlanThreads, size_t(E) * sizeof(int32_t), stream>>>(
          idx, assignments, int32_t(indices.size(1)), int32_t(E), chunk_counts.data_as<int32_t>(),
          chunks, record);
      MOE_CUDA_CHECK_LAUNCH("plan_count_kernel");
    }
    plan_scan_kernel<<<1, kScanThreads, 0, stream>>>(
        chunk_counts.data_as<int32_t>(), chunks, int32_t(E), expert_capacity,
        splits.data_as<int64_t>(), dropped.defined() ? dropped.data_as<int64_t>() : nullptr,
        expert_rows.data_as<int32_t>());
    MOE_CUDA_CHECK_LAUNCH("plan_scan_kernel");
    if (chunks > 0) {
      const size_t shared = size_t(E) * (2 * sizeof(int32_t) + kPlanWarps);
      plan_rank_kernel<<<unsigned(chunks), kPlanThreads, shared, stream>>>(
          idx, assignments, int32_t(E), expert_capacity, chunk_counts.data_as<const int32_t>(),
          chunks, expert_rows.data_as<const int32_t>(), row_of.data_as<int32_t>());
      MOE_CUDA_CHECK_LAUNCH("plan_rank_kernel");
    }
  };
  if (indices.dtype() == DType::kInt32)
    launch(indices.data_as<const int32_t>());
  else
    launch(indices.data_as<const int64_t>());
}

void send_plan(const TensorView& indices, const TensorView& row_of_expert, int64_t local_experts, int64_t capacity,
               const TensorView& row_send, const TensorView& ids, const TensorView& splits, const TensorView& dropped,
               DeviceErrorRecord* record, Stream stream) {
  const int64_t P = splits.size(0);
  auto launch = [&](const auto* idx) {
    send_plan_kernel<<<unsigned(P), kSendThreads, 0, stream>>>(
        idx, row_of_expert.defined() ? row_of_expert.data_as<const int32_t>() : nullptr, indices.numel(),
        int32_t(indices.size(1)), local_experts, P, capacity, row_send.data_as<int32_t>(), ids.data_as<int32_t>(),
        splits.data_as<int64_t>(), dropped.defined() ? dropped.data_as<int64_t>() : nullptr, record);
    MOE_CUDA_CHECK_LAUNCH("send_plan_kernel");
  };
  if (indices.dtype() == DType::kInt32)
    launch(indices.data_as<const int32_t>());
  else
    launch(indices.data_as<const int64_t>());
}

void permute(const TensorView& x, const TensorView& probs, const TensorView& row_of,
             const GroupLayout& groups, const TensorView& x_sorted, const TensorView& probs_sorted,
             Stream stream) {
  const int64_t T = x.size(0), H = x.size(1);
  check_topk(row_of.size(1), "permute");
  if (T == 0) return;
  with_cuda_type(x.dtype(), "permute", [&](auto type) {
    using T_ = decltype(type);
    with_row_vectors(rows_take_vectors({x, x_sorted}, H), [&](auto whole) {
      permute_kernel<T_, decltype(whole)::value><<<grid_for(T), kThreads, 0, stream>>>(
          x.data_as<const T_>(), x.stride(0), T, H, floats_or_null(probs), row_map(row_of, groups),
          x_sorted.data_as<T_>(), x_sorted.stride(0), mutable_floats_or_null(probs_sorted));
      MOE_CUDA_CHECK_LAUNCH("permute_kernel");
    });
  });
}

void unpermute(const TensorView& out, const TensorView& probs, const TensorView& row_of,
               const GroupLayout& groups, const TensorView& y, const TensorView& sorted_probs,
               const TensorView& gathered, Stream stream) {
  const int64_t T = y.size(0), H = y.size(1);
  check_topk(row_of.size(1), "unpermute");
  if (T == 0) return;
  with_cuda_type(out.dtype(), "unpermute", [&](auto type) {
    using T_ = decltype(type);
    with_row_vectors(rows_take_vectors({out, y}, H), [&](auto whole) {
      constexpr bool kWhole = decltype(whole)::value;
      // About kLoadsInFlight loads per batch (k rows x kVecs vectors), and no vector slot that no
      // thread of the block fills (H = 4096 bf16: 512 vectors, at most 2 a thread of 256).
      // Without whole vectors kVecs is unused: one instance.
      const int64_t k = row_of.size(1), vectors = (H * int64_t(sizeof(T_)) + 15) / 16;
      const int vecs = k >= 8 || vectors <= kThreads ? 1 : k >= 4 || vectors <= 2 * kThreads ? 2 : 4;
      auto kernel = unpermute_kernel<T_, kWhole, 1>;
      if constexpr (kWhole) {
        if (vecs == 2) kernel = unpermute_kernel<T_, kWhole, 2>;
        if (vecs == 4) kernel = unpermute_kernel<T_, kWhole, 4>;
      }
      kernel<<<grid_for(T), kThreads, 0, stream>>>(out.data_as<const T_>(), out.stride(0), floats_or_null(probs),
                                                   row_map(row_of, groups), T, H, y.data_as<T_>(), y.stride(0),
                                                   floats_or_null(sorted_probs), mutable_floats_or_null(gathered));
      MOE_CUDA_CHECK_LAUNCH("unpermute_kernel");
    });
  });
}

void unpermute_backward(const TensorView& dy, const TensorView& out, const TensorView& probs,
                        const TensorView& row_of, const GroupLayout& groups,
                        const TensorView& d_out, const TensorView& d_probs, Stream stream) {
  const int64_t T = dy.size(0), H = dy.size(1);
  check_topk(row_of.size(1), "unpermute_backward");
  if (T == 0) return;
  with_cuda_type(dy.dtype(), "unpermute_backward", [&](auto type) {
    using T_ = decltype(type);
    const TensorView read_out = d_probs.defined() ? out : TensorView();
    with_row_vectors(rows_take_vectors({dy, d_out, read_out}, H), [&](auto whole) {
      unpermute_backward_kernel<T_, decltype(whole)::value><<<grid_for(T), kThreads, 0, stream>>>(
          dy.data_as<const T_>(), dy.stride(0),
          read_out.defined() ? read_out.data_as<const T_>() : nullptr,
          read_out.defined() ? read_out.stride(0) : 0, floats_or_null(probs),
          row_map(row_of, groups), T, H, d_out.data_as<T_>(), d_out.stride(0),
          mutable_floats_or_null(d_probs));
      MOE_CUDA_CHECK_LAUNCH("unpermute_backward_kernel");
    });
  });
}

}  // namespace moe::cuda
