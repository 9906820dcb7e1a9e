// The router's three float32 products (docs/design.md section 13) in one tiled SIMT kernel:
// C[m, n] = sum_k A(m, k) B(n, k), each output summed by one thread over k in increasing order,
// one fused multiply-add per step. 16-bit x and weight have products exact in float32, so the fused
// steps round as the CPU backend's separate product and sum: the logits are its bits. Products
// with a float32 operand (float32 inputs; d_logits in the backward) round differently, within
// float32's error. No tensor cores yet: E is small (8..512), and this is the simple path.
#include "cuda/backend.hpp"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"

namespace moe::cuda {
namespace {

constexpr int kTileM = 64, kTileN = 64, kTileK = 16;
constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each
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

// Rows [r0, r0 + kRows) x columns [k0, k0 + kTileK) of an operand into tile[k][r] (zeros outside
// R x K: padded steps add exactly nothing). Consecutive threads read the operand's contiguous
// dimension; the extra column keeps the transposing stores free of bank conflicts.
template <int kRows, class T>
__device__ __forceinline__ void load_tile(const Operand<T>& op, int64_t r0, int64_t rows,
                                          int64_t k0, int64_t depth,
                                          float (&tile)[kTileK][kRows + 1]) {
  for (int i = threadIdx.x; i < kTileK * kRows; i += kThreads) {
    const bool k_contiguous = op.k_stride == 1;
    const int r = k_contiguous ? i / kTileK : i % kRows;
    const int k = k_contiguous ? i % kTileK : i / kRows;
    const int64_t gr = r0 + r, gk = k0 + k;
    tile[k][r] =
        gr < rows && gk < depth ? to_float(op.data[gr * op.m_stride + gk * op.k_stride]) : 0.f;
  }
}

template <class TA, class TB, class TC>
__global__ void __launch_bounds__(kThreads)
    router_linear_kernel(Operand<TA> a, Operand<TB> b, Output<TC> c, int64_t M, int64_t N,
                         int64_t K) {
  __shared__ float a_tile[kTileK][kTileM + 1];
  __shared__ float b_tile[kTileK][kTileN + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t m0 = int64_t(blockIdx.y) * kTileM, n0 = int64_t(blockIdx.x) * kTileN;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    load_tile<kTileM>(a, m0, M, k0, K, a_tile);
    load_tile<kTileN>(b, n0, N, k0, K, b_tile);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kTileK; ++k) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        av[i] = a_tile[k][ty * 4 + i];
        bv[i] = b_tile[k][tx * 4 + i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
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

template <class TA, class TB, class TC>
void launch(const char* what, Operand<TA> a, Operand<TB> b, Output<TC> c, int64_t M, int64_t N,
            int64_t K, Stream stream) {
  if (M == 0 || N == 0) return;
  const int64_t blocks_m = (M + kTileM - 1) / kTileM;
  if (blocks_m > kMaxGridY)
    throw_error(ErrorCode::kNotImplemented, what, " on CUDA: ", M, " rows (at most ",
                kMaxGridY * kTileM, ")");
  const dim3 grid(unsigned((N + kTileN - 1) / kTileN), unsigned(blocks_m));
  router_linear_kernel<<<grid, kThreads, 0, stream>>>(a, b, c, M, N, K);
  MOE_CUDA_CHECK_LAUNCH(what);
}

}  // namespace

void router_logits(const TensorView& x, const TensorView& weight, const TensorView& logits,
                   Stream stream) {
  with_cuda_type(x.dtype(), "router_forward", [&](auto type) {
    using T = decltype(type);
    launch("router logits", Operand<T>{x.data_as<T>(), x.stride(0), 1},
           Operand<T>{weight.data_as<T>(), weight.stride(0), 1},
           Output<float>{logits.data_as<float>(), logits.stride(0), false}, x.size(0),
           weight.size(0), x.size(1), stream);
  });
}

void router_dgrad(const TensorView& d_logits, const TensorView& weight, const TensorView& dx,
                  bool accumulate, Stream stream) {
  // dx(t, h) = sum_e d_logits(t, e) W(e, h): B(n = h, k = e) is the weight transposed.
  with_cuda_type(weight.dtype(), "router_backward", [&](auto type) {
    using T = decltype(type);
    launch("router dgrad", Operand<float>{d_logits.data_as<float>(), d_logits.stride(0), 1},
           Operand<T>{weight.data_as<T>(), 1, weight.stride(0)},
           Output<T>{dx.data_as<T>(), dx.stride(0), accumulate}, dx.size(0), dx.size(1),
           d_logits.size(1), stream);
  });
}

void router_wgrad(const TensorView& d_logits, const TensorView& x, const TensorView& dweight,
                  GradMode mode, Stream stream) {
  // dweight(e, h) = sum_t d_logits(t, e) x(t, h): both operands transposed (contiguous along m, n).
  with_cuda_type(x.dtype(), "router_backward", [&](auto in) {
    with_cuda_type(dweight.dtype(), "router_backward", [&](auto out) {
      using TB = decltype(in);
      using TC = decltype(out);
      launch("router wgrad", Operand<float>{d_logits.data_as<float>(), 1, d_logits.stride(0)},
             Operand<TB>{x.data_as<TB>(), 1, x.stride(0)},
             Output<TC>{dweight.data_as<TC>(), dweight.stride(0), mode == GradMode::kAccumulate},
             dweight.size(0), dweight.size(1), x.size(0), stream);
    });
  });
}

}  // namespace moe::cuda
