// The activations on CUDA (GLUs and non-gated ones): elementwise over the FC1 output, one block per
// row (grid-striding over the routed rows, whose count the kernels read from the device offsets),
// the same math as the CPU backend (common/glu_math.hpp). dprobs is reduced per row by one block in a fixed tree: the
// result does not depend on timing.
#include <algorithm>
#include <type_traits>

#include "common/glu_math.hpp"
#include "cuda/backend.hpp"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"
#include "cuda/ptx/pair16.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 256;
// Blocks per launch: a fixed number (not derived from the routing), enough to fill the GPU.
constexpr int64_t kMaxBlocks = 2048;

// Gate column j of an "s gate, s linear" block layout; its linear partner is s columns later.
__device__ __forceinline__ int32_t gate_column(int32_t j, int32_t s) { return (j / s) * 2 * s + j % s; }

// Where the kernels find feature j in a row of h, and what they compute from it: the activation of
// the feature (forward), or act and the gradient columns written into the row dhr of dh (backward).
// A GLU's feature is a gate/linear pair in blocks of s columns; a non-gated one is column j.
template <class T>
struct GluColumns {
  int32_t block;
  detail::GluMath<float> math;
  __device__ __forceinline__ float forward(const T* hr, int32_t j) const {
    const int32_t g = gate_column(j, block);
    return math.forward(to_float(hr[g]), to_float(hr[g + block]));
  }
  __device__ __forceinline__ float backward(const T* hr, int32_t j, float d_act, T* dhr) const {
    const int32_t g = gate_column(j, block);
    float act, d_gate, d_linear;
    math.backward(to_float(hr[g]), to_float(hr[g + block]), d_act, act, d_gate, d_linear);
    from_float(d_gate, dhr + g);
    from_float(d_linear, dhr + g + block);
    return act;
  }
};

template <class T, class Act>
struct ElementwiseColumns {
  Act fn;
  __device__ __forceinline__ float forward(const T* hr, int32_t j) const { return fn.forward(to_float(hr[j])); }
  __device__ __forceinline__ float backward(const T* hr, int32_t j, float d_act, T* dhr) const {
    float act, dh;
    fn.backward(to_float(hr[j]), d_act, act, dh);
    from_float(dh, dhr + j);
    return act;
  }
};

// The 16-bit backward's two features (j, j + 1), j even, as above: adjacent in d_out, out and,
// non-gated, in h; for a GLU with blocks of an even size adjacent among the gate and among the
// linear columns, and with pairs the four values g(j), l(j), g(j + 1), l(j + 1) are one 64-bit word.
// kSwiGLU: the GLU's constants at compile time (GluMath::swiglu), the same values as spec_math's.
template <class T, bool kPairs, bool kSwiGLU>
struct GluColumnsX2 {
  int32_t block;
  detail::GluMath<float> spec_math;
  __device__ __forceinline__ float2 backward(const T* hr, int32_t j, float2 d_act, T* dhr) const {
    using P = Pair16<T>;
    const auto math = detail::GluMath<float>::fixed<kSwiGLU>(spec_math);
    float2 gate, linear;
    int32_t g = 0;
    if constexpr (kPairs) {
      const uint2 v = *reinterpret_cast<const uint2*>(hr + 2 * j);
      gate = P::unpack(__byte_perm(v.x, v.y, 0x5410));
      linear = P::unpack(__byte_perm(v.x, v.y, 0x7632));
    } else {
      g = gate_column(j, block);
      gate = P::unpack(*reinterpret_cast<const uint32_t*>(hr + g));
      linear = P::unpack(*reinterpret_cast<const uint32_t*>(hr + g + block));
    }
    float act0, dg0, dl0, act1, dg1, dl1;
    math.backward(gate.x, linear.x, d_act.x, act0, dg0, dl0);
    math.backward(gate.y, linear.y, d_act.y, act1, dg1, dl1);
    if constexpr (kPairs) {
      *reinterpret_cast<uint2*>(dhr + 2 * j) = make_uint2(P::pack(dg0, dl0), P::pack(dg1, dl1));
    } else {
      *reinterpret_cast<uint32_t*>(dhr + g) = P::pack(dg0, dg1);
      *reinterpret_cast<uint32_t*>(dhr + g + block) = P::pack(dl0, dl1);
    }
    return make_float2(act0, act1);
  }
};

template <class T, class Act>
struct ElementwiseColumnsX2 {
  Act fn;
  __device__ __forceinline__ float2 backward(const T* hr, int32_t j, float2 d_act, T* dhr) const {
    using P = Pair16<T>;
    const float2 h = P::unpack(*reinterpret_cast<const uint32_t*>(hr + j));
    float act0, dh0, act1, dh1;
    fn.backward(h.x, d_act.x, act0, dh0);
    fn.backward(h.y, d_act.y, act1, dh1);
    *reinterpret_cast<uint32_t*>(dhr + j) = P::pack(dh0, dh1);
    return make_float2(act0, act1);
  }
};

template <class T, class Columns>
__global__ void glu_forward_kernel(const T* __restrict__ h, int64_t ldh, const float* __restrict__ probs,
                                   const int64_t* __restrict__ offsets, int64_t num_groups, int32_t ffn,
                                   Columns columns, T* __restrict__ out, int64_t ldo) {
  const int64_t rows = offsets[num_groups];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float p = probs ? probs[r] : 1.f;
    const T* hr = h + r * ldh;
    for (int32_t j = threadIdx.x; j < ffn; j += kThreads) from_float(columns.forward(hr, j) * p, out + r * ldo + j);
  }
}

// The block's sum of dp (one value per thread) into *dst, in a fixed tree: deterministic.
__device__ __forceinline__ void reduce_row(float dp, float (&warp_sums)[kThreads / 32], float* dst) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) dp += __shfl_xor_sync(0xffffffffu, dp, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = dp;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) sum += warp_sums[w];
    *dst = sum;
  }
  __syncthreads();  // warp_sums is reused by the next row
}

// The backward kernels may run in place (dh = h, out = d_out): every element is read and then
// written by the same thread, so those four pointers are not __restrict__.
template <class T, class Columns>
__global__ void glu_backward_kernel(const T* h, int64_t ldh, const float* __restrict__ probs,
                                    const T* d_out, int64_t ldd, const int64_t* __restrict__ offsets,
                                    int64_t num_groups, int32_t ffn, Columns columns,
                                    T* dh, int64_t lddh, float* __restrict__ dprobs,
                                    T* out, int64_t ldo) {
  __shared__ float warp_sums[kThreads / 32];
  const int64_t rows = offsets[num_groups];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float p = probs ? probs[r] : 1.f;
    const T* hr = h + r * ldh;
    float dp = 0.f;
    for (int32_t j = threadIdx.x; j < ffn; j += kThreads) {
      const float d = to_float(d_out[r * ldd + j]);
      const float act = columns.backward(hr, j, d * p, dh + r * lddh);
      dp += act * d;
      if (out) from_float(act * p, out + r * ldo + j);
    }
    if (dprobs) reduce_row(dp, warp_sums, dprobs + r);  // uniform: the whole block reduces
  }
}

// The 16-bit backward two features per thread (ColumnsX2). Same math and order per row as the
// scalar kernel except that dprobs adds the two features' terms in one step.
template <class T, class ColumnsX2>
__global__ void glu_backward_x2_kernel(const T* h, int64_t ldh, const float* __restrict__ probs,
                                       const T* d_out, int64_t ldd,
                                       const int64_t* __restrict__ offsets, int64_t num_groups, int32_t ffn,
                                       ColumnsX2 columns, T* dh,
                                       int64_t lddh, float* __restrict__ dprobs, T* out, int64_t ldo) {
  using P = Pair16<T>;
  __shared__ float warp_sums[kThreads / 32];
  const int64_t rows = offsets[num_groups];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float p = probs ? probs[r] : 1.f;
    const T* hr = h + r * ldh;
    float dp = 0.f;
    for (int32_t j = 2 * threadIdx.x; j < ffn; j += 2 * kThreads) {
      const float2 d = P::unpack(*reinterpret_cast<const uint32_t*>(d_out + r * ldd + j));
      const float2 act = columns.backward(hr, j, make_float2(d.x * p, d.y * p), dh + r * lddh);
      dp += act.x * d.x + act.y * d.y;
      if (out) *reinterpret_cast<uint32_t*>(out + r * ldo + j) = P::pack(act.x * p, act.y * p);
    }
    if (dprobs) reduce_row(dp, warp_sums, dprobs + r);  // uniform: the whole block reduces
  }
}

__global__ void glu_dprobs_reduce_kernel(const float* __restrict__ partial, int64_t stride, int32_t tiles,
                                         const int64_t* __restrict__ offsets, int64_t num_groups,
                                         float* __restrict__ dprobs) {
  const int64_t rows = offsets[num_groups];
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    float sum = 0.f;  // tiles in order: deterministic
    for (int32_t t = 0; t < tiles; ++t) sum += partial[r * stride + t];
    dprobs[r] = sum;
  }
}

unsigned grid_for(int64_t capacity) { return unsigned(capacity < kMaxBlocks ? capacity : kMaxBlocks); }

void check_ffn(int64_t ffn) {
  if (ffn >= (int64_t(1) << 30))
    throw_error(ErrorCode::kNotImplemented, "GLU on CUDA: F = ", ffn, " columns (at most 2^30)");
}

}  // namespace

void glu_dprobs_reduce(const float* partial, int64_t stride, int64_t tiles, const GroupLayout& groups,
                       const TensorView& dprobs, Stream stream) {
  const int64_t T = groups.capacity();
  if (T == 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((T + kThreads - 1) / kThreads, 1024));
  glu_dprobs_reduce_kernel<<<blocks, kThreads, 0, stream>>>(partial, stride, int32_t(tiles),
                                                           groups.offsets().data_as<int64_t>(),
                                                           groups.num_groups(), dprobs.data_as<float>());
  MOE_CUDA_CHECK_LAUNCH("glu_dprobs_reduce_kernel");
}

// fn(columns) with the spec's columns: GluColumns<T> / GluColumnsX2<T, pairs> for a GLU, the
// elementwise ones for the others. x2: the 16-bit two-features-per-thread kernel's columns.
template <class T, bool kX2, class Fn>
void with_columns(const GluSpec& spec, int64_t ffn, Fn&& fn) {
  if (spec.gated()) {
    const int32_t block = int32_t(ffn > 0 ? spec.layout.block_size(ffn) : 1);
    const auto math = detail::GluMath<float>::from(spec);
    if constexpr (!kX2) {
      return fn(GluColumns<T>{block, math});
    } else {
      return detail::with_swiglu_constants(spec, [&](auto swiglu) {
        if (block == 1) return fn(GluColumnsX2<T, true, decltype(swiglu)::value>{block, math});
        return fn(GluColumnsX2<T, false, decltype(swiglu)::value>{block, math});
      });
    }
  } else {
    detail::with_elementwise<float>(spec.activation, [&](auto f) {
      if constexpr (kX2) fn(ElementwiseColumnsX2<T, decltype(f)>{f});
      else fn(ElementwiseColumns<T, decltype(f)>{f});
    });
  }
}

void glu_forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
                 const TensorView& out, const GluSpec& spec, Stream stream) {
  const int64_t F = out.size(1), T = groups.capacity();
  check_ffn(F);
  if (T == 0 || F == 0) return;
  with_cuda_type(h.dtype(), "glu_forward", [&](auto type) {
    using T_ = decltype(type);
    with_columns<T_, false>(spec, F, [&](auto columns) {
      glu_forward_kernel<<<grid_for(T), kThreads, 0, stream>>>(
          h.data_as<T_>(), h.stride(0), probs.defined() ? probs.data_as<float>() : nullptr,
          groups.offsets().data_as<int64_t>(), groups.num_groups(), int32_t(F), columns, out.data_as<T_>(),
          out.stride(0));
      MOE_CUDA_CHECK_LAUNCH("glu_forward_kernel");
    });
  });
}

void glu_backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
                  const GroupLayout& groups, const GluBackwardOutputs& o, const GluSpec& spec,
                  Stream stream) {
  const int64_t F = d_out.size(1), T = groups.capacity();
  check_ffn(F);
  if (T == 0) return;
  // Two features per thread where the layout and alignment allow (16-bit data): h's and dh's
  // words hold two features non-gated, two gate and two linear values in blocks of an even size,
  // and g, l, g, l (8 bytes) with pairs.
  const int64_t block = spec.gated() && F > 0 ? spec.layout.block_size(F) : 2;
  const bool pairs = block == 1;
  const bool x2 = h.dtype() != DType::kFloat32 && F % 2 == 0 && (pairs || block % 2 == 0) &&
                  h.stride(0) % (pairs ? 4 : 2) == 0 && o.dh.stride(0) % (pairs ? 4 : 2) == 0 &&
                  d_out.stride(0) % 2 == 0 && (!o.out.defined() || o.out.stride(0) % 2 == 0) &&
                  is_aligned(h.data(), pairs ? 8 : 4) && is_aligned(o.dh.data(), pairs ? 8 : 4) &&
                  is_aligned(d_out.data(), 4) && (!o.out.defined() || is_aligned(o.out.data(), 4));
  with_cuda_type(h.dtype(), "glu_backward", [&](auto type) {
    using T_ = decltype(type);
    auto launch = [&](auto kernel, auto columns, const char* name) {
      kernel<<<grid_for(T), kThreads, 0, stream>>>(
          h.data_as<T_>(), h.stride(0), probs.defined() ? probs.data_as<float>() : nullptr,
          d_out.data_as<T_>(), d_out.stride(0), groups.offsets().data_as<int64_t>(), groups.num_groups(),
          int32_t(F), columns, o.dh.data_as<T_>(), o.dh.stride(0),
          o.dprobs.defined() ? o.dprobs.data_as<float>() : nullptr,
          o.out.defined() ? o.out.data_as<T_>() : nullptr, o.out.defined() ? o.out.stride(0) : 0);
      MOE_CUDA_CHECK_LAUNCH(name);
    };
    if constexpr (!std::is_same_v<T_, float>) {
      if (x2)
        return with_columns<T_, true>(spec, F, [&](auto columns) {
          launch(glu_backward_x2_kernel<T_, decltype(columns)>, columns, "glu_backward_x2_kernel");
        });
    }
    with_columns<T_, false>(spec, F, [&](auto columns) {
      launch(glu_backward_kernel<T_, decltype(columns)>, columns, "glu_backward_kernel");
    });
  });
}

}  // namespace moe::cuda
