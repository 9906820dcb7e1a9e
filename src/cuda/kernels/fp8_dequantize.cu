// The FP8 rows' dequantizer (moe_engine/fp8.hpp): out[r][k] = q[r][k] * scales[k / 128][r] for the
// rows below offsets[G], rounded to out's dtype, with common/fp8_math.hpp's decode and product: the
// CPU backend's bytes. Bound by memory only, so each store instruction of a warp writes 512
// contiguous bytes: a warp takes a segment of 512 values of one row, each lane 16 of them in pieces
// of one 16-byte store (8 bf16/fp16 values or 4 floats, whose 8 or 4 E4M3 bytes are one load);
// piece j of lane l is piece 32 j + l of the segment. Lanes storing 16 consecutive values each
// (their 16 bytes one load) half-filled 32 sectors per store instruction and ran at 0.6 of the
// device copy rate for 16-bit outputs and 0.36 for float (H200); the pieces run at 0.82 to 0.87.
// One grid-stride loop over the segments of the routed rows, whose number it reads on the device;
// the grid comes from the capacity, K and the device's occupancy only (graph safe), and every
// output byte has one writer (deterministic).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/fp8_math.hpp"
#include "cuda/backend.hpp"
#include "cuda/ptx/pair16.cuh"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"
#include "cuda/runtime/resident_blocks.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLaneValues = 16;
constexpr int64_t kSegment = 32 * kLaneValues;  // values of a row per warp-iteration

struct DequantizeParams {
  const uint8_t* data;
  int64_t data_ld;
  const float* scales;
  int64_t scales_ld;
  void* out;
  int64_t out_ld;
  const int64_t* offsets;  // the routing's [G + 1]
  int64_t num_groups;
  int64_t K;
  int64_t segments;  // per row: ceil(K / 512)
};

// A lane's piece for output type T: the values of one 16-byte store, their bytes as 32-bit words.
template <class T>
struct Piece {
  static constexpr int kValues = 16 / int(sizeof(T));  // 8 or 4
  static constexpr int kWords = kValues / 4;
  static constexpr int kPerLane = kLaneValues / kValues;

  static __device__ __forceinline__ void load(const uint8_t* q, uint32_t (&words)[kWords]) {
    if constexpr (kWords == 2) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(q));
      words[0] = v.x, words[1] = v.y;
    } else {
      words[0] = __ldg(reinterpret_cast<const uint32_t*>(q));
    }
  }
  // 16 bytes at `out`: floats, or pairs packed by one conversion each (round to nearest even).
  static __device__ __forceinline__ void store(const float (&v)[kValues], T* out) {
    if constexpr (std::is_same_v<T, float>)
      *reinterpret_cast<float4*>(out) = make_float4(v[0], v[1], v[2], v[3]);
    else
      *reinterpret_cast<uint4*>(out) =
          make_uint4(Pair16<T>::pack(v[0], v[1]), Pair16<T>::pack(v[2], v[3]),
                     Pair16<T>::pack(v[4], v[5]), Pair16<T>::pack(v[6], v[7]));
  }
};

// One lane's 16 values of the segment in `row` whose lane-first value is `base`. kVector: out's
// rows allow 16-byte stores (address and row stride multiples of 16 bytes), else element stores.
// kWhole: the segment lies inside the row (warp-uniform; the common case, with no checks); else a
// piece past K is skipped and one that K cuts goes element by element (its bytes past K may lie
// past the tensor).
template <class T, bool kVector, bool kWhole>
__device__ __forceinline__ void dequantize_lane(const DequantizeParams& p, int64_t row,
                                                int64_t base) {
  using Pc = Piece<T>;
  // The lane's pieces are 32 pieces apart: whole scale blocks (1 or 2).
  constexpr int kPieceStride = 32 * Pc::kValues, kBlocksApart = kPieceStride / int(kFp8Block);
  const uint8_t* q = p.data + row * p.data_ld + base;
  const float* s = p.scales + base / kFp8Block * p.scales_ld + row;
  T* o = static_cast<T*>(p.out) + row * p.out_ld + base;
  const int64_t left = p.K - base;  // values of the row from the lane's first on
  const auto whole = [&](int k) { return kWhole || k + Pc::kValues <= left; };
  // All of the lane's loads before the first use.
  uint32_t words[Pc::kPerLane][Pc::kWords];
  float scale[Pc::kPerLane];
#pragma unroll
  for (int j = 0; j < Pc::kPerLane; ++j) {
    if (whole(j * kPieceStride)) Pc::load(q + j * kPieceStride, words[j]);
    if (kWhole || j * kPieceStride < left) scale[j] = s[j * kBlocksApart * p.scales_ld];
  }
#pragma unroll
  for (int j = 0; j < Pc::kPerLane; ++j) {
    const int k = j * kPieceStride;
    if (whole(k)) {
      float v[Pc::kValues];
#pragma unroll
      for (int i = 0; i < Pc::kValues / 2; ++i)
        detail::e4m3x2_to_float(uint16_t(words[j][i / 2] >> (16 * (i % 2))), v[2 * i],
                                v[2 * i + 1]);
#pragma unroll
      for (int i = 0; i < Pc::kValues; ++i) v[i] = detail::fp8_dequantize(v[i], scale[j]);
      if constexpr (kVector) {
        Pc::store(v, o + k);
      } else {
#pragma unroll
        for (int i = 0; i < Pc::kValues; ++i) from_float(v[i], o + k + i);
      }
    } else if (k < left) {
      for (int c = k; c < left; ++c)
        from_float(detail::fp8_dequantize(detail::e4m3_to_float(q[c]), scale[j]), o + c);
    }
  }
}

template <class T, bool kVector>
__global__ void __launch_bounds__(kThreads) dequantize_rows_kernel(const DequantizeParams p) {
  const int lane = int(threadIdx.x % 32u);
  const int64_t rows = p.offsets[p.num_groups];
  const int64_t stride = int64_t(gridDim.x) * kWarps;
  const int64_t first = int64_t(blockIdx.x) * kWarps + int64_t(threadIdx.x) / 32;
  // The warp's (row, segment), stepped by the grid's stride with no division per segment.
  int64_t row = first / p.segments, segment = first % p.segments;
  const int64_t row_step = stride / p.segments, segment_step = stride % p.segments;
  while (row < rows) {
    const int64_t base = segment * kSegment + lane * Piece<T>::kValues;
    if ((segment + 1) * kSegment <= p.K)
      dequantize_lane<T, kVector, true>(p, row, base);
    else
      dequantize_lane<T, kVector, false>(p, row, base);
    segment += segment_step;
    row += row_step;
    if (segment >= p.segments) segment -= p.segments, ++row;
  }
}

template <class T, bool kVector>
void launch_dequantize(const DequantizeParams& p, int64_t capacity, int device, Stream stream) {
  constexpr auto kernel = dequantize_rows_kernel<T, kVector>;
  const int64_t warps = capacity * p.segments;
  const int64_t grid = std::min<int64_t>((warps + kWarps - 1) / kWarps,
                                         resident_blocks<kernel>(device, kThreads, 0, "dequantize_rows_kernel"));
  kernel<<<unsigned(grid), kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH("dequantize_rows_kernel");
}

}  // namespace

void dequantize_fp8(const Fp8Rows& rows, const GroupLayout& groups, const TensorView& out,
                    Stream stream) {
  const int64_t T = groups.capacity(), K = rows.data.size(1);
  if (T == 0 || K == 0) return;
  DequantizeParams p{};
  p.data = rows.data.data_as<uint8_t>();
  p.data_ld = rows.data.stride(0);
  p.scales = rows.scales.data_as<float>();
  p.scales_ld = rows.scales.stride(0);
  p.out = out.data();
  p.out_ld = out.stride(0);
  p.offsets = groups.offsets().data_as<int64_t>();
  p.num_groups = groups.num_groups();
  p.K = K;
  p.segments = (K + kSegment - 1) / kSegment;
  const int device = out.device().index;
  with_cuda_type(out.dtype(), "dequantize_fp8", [&](auto type) {
    using T_ = decltype(type);
    if (is_aligned(out.data(), 16) && out.stride(0) * int64_t(sizeof(T_)) % 16 == 0)
      launch_dequantize<T_, true>(p, T, device, stream);
    else
      launch_dequantize<T_, false>(p, T, device, stream);
  });
}

}  // namespace moe::cuda
