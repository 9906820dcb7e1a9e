// Deterministic bias-gradient kernels: each output element is reduced by one thread (dbias) or one
// warp with a fixed shuffle tree (dscales), in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/bias_grad.hpp"
#include "cuda/check.hpp"

namespace moe::cuda {
namespace {

__device__ __forceinline__ float load_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ void store_float(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void store_float(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_float(float* p, float v) { *p = v; }

constexpr int kDbiasThreads = 128;

// grid (ceil(N / 128), G): one thread per (group, column), summing the group's rows in order.
template <class In, class Out>
__global__ void dbias_kernel(const In* __restrict__ dy, int64_t ld,
                             const int64_t* __restrict__ offsets, int64_t n, ExpertAddress db,
                             const float* __restrict__ scale, bool accumulate) {
  const int64_t col = int64_t(blockIdx.x) * kDbiasThreads + threadIdx.x;
  const int64_t g = blockIdx.y;
  if (col >= n) return;
  const int64_t begin = offsets[g], end = offsets[g + 1];
  if (accumulate && begin == end) return;
  float sum = 0.f;
  for (int64_t r = begin; r < end; ++r)
    sum += (scale ? scale[r] : 1.f) * load_float(dy + r * ld + col);
  const ExpertAddress address =
      db;  // a local copy: calling a member on a kernel parameter spills it
  Out* out = address.at<Out>(g) + col;
  store_float(out, accumulate ? load_float(out) + sum : sum);
}

// One warp per row r < offsets[G]; the row's expert is found by binary search over the offsets.
template <class In, class B>
__global__ void dscales_kernel(const In* __restrict__ dy, int64_t ld, ExpertAddress bias,
                               const int64_t* __restrict__ offsets, int64_t num_groups, int64_t n,
                               float* __restrict__ out, bool accumulate) {
  const int64_t rows = offsets[num_groups];
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const unsigned lane = threadIdx.x % 32;
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows;
       r += warps) {
    int64_t lo = 0, hi = num_groups - 1;  // last g with offsets[g] <= r
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= r)
        lo = mid;
      else
        hi = mid - 1;
    }
    float sum = 0.f;
    const ExpertAddress address = bias;
    const B* b = address.at<const B>(lo);
    for (int64_t c = lane; c < n; c += 32) sum += load_float(dy + r * ld + c) * load_float(b + c);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) out[r] = accumulate ? out[r] + sum : sum;
  }
}

template <class F>
void with_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
    case DType::kFloat16:
      return f(__half{});
    case DType::kFloat32:
      return f(float{});
    default:
      throw_error(ErrorCode::kNotImplemented, "bias gradients on CUDA: no kernel for ",
                  dtype_name(dtype));
  }
}

}  // namespace

void launch_dbias(const TensorView& dy, const GroupLayout& groups, const ExpertAddress& db,
                  DType db_dtype, bool accumulate, const TensorView& row_scale, Stream stream) {
  const int64_t n = dy.size(1), G = groups.num_groups();
  const dim3 grid(unsigned((n + kDbiasThreads - 1) / kDbiasThreads), unsigned(G));
  const float* scale = row_scale.defined() ? row_scale.data_as<float>() : nullptr;
  with_type(dy.dtype(), [&](auto in) {
    with_type(db_dtype, [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      if (n == 0) return;
      dbias_kernel<In, Out><<<grid, kDbiasThreads, 0, stream>>>(dy.data_as<In>(), dy.stride(0),
                                                                groups.offsets().data_as<int64_t>(),
                                                                n, db, scale, accumulate);
      MOE_CUDA_CHECK_LAUNCH("dbias_kernel");
    });
  });
}

void launch_dscales(const TensorView& dy, const ExpertAddress& bias, DType bias_dtype,
                    const GroupLayout& groups, const TensorView& dscales, bool accumulate,
                    Stream stream) {
  with_type(dy.dtype(), [&](auto in) {
    with_type(bias_dtype, [&](auto b) {
      using In = decltype(in);
      using B = decltype(b);
      dscales_kernel<In, B><<<264, 256, 0, stream>>>(
          dy.data_as<In>(), dy.stride(0), bias, groups.offsets().data_as<int64_t>(),
          groups.num_groups(), dy.size(1), dscales.data_as<float>(), accumulate);
      MOE_CUDA_CHECK_LAUNCH("dscales_kernel");
    });
  });
}

}  // namespace moe::cuda
