// GLU activations on CUDA: elementwise over the FC1 output, one block per row (grid-striding over
// the routed rows, whose count the kernels read from the device offsets), the same math as the CPU
// backend (common/glu_math.hpp). dprobs is reduced per row by one block in a fixed tree: the
// result does not depend on timing.
#include "common/glu_math.hpp"
#include "cuda/backend.hpp"
#include "cuda/check.hpp"
#include "cuda/dtype_dispatch.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
// Blocks per launch: a fixed number (not derived from the routing), enough to fill the GPU.
constexpr int64_t kMaxBlocks = 2048;

// Gate column j of an "s gate, s linear" block layout; its linear partner is s columns later.
__device__ __forceinline__ int32_t gate_column(int32_t j, int32_t s) { return (j / s) * 2 * s + j % s; }

template <class T>
__global__ void glu_forward_kernel(const T* __restrict__ h, int64_t ldh, const float* __restrict__ probs,
                                   const int64_t* __restrict__ offsets, int64_t num_groups, int32_t ffn,
                                   int32_t block, detail::GluMath<float> math, T* __restrict__ out,
                                   int64_t ldo) {
  const int64_t rows = offsets[num_groups];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float p = probs ? probs[r] : 1.f;
    const T* hr = h + r * ldh;
    for (int32_t j = threadIdx.x; j < ffn; j += kThreads) {
      const int32_t g = gate_column(j, block);
      from_float(math.forward(to_float(hr[g]), to_float(hr[g + block])) * p, out + r * ldo + j);
    }
  }
}

template <class T>
__global__ void glu_backward_kernel(const T* __restrict__ h, int64_t ldh, const float* __restrict__ probs,
                                    const T* __restrict__ d_out, int64_t ldd, const int64_t* __restrict__ offsets,
                                    int64_t num_groups, int32_t ffn, int32_t block, detail::GluMath<float> math,
                                    T* __restrict__ dh, int64_t lddh, float* __restrict__ dprobs,
                                    T* __restrict__ out, int64_t ldo) {
  __shared__ float warp_sums[kThreads / 32];
  const int64_t rows = offsets[num_groups];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float p = probs ? probs[r] : 1.f;
    const T* hr = h + r * ldh;
    float dp = 0.f;
    for (int32_t j = threadIdx.x; j < ffn; j += kThreads) {
      const int32_t g = gate_column(j, block);
      const float d = to_float(d_out[r * ldd + j]);
      float act, d_gate, d_linear;
      math.backward(to_float(hr[g]), to_float(hr[g + block]), d * p, act, d_gate, d_linear);
      from_float(d_gate, dh + r * lddh + g);
      from_float(d_linear, dh + r * lddh + g + block);
      dp += act * d;
      if (out) from_float(act * p, out + r * ldo + j);
    }
    if (dprobs) {  // uniform: the whole block reduces
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) dp += __shfl_xor_sync(0xffffffffu, dp, offset);
      if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = dp;
      __syncthreads();
      if (threadIdx.x == 0) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) sum += warp_sums[w];
        dprobs[r] = sum;
      }
      __syncthreads();  // warp_sums is reused by the next row
    }
  }
}

unsigned grid_for(int64_t capacity) { return unsigned(capacity < kMaxBlocks ? capacity : kMaxBlocks); }

void check_ffn(int64_t ffn) {
  if (ffn >= (int64_t(1) << 30))
    throw_error(ErrorCode::kNotImplemented, "GLU on CUDA: F = ", ffn, " columns (at most 2^30)");
}

}  // namespace

void glu_forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
                 const TensorView& out, const GluSpec& spec, Stream stream) {
  const int64_t F = out.size(1), T = groups.capacity();
  check_ffn(F);
  if (T == 0 || F == 0) return;
  const auto math = detail::GluMath<float>::from(spec);
  with_cuda_type(h.dtype(), "glu_forward", [&](auto type) {
    using T_ = decltype(type);
    glu_forward_kernel<T_><<<grid_for(T), kThreads, 0, stream>>>(
        h.data_as<T_>(), h.stride(0), probs.defined() ? probs.data_as<float>() : nullptr,
        groups.offsets().data_as<int64_t>(), groups.num_groups(), int32_t(F),
        int32_t(spec.layout.block_size(F)), math, out.data_as<T_>(), out.stride(0));
    MOE_CUDA_CHECK_LAUNCH("glu_forward_kernel");
  });
}

void glu_backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
                  const GroupLayout& groups, const GluBackwardOutputs& o, const GluSpec& spec,
                  Stream stream) {
  const int64_t F = d_out.size(1), T = groups.capacity();
  check_ffn(F);
  if (T == 0) return;
  const auto math = detail::GluMath<float>::from(spec);
  with_cuda_type(h.dtype(), "glu_backward", [&](auto type) {
    using T_ = decltype(type);
    glu_backward_kernel<T_><<<grid_for(T), kThreads, 0, stream>>>(
        h.data_as<T_>(), h.stride(0), probs.defined() ? probs.data_as<float>() : nullptr,
        d_out.data_as<T_>(), d_out.stride(0), groups.offsets().data_as<int64_t>(), groups.num_groups(),
        int32_t(F), int32_t(F > 0 ? spec.layout.block_size(F) : 1), math, o.dh.data_as<T_>(), o.dh.stride(0),
        o.dprobs.defined() ? o.dprobs.data_as<float>() : nullptr,
        o.out.defined() ? o.out.data_as<T_>() : nullptr, o.out.defined() ? o.out.stride(0) : 0);
    MOE_CUDA_CHECK_LAUNCH("glu_backward_kernel");
  });
}

}  // namespace moe::cuda
