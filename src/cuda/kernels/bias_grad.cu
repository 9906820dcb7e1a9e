// Bias kernels. The gradients are deterministic: each output element is reduced by one thread
// (dbias) or one warp with a fixed shuffle tree (dscales), in a fixed order.
#include "cuda/kernels/bias_grad.hpp"

#include <algorithm>

#include "cuda/kernels/group_search.cuh"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"

namespace moe::cuda {
namespace {

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
    sum += (scale ? scale[r] : 1.f) * to_float(dy[r * ld + col]);
  const ExpertAddress address =
      db;  // a local copy: calling a member on a kernel parameter spills it
  Out* out = address.at<Out>(g) + col;
  from_float(accumulate ? to_float(*out) + sum : sum, out);
}

// One warp per row r < offsets[G] (its expert: group_at).
template <class In, class B>
__global__ void dscales_kernel(const In* __restrict__ dy, int64_t ld, ExpertAddress bias,
                               const int64_t* __restrict__ offsets, int64_t num_groups, int64_t n,
                               float* __restrict__ out, bool accumulate) {
  const int64_t rows = offsets[num_groups];
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const unsigned lane = threadIdx.x % 32;
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows;
       r += warps) {
    float sum = 0.f;
    const ExpertAddress address = bias;
    const B* b = address.at<const B>(group_at(offsets, num_groups, r));
    for (int64_t c = lane; c < n; c += 32) sum += to_float(dy[r * ld + c]) * to_float(b[c]);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) out[r] = accumulate ? out[r] + sum : sum;
  }
}

// One warp per row r < offsets[G] (its expert: group_at): y[r] += s[r] b_g.
template <class B>
__global__ void add_bias_kernel(float* __restrict__ y, int64_t ld, ExpertAddress bias,
                                const int64_t* __restrict__ offsets, int64_t num_groups, int64_t n,
                                const float* __restrict__ scale) {
  const int64_t rows = offsets[num_groups];
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const unsigned lane = threadIdx.x % 32;
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int64_t g = group_at(offsets, num_groups, r);
    const float s = scale ? scale[r] : 1.f;
    const ExpertAddress address = bias;
    const B* b = address.at<const B>(g);
    float* row = y + r * ld;
    for (int64_t c = lane; c < n; c += 32) row[c] = __fmaf_rn(s, to_float(b[c]), row[c]);
  }
}

}  // namespace

void launch_add_bias(const TensorView& y, const ExpertAddress& bias, DType bias_dtype, const GroupLayout& groups,
                     const TensorView& row_scale, Stream stream) {
  MOE_CHECK(y.dtype() == DType::kFloat32, ErrorCode::kInternal, "add_bias: y must be float32, got ",
            dtype_name(y.dtype()));
  if (y.size(0) == 0 || y.size(1) == 0) return;
  const float* scale = row_scale.defined() ? row_scale.data_as<float>() : nullptr;
  // Grid from the capacity (static), never the routing: 8 rows a block, at most 1056 blocks.
  const unsigned blocks = unsigned(std::min<int64_t>((y.size(0) + 7) / 8, 1056));
  with_cuda_type(bias_dtype, "add_bias", [&](auto b) {
    using B = decltype(b);
    add_bias_kernel<B><<<blocks, 256, 0, stream>>>(y.data_as<float>(), y.stride(0), bias,
                                                   groups.offsets().data_as<int64_t>(), groups.num_groups(),
                                                   y.size(1), scale);
    MOE_CUDA_CHECK_LAUNCH("add_bias_kernel");
  });
}

void launch_dbias(const TensorView& dy, const GroupLayout& groups, const ExpertAddress& db,
                  DType db_dtype, bool accumulate, const TensorView& row_scale, Stream stream) {
  const int64_t n = dy.size(1), G = groups.num_groups();
  const dim3 grid(unsigned((n + kDbiasThreads - 1) / kDbiasThreads), unsigned(G));
  const float* scale = row_scale.defined() ? row_scale.data_as<float>() : nullptr;
  with_cuda_type(dy.dtype(), "bias gradients", [&](auto in) {
    with_cuda_type(db_dtype, "bias gradients", [&](auto out) {
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
  with_cuda_type(dy.dtype(), "bias gradients", [&](auto in) {
    with_cuda_type(bias_dtype, "bias gradients", [&](auto b) {
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
