// The router's three float32 products (docs/design.md section 13) in one tensor-core kernel:
// C[m, n] = sum_k A(m, k) B(n, k) for the logits (x W^T), dx (d_logits W) and the weight gradient
// (d_logits^T x). TF32 MMAs with float32 accumulation: a 16-bit operand is exact in TF32; a float32
// one (d_logits, float32 inputs) is split into a TF32 head and a TF32 tail, and the products of
// both are accumulated, so every product carries about float32's precision (the tail of a product
// of two tails, below 2^-22 relative, is dropped). The accumulation order is the tensor cores': the
// results are float32 sums within float32 rounding of the CPU's, not its bits (the routing math
// after the logits is bit-identical given the logits). Fixed tiles, fixed order per output:
// deterministic.
#include <mma.h>

#include <type_traits>

#include "cuda/backend.hpp"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"

namespace moe::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTileM = 64, kTileN = 64, kTileK = 16;
constexpr int kWarps = 4;  // 2 x 2 warps of 32 x 32 outputs (2 x 2 fragments of 16 x 16)
constexpr int kThreads = 32 * kWarps;
constexpr int kLd = kTileK + 4;  // padded smem rows: fewer bank conflicts
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

// The operand elements a thread stages per tile: rows [r0, r0 + 64) x columns [k0, k0 + 16),
// zeros outside R x K (padded steps add exactly nothing); consecutive threads read the operand's
// contiguous dimension. Element n of thread t is (r, k) = (t / 16 + 8 n, t % 16) when k is
// contiguous, else (t % 64, t / 64 + 2 n): one coordinate fixed, the other in even steps, so a
// thread walks one pointer with one stride.
constexpr int kPerThread = kTileM * kTileK / kThreads;
static_assert(kTileM == kTileN, "A and B tiles are staged alike");
static_assert(kThreads % kTileK == 0 && kThreads % kTileM == 0, "the walk assumes whole rows");

template <class T>
struct Stager {
  const T* data;
  int64_t m_stride, k_stride;
  int r, k, r_step, k_step;  // the thread's first element and the step between its elements
  bool k_contiguous;

  __device__ Stager(const Operand<T>& op) : data(op.data), m_stride(op.m_stride), k_stride(op.k_stride) {
    const int t = int(threadIdx.x);
    k_contiguous = op.k_stride == 1;
    r = k_contiguous ? t / kTileK : t % kTileM;
    k = k_contiguous ? t % kTileK : t / kTileM;
    r_step = k_contiguous ? kThreads / kTileK : 0;
    k_step = k_contiguous ? 0 : kThreads / kTileM;
  }

  // Global -> registers, a tile ahead of its use, so the loads are in flight during the MMAs.
  __device__ __forceinline__ void fetch(int64_t r0, int64_t rows, int64_t k0, int64_t depth,
                                        float (&reg)[kPerThread]) const {
    const int64_t gr = r0 + r, gk = k0 + k;
    const T* p = data + gr * m_stride + gk * k_stride;
    const int64_t step = int64_t(r_step) * m_stride + int64_t(k_step) * k_stride;
#pragma unroll
    for (int n = 0; n < kPerThread; ++n, p += step)
      reg[n] = gr + n * r_step < rows && gk + n * k_step < depth ? to_float(*p) : 0.f;
  }

  __device__ __forceinline__ void stash(const float (&reg)[kPerThread], float (*tile)[kLd]) const {
#pragma unroll
    for (int n = 0; n < kPerThread; ++n) tile[r + n * r_step][k + n * k_step] = reg[n];
  }
};

// A fragment's elements as TF32 (head), and for float32 sources the rounding rest (tail).
template <class Frag>
__device__ __forceinline__ void split_tf32(Frag& head, Frag& tail, bool with_tail) {
#pragma unroll
  for (int i = 0; i < head.num_elements; ++i) {
    const float v = head.x[i];
    head.x[i] = wmma::__float_to_tf32(v);
    if (with_tail) tail.x[i] = wmma::__float_to_tf32(v - head.x[i]);
  }
}

template <class TA, class TB, class TC>
__global__ void __launch_bounds__(kThreads)
    router_linear_kernel(Operand<TA> a, Operand<TB> b, Output<TC> c, int64_t M, int64_t N,
                         int64_t K) {
  constexpr bool kSplitA = std::is_same_v<TA, float>, kSplitB = std::is_same_v<TB, float>;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
  using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;
  // A tile [m][k], B tile [n][k] (B as a column-major k x n matrix); after the loop, the same
  // memory holds the 64 x 64 float outputs.
  constexpr int kSmem = 2 * kTileM * kLd > kTileM * kTileN ? 2 * kTileM * kLd : kTileM * kTileN;
  __shared__ __align__(32) float smem[kSmem];
  float (*a_tile)[kLd] = reinterpret_cast<float (*)[kLd]>(smem);
  float (*b_tile)[kLd] = reinterpret_cast<float (*)[kLd]>(smem + kTileM * kLd);

  const int warp = int(threadIdx.x) / 32, wm = warp / 2, wn = warp % 2;
  const int64_t m0 = int64_t(blockIdx.y) * kTileM, n0 = int64_t(blockIdx.x) * kTileN;
  const Stager<TA> sa(a);
  const Stager<TB> sb(b);
  FragC acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  float ra[kPerThread], rb[kPerThread];
  sa.fetch(m0, M, 0, K, ra);
  sb.fetch(n0, N, 0, K, rb);
  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    sa.stash(ra, a_tile);
    sb.stash(rb, b_tile);
    __syncthreads();
    if (k0 + kTileK < K) {
      sa.fetch(m0, M, k0 + kTileK, K, ra);
      sb.fetch(n0, N, k0 + kTileK, K, rb);
    }
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 8) {
      FragA ah[2], at[2];
      FragB bh[2], bt[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        wmma::load_matrix_sync(ah[i], &a_tile[wm * 32 + i * 16][kk], kLd);
        split_tf32(ah[i], at[i], kSplitA);
        wmma::load_matrix_sync(bh[i], &b_tile[wn * 32 + i * 16][kk], kLd);
        split_tf32(bh[i], bt[i], kSplitB);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if constexpr (kSplitA) wmma::mma_sync(acc[i][j], at[i], bh[j], acc[i][j]);
          if constexpr (kSplitB) wmma::mma_sync(acc[i][j], ah[i], bt[j], acc[i][j]);
          wmma::mma_sync(acc[i][j], ah[i], bh[j], acc[i][j]);
        }
    }
    __syncthreads();
  }
  float (*out_tile)[kTileN] = reinterpret_cast<float (*)[kTileN]>(smem);
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(&out_tile[wm * 32 + i * 16][wn * 32 + j * 16], acc[i][j], kTileN,
                              wmma::mem_row_major);
  __syncthreads();
#pragma unroll 1
  for (int i = int(threadIdx.x); i < kTileM * kTileN; i += kThreads) {
    const int r = i / kTileN, col = i % kTileN;
    const int64_t m = m0 + r, n = n0 + col;
    if (m >= M || n >= N) continue;
    TC* out = c.data + m * c.ld + n;
    from_float(c.accumulate ? to_float(*out) + out_tile[r][col] : out_tile[r][col], out);
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
  router_linear_kernel<TA, TB, TC><<<grid, kThreads, 0, stream>>>(a, b, c, M, N, K);
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
