// The router's three float32 products (docs/design.md section 13), and where each runs.
// - On Hopper, 16-bit x and weight whose rows TMA can read: the logits on the grouped GEMM (one
//   group, float32 output: exact products summed in the tensor cores' order; H200: 5-18x the SIMT
//   kernels at E = 8..256). For bfloat16 also dx and the weight gradient, over d_logits split into
//   three bfloat16 parts whose sum is d_logits exactly (the backward kernel writes them): dx as the
//   dgrad of one group over the weight stacked three times, the weight gradient as the wgrad of
//   token-slice groups into float32 partial sums, then added in order (dispatch/router_gemm.cpp).
// - Otherwise SIMT: 16-bit operands of the common shapes take router_linear_16bit.cu's kernels;
//   the rest this file's tiled kernel, C[m, n] = sum_k A(m, k) B(n, k). The logits and dx: each
//   output summed by one thread over k in increasing order, one fused multiply-add per step
//   (16-bit x and weight have products exact in float32, so the logits are the CPU backend's bits).
//   The weight gradient (K = T, few outputs) sums two interleaved k ranges and adds them in a fixed
//   order. Products with a float32 operand (float32 inputs; d_logits in the backward) round
//   differently from the CPU, within float32's error.
#include <algorithm>

#include "cuda/backend.hpp"
#include "cuda/kernels/router_linear_16bit.cuh"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"

namespace moe::cuda {
namespace {

constexpr int kTileM = 64, kTileN = 64, kTileK = 16;
constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each
constexpr int kPad = 4;        // floats after each shared tile row
constexpr int64_t kMaxGridY = 65535;

// A(m, k) = data[m * m_stride + k * k_stride]: rows of x or the weight, or a transposed operand.
template <class T>
struct Operand {
  const T* data;
  int64_t m_stride, k_stride;
};

template <class T>
struct Output {
  T* data;
  int64_t ld;
  bool accumulate;  // add into the output (a float32 main_grad, or dx) instead of writing
};

// The elements of an operand tile a thread stages: rows [r0, r0 + kRows) x columns [k0, k0 +
// kTileK), zeros outside R x K (padded steps add exactly nothing). Consecutive threads read the
// operand's contiguous dimension.
template <int kRows>
struct TileMap {
  static constexpr int kPerThread = kTileK * kRows / kThreads;
  static_assert(kPerThread * kThreads == kTileK * kRows, "a tile must split evenly over the threads");
  __device__ __forceinline__ static void at(int i, bool k_contiguous, int& r, int& k) {
    r = k_contiguous ? i / kTileK : i % kRows;
    k = k_contiguous ? i % kTileK : i / kRows;
  }
};

// Global -> registers: issued a tile ahead of its use, so the loads are in flight while the
// previous tile is multiplied.
template <int kRows, class T>
__device__ __forceinline__ void fetch(const Operand<T>& op, int64_t r0, int64_t rows, int64_t k0,
                                      int64_t depth, int tid,
                                      float (&reg)[TileMap<kRows>::kPerThread]) {
  const bool k_contiguous = op.k_stride == 1;
#pragma unroll
  for (int n = 0; n < TileMap<kRows>::kPerThread; ++n) {
    int r, k;
    TileMap<kRows>::at(tid + n * kThreads, k_contiguous, r, k);
    const int64_t gr = r0 + r, gk = k0 + k;
    reg[n] = gr < rows && gk < depth ? to_float(op.data[gr * op.m_stride + gk * op.k_stride]) : 0.f;
  }
}

// Registers -> tile[k][r]. Rows padded by kPad floats: 16-byte aligned for the float4 reads of the
// multiply, and the transposing stores conflict at most two ways.
template <int kRows>
__device__ __forceinline__ void stash(const float (&reg)[TileMap<kRows>::kPerThread],
                                      bool k_contiguous, int tid,
                                      float (&tile)[kTileK][kRows + kPad]) {
#pragma unroll
  for (int n = 0; n < TileMap<kRows>::kPerThread; ++n) {
    int r, k;
    TileMap<kRows>::at(tid + n * kThreads, k_contiguous, r, k);
    tile[k][r] = reg[n];
  }
}

// kSplit groups of kThreads threads share a block's 64 x 64 outputs: group g sums the k-tiles g,
// g + kSplit, ... (each in increasing k, one FMA per step), then the groups' sums are added in
// group order. kSplit = 1 is the plain order the logits need to be the CPU's bits; a long
// contraction over few outputs (the weight gradient: K = T, E x H outputs) takes kSplit = 2 to
// fill the GPU (4 would need more than 64 registers a thread). Either way the order is fixed: deterministic.
template <class TA, class TB, class TC, int kSplit>
__global__ void __launch_bounds__(kThreads* kSplit)
    router_linear_kernel(Operand<TA> a, Operand<TB> b, Output<TC> c, int64_t M, int64_t N,
                         int64_t K, int64_t k_slice, int64_t c_slice_stride) {
  __shared__ __align__(16) float a_tile[kSplit][kTileK][kTileM + kPad];
  __shared__ __align__(16) float b_tile[kSplit][kTileK][kTileN + kPad];
  const int group = int(threadIdx.x) / kThreads, tid = int(threadIdx.x) % kThreads;
  const int tx = tid % 16, ty = tid / 16;
  const int64_t m0 = int64_t(blockIdx.y) * kTileM, n0 = int64_t(blockIdx.x) * kTileN;
  const bool a_k_contiguous = a.k_stride == 1, b_k_contiguous = b.k_stride == 1;
  float acc[4][4] = {};
  float ra[TileMap<kTileM>::kPerThread], rb[TileMap<kTileN>::kPerThread];
  // Slice blockIdx.z of the contraction, [k_begin, k_end), into its own output (c_slice_stride
  // apart): the weight gradient's partial sums, which router_wgrad adds in slice order.
  const int64_t k_begin = int64_t(blockIdx.z) * k_slice;
  const int64_t k_end = k_begin + k_slice < K ? k_begin + k_slice : K;
  c.data += int64_t(blockIdx.z) * c_slice_stride;
  const int64_t step = int64_t(kTileK) * kSplit;
  const int64_t iterations = (k_end - k_begin + step - 1) / step;  // the same for every group
  int64_t k0 = k_begin + int64_t(group) * kTileK;
  K = k_end;  // the operands' columns past the slice read as zeros
  fetch<kTileM>(a, m0, M, k0, K, tid, ra);
  fetch<kTileN>(b, n0, N, k0, K, tid, rb);
  for (int64_t it = 0; it < iterations; ++it, k0 += step) {
    stash<kTileM>(ra, a_k_contiguous, tid, a_tile[group]);
    stash<kTileN>(rb, b_k_contiguous, tid, b_tile[group]);
    __syncthreads();
    if (it + 1 < iterations) {
      fetch<kTileM>(a, m0, M, k0 + step, K, tid, ra);
      fetch<kTileN>(b, n0, N, k0 + step, K, tid, rb);
    }
#pragma unroll
    for (int k = 0; k < kTileK; ++k) {
      const float4 a4 = *reinterpret_cast<const float4*>(&a_tile[group][k][ty * 4]);
      const float4 b4 = *reinterpret_cast<const float4*>(&b_tile[group][k][tx * 4]);
      const float av[4] = {a4.x, a4.y, a4.z, a4.w}, bv[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
  if constexpr (kSplit > 1) {
    // The groups' sums meet in group 0, group by group.
    __shared__ float partial[16 * kThreads];
    for (int g = 1; g < kSplit; ++g) {
      if (group == g)
#pragma unroll
        for (int i = 0; i < 16; ++i) partial[i * kThreads + tid] = acc[i / 4][i % 4];
      __syncthreads();
      if (group == 0)
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[i / 4][i % 4] += partial[i * kThreads + tid];
      __syncthreads();
    }
    if (group != 0) return;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t m = m0 + ty * 4 + i, n = n0 + tx * 4 + j;
      if (m >= M || n >= N) continue;
      TC* out = c.data + m * c.ld + n;
      from_float(c.accumulate ? to_float(*out) + acc[i][j] : acc[i][j], out);
    }
}

template <int kSplit = 1, class TA, class TB, class TC>
void launch(const char* what, Operand<TA> a, Operand<TB> b, Output<TC> c, int64_t M, int64_t N,
            int64_t K, Stream stream, int64_t slices = 1, int64_t c_slice_stride = 0) {
  if (M == 0 || N == 0) return;
  const int64_t blocks_m = (M + kTileM - 1) / kTileM;
  if (blocks_m > kMaxGridY)
    throw_error(ErrorCode::kNotImplemented, what, " on CUDA: ", M, " rows (at most ",
                kMaxGridY * kTileM, ")");
  const dim3 grid(unsigned((N + kTileN - 1) / kTileN), unsigned(blocks_m), unsigned(slices));
  // Slices of whole k-tiles, so a slice boundary never splits a tile.
  const int64_t tiles = (K + kTileK - 1) / kTileK;
  const int64_t k_slice = (tiles + slices - 1) / slices * kTileK;
  router_linear_kernel<TA, TB, TC, kSplit>
      <<<grid, kThreads * kSplit, 0, stream>>>(a, b, c, M, N, K, k_slice, c_slice_stride);
  MOE_CUDA_CHECK_LAUNCH(what);
}


// offsets[0..1] = {0, rows}: one group of all rows (the logits, dx); then, for the weight
// gradient's `slices` token slices, offsets[2 + i] = min(i * slice_rows, rows), i = 0..slices.
__global__ void gemm_offsets_kernel(int64_t* offsets, int64_t rows, int slices, int64_t slice_rows) {
  const int i = int(threadIdx.x);
  if (i < 2) offsets[i] = i == 0 ? 0 : rows;
  else if (i - 2 <= slices) offsets[i] = min(int64_t(i - 2) * slice_rows, rows);
}

// out [3E, H] = [W; W; W], 16 bytes a thread (rows of W 16-byte aligned, H a multiple of 8).
__global__ void stack_weight_kernel(const uint4* __restrict__ w, int64_t w_ld16, uint4* __restrict__ out,
                                    int64_t experts, int64_t row16) {
  const int64_t n = 3 * experts * row16;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / row16, c = i - r * row16;
    out[i] = w[(r % experts) * w_ld16 + c];
  }
}

void router_dgrad(const TensorView& d_logits, const TensorView& weight, const TensorView& dx,
                  bool accumulate, Stream stream) {
  // dx(t, h) = sum_e d_logits(t, e) W(e, h): B(n = h, k = e) is the weight transposed.
  if (router_dgrad_16bit(d_logits, weight, dx, accumulate, stream)) return;
  with_cuda_type(weight.dtype(), "router_backward", [&](auto type) {
    using T = decltype(type);
    launch("router dgrad", Operand<float>{d_logits.data_as<float>(), d_logits.stride(0), 1},
           Operand<T>{weight.data_as<T>(), 1, weight.stride(0)},
           Output<T>{dx.data_as<T>(), dx.stride(0), accumulate}, dx.size(0), dx.size(1),
           d_logits.size(1), stream);
  });
}

// dweight (per mode) = the sum of the slices' partial sums, in slice order.
template <class TC>
__global__ void add_slices_kernel(const float* __restrict__ partials, int64_t slices, int64_t rows,
                                  int64_t cols, TC* __restrict__ out, int64_t ld, bool accumulate) {
  const int64_t n = rows * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float sum = partials[i];
    for (int64_t s = 1; s < slices; ++s) sum += partials[s * n + i];
    TC* dst = out + (i / cols) * ld + i % cols;
    from_float(accumulate ? to_float(*dst) + sum : sum, dst);
  }
}

// partials: `slices` contiguous [E, H] float32 blocks.
void add_slices(const float* partials, int64_t slices, const TensorView& dweight, bool accumulate, Stream stream) {
  const int64_t E = dweight.size(0), H = dweight.size(1), n = E * H;
  const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 4096));
  with_cuda_type(dweight.dtype(), "router_backward", [&](auto out) {
    using TC = decltype(out);
    add_slices_kernel<TC><<<blocks, 256, 0, stream>>>(partials, slices, E, H, dweight.data_as<TC>(),
                                                      dweight.stride(0), accumulate);
    MOE_CUDA_CHECK_LAUNCH("router wgrad: add_slices_kernel");
  });
}

void router_wgrad(const TensorView& d_logits, const TensorView& x, const TensorView& dweight,
                  GradMode mode, const TensorView& partials, Stream stream) {
  // dweight(e, h) = sum_t d_logits(t, e) x(t, h): both operands transposed (contiguous along m, n).
  // With partials [S, E, H]: S slices of the tokens, each into its own partial sums (enough
  // blocks for the few E x H tiles), then added in slice order.
  const int64_t E = dweight.size(0), H = dweight.size(1), T = x.size(0);
  const bool sliced = partials.defined();
  const int64_t slices = sliced ? partials.size(0) : 1;
  const bool accumulate = mode == GradMode::kAccumulate;
  if (router_wgrad_16bit(d_logits, x, partials, dweight, accumulate, stream)) {
    if (sliced) add_slices(partials.data_as<float>(), slices, dweight, accumulate, stream);
    return;
  }
  with_cuda_type(x.dtype(), "router_backward", [&](auto in) {
    with_cuda_type(dweight.dtype(), "router_backward", [&](auto out) {
      using TB = decltype(in);
      using TC = decltype(out);
      const Operand<float> a{d_logits.data_as<float>(), 1, d_logits.stride(0)};
      const Operand<TB> b{x.data_as<TB>(), 1, x.stride(0)};
      if (!sliced) {
        launch<2>("router wgrad", a, b, Output<TC>{dweight.data_as<TC>(), dweight.stride(0), accumulate}, E, H, T,
                  stream);
        return;
      }
      launch<2>("router wgrad", a, b, Output<float>{partials.data_as<float>(), H, false}, E, H, T, stream, slices,
                E * H);
    });
  });
  if (sliced) add_slices(partials.data_as<float>(), slices, dweight, accumulate, stream);
}

}  // namespace

void router_logits(const TensorView& x, const TensorView& weight, const TensorView& logits,
                   const TensorView& gemm_offsets, Stream stream) {
  if (x.size(0) > 0 && gemm_offsets.defined() && router_logits_gemm_can_run(x, weight, logits)) {
    gemm_offsets_kernel<<<1, 2, 0, stream>>>(gemm_offsets.data_as<int64_t>(), x.size(0), 0, 0);
    MOE_CUDA_CHECK_LAUNCH("router logits: gemm_offsets_kernel");
    return router_logits_gemm(x, weight, logits, gemm_offsets.data_as<int64_t>(), stream);
  }
  if (router_logits_16bit(x, weight, logits, stream)) return;
  with_cuda_type(x.dtype(), "router_forward", [&](auto type) {
    using T = decltype(type);
    launch("router logits", Operand<T>{x.data_as<T>(), x.stride(0), 1},
           Operand<T>{weight.data_as<T>(), weight.stride(0), 1},
           Output<float>{logits.data_as<float>(), logits.stride(0), false}, x.size(0),
           weight.size(0), x.size(1), stream);
  });
}

RouterBackwardPlan router_backward_plan(const TensorView& x, const TensorView& weight, const RouterGrads& grads,
                                        const detail::RouterBackwardScratch& scratch) {
  RouterBackwardPlan plan;
  if (!scratch.d_split.defined() || x.size(0) == 0 || x.dtype() != DType::kBFloat16) return plan;
  // The stacking kernel's 16-byte copies.
  const bool stackable = weight.stride(1) == 1 && weight.stride(0) % 8 == 0 && is_aligned(weight.data(), 16);
  plan.dx_on_gemm = grads.dx.defined() && stackable &&
                    router_dgrad_gemm_can_run(scratch.d_split, scratch.weight_stack, grads.dx, grads.accumulate_dx);
  plan.dweight_on_gemm = grads.dweight.defined() && router_wgrad_gemm_can_run(scratch.d_split, x, scratch.gemm_partials);
  return plan;
}

void router_backward_products(const RouterBackwardPlan& plan, const TensorView& x, const TensorView& weight,
                              const RouterGrads& grads, const detail::RouterBackwardScratch& scratch,
                              Stream stream) {
  const int64_t T = x.size(0), E = weight.size(0), H = x.size(1);
  if (plan.splits()) {
    const int64_t slices = scratch.gemm_partials.size(0);
    const int64_t slice_rows = ((T + slices - 1) / slices + 63) / 64 * 64;
    gemm_offsets_kernel<<<1, unsigned(slices + 3), 0, stream>>>(scratch.gemm_offsets.data_as<int64_t>(), T,
                                                                int(slices), slice_rows);
    MOE_CUDA_CHECK_LAUNCH("router backward: gemm_offsets_kernel");
  }
  const int64_t* one_group = plan.splits() ? scratch.gemm_offsets.data_as<int64_t>() : nullptr;
  if (plan.dx_on_gemm) {
    const int64_t n16 = 3 * E * (H / 8);
    const unsigned blocks = unsigned(std::min<int64_t>((n16 + 255) / 256, 2048));
    stack_weight_kernel<<<blocks, 256, 0, stream>>>(static_cast<const uint4*>(weight.data()), weight.stride(0) / 8,
                                                    static_cast<uint4*>(scratch.weight_stack.data()), E, H / 8);
    MOE_CUDA_CHECK_LAUNCH("router dgrad: stack_weight_kernel");
    router_dgrad_gemm(scratch.d_split, scratch.weight_stack, grads.dx, grads.accumulate_dx, one_group, stream);
  } else if (grads.dx.defined()) {
    router_dgrad(scratch.d_logits, weight, grads.dx, grads.accumulate_dx, stream);
  }
  if (!grads.dweight.defined()) return;
  // No tokens: dweight is zeros, a main_grad is left untouched.
  if (T == 0 && grads.dweight_mode == GradMode::kAccumulate) return;
  if (plan.dweight_on_gemm) {
    router_wgrad_gemm(scratch.d_split, x, scratch.gemm_partials, one_group + 2, stream);
    // The slices' [hi; mid; lo] blocks are 3 S' blocks of [E, H], added in order.
    add_slices(scratch.gemm_partials.data_as<float>(), 3 * scratch.gemm_partials.size(0), grads.dweight,
               grads.dweight_mode == GradMode::kAccumulate, stream);
    return;
  }
  router_wgrad(scratch.d_logits, x, grads.dweight, grads.dweight_mode, scratch.wgrad_partials, stream);
}

}  // namespace moe::cuda
