// Portable grouped GEMM: 64 x 64 output tiles per 256-thread block (4 x 4 per thread), operands
// staged through shared memory in steps of 16 along the contraction, fp32 accumulation in a fixed
// order (deterministic). Every load and store is bounds-checked, so any size, stride and alignment
// works. Launch shapes depend only on static sizes: graph safe.
#include <string>

#include "cuda/runtime/check.hpp"
#include "cuda/runtime/device_traits.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"
#include "cuda/portable/grouped_gemm.hpp"

namespace moe::cuda::portable {
namespace {

constexpr int kTile = 64, kStep = 16, kThreads = 256;
constexpr int kMGroupedRowBlocks = 1024;  // fixed grid height of forward/dgrad (grid-strided)

struct Params {
  const void* a;
  int64_t lda;
  ExpertAddress b;
  int64_t ldb;
  ExpertAddress d;
  int64_t ldd;
  int64_t num_groups, n, k;
  const int64_t* offsets;
  ExpertAddress bias;
  const float* row_scale;
  bool accumulate;
};

// One 64 x 64 tile: acc[i][j] = sum_c A(m0 + 4 ty + i, c) B(n0 + 4 tx + j, c) over c < length,
// with loaders returning 0 outside the operands.
template <class LoadA, class LoadB>
__device__ void tile_product(int64_t length, LoadA load_a, LoadB load_b, float (&acc)[4][4]) {
  __shared__ float as[kStep][kTile + 1], bs[kStep][kTile + 1];
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  for (int64_t c0 = 0; c0 < length; c0 += kStep) {
    for (int e = tid; e < kTile * kStep; e += kThreads) {
      const int r = e / kStep, c = e % kStep;  // consecutive threads walk the contraction
      as[c][r] = load_a(r, c0 + c);
      bs[c][r] = load_b(r, c0 + c);
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kStep; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += as[c][4 * ty + i] * bs[c][4 * tx + j];
    __syncthreads();
  }
}

// Forward and dgrad: grid (ceil(n_out / 64), kMGroupedRowBlocks); row blocks walk the groups'
// 64-row tiles in increasing order.
template <Form kForm, class In, class Out>
__global__ void __launch_bounds__(kThreads) m_grouped_kernel(Params p) {
  const int64_t n_out = kForm == Form::kForward ? p.n : p.k;
  const int64_t length = kForm == Form::kForward ? p.k : p.n;
  const int64_t n0 = int64_t(blockIdx.x) * kTile;
  const In* a = static_cast<const In*>(p.a);
  int64_t g = 0, first = 0;  // first 64-row tile index of group g
  for (int64_t t = blockIdx.y;; t += gridDim.y) {
    int64_t begin = 0, rows = 0;
    while (g < p.num_groups) {
      begin = p.offsets[g];
      rows = p.offsets[g + 1] - begin;
      const int64_t tiles = (rows + kTile - 1) / kTile;
      if (t < first + tiles) break;
      first += tiles;
      ++g;
    }
    if (g >= p.num_groups) return;
    const int64_t m0 = (t - first) * kTile;
    const ExpertAddress b = p.b, bias_address = p.bias;  // local copies (see k_grouped_kernel)
    const In* w = b.at<const In>(g);
    float acc[4][4];
    tile_product(
        length,
        [&](int r, int64_t c) {
          return (m0 + r < rows && c < length) ? to_float(a[(begin + m0 + r) * p.lda + c]) : 0.f;
        },
        [&](int r, int64_t c) {
          const int64_t n = n0 + r;
          if (n >= n_out || c >= length) return 0.f;
          return kForm == Form::kForward ? to_float(w[n * p.ldb + c]) : to_float(w[c * p.ldb + n]);
        },
        acc);
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    Out* d = static_cast<Out*>(const_cast<void*>(p.d.base));
    const In* bias = (kForm == Form::kForward && bias_address.defined())
                         ? bias_address.at<const In>(g)
                         : nullptr;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t m = m0 + 4 * ty + i;
      if (m >= rows) continue;
      const float scale = (bias && p.row_scale) ? p.row_scale[begin + m] : 1.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t n = n0 + 4 * tx + j;
        if (n >= n_out) continue;
        const float v = acc[i][j] + (bias ? scale * to_float(bias[n]) : 0.f);
        from_float(v, d + (begin + m) * p.ldd + n);
      }
    }
  }
}

// Wgrad: grid (ceil(K / 64), ceil(N / 64), G); block (x, y, g) owns dW_g rows y*64.., cols x*64..
template <class In, class Out>
__global__ void __launch_bounds__(kThreads, 1) k_grouped_kernel(Params p) {
  const int64_t g = blockIdx.z, begin = p.offsets[g], rows = p.offsets[g + 1] - begin;
  if (p.accumulate && rows == 0) return;  // main_grad untouched for an empty expert
  const int64_t m0 = int64_t(blockIdx.y) * kTile, n0 = int64_t(blockIdx.x) * kTile;
  const In* dy = static_cast<const In*>(p.a);
  const In* x = static_cast<const In*>(p.b.base);
  float acc[4][4];
  tile_product(
      rows,
      [&](int r, int64_t t) {
        return (m0 + r < p.n && t < rows) ? to_float(dy[(begin + t) * p.lda + m0 + r]) : 0.f;
      },
      [&](int r, int64_t t) {
        return (n0 + r < p.k && t < rows) ? to_float(x[(begin + t) * p.ldb + n0 + r]) : 0.f;
      },
      acc);
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const ExpertAddress d = p.d;  // a local copy: calling a member on a kernel parameter spills it
  Out* dw = d.at<Out>(g);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + 4 * ty + i;
    if (m >= p.n) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + 4 * tx + j;
      if (n >= p.k) continue;
      Out* out = dw + m * p.ldd + n;
      from_float(p.accumulate ? to_float(*out) + acc[i][j] : acc[i][j], out);
    }
  }
}

}  // namespace

bool can_run(const GroupedGemmProblem& pr, std::string* why) {
  if (device_traits(pr.device).major < 8) {
    if (why) *why = "the CUDA kernels need compute capability 8.0 or newer";
    return false;
  }
  return true;
}

void run(const GroupedGemmProblem& pr, Stream stream) {
  const int64_t n_out = pr.form == Form::kForward ? pr.n : pr.k;
  // Nothing to write (a zero-sized grid would not launch). A zero-length contraction still writes.
  if (pr.num_groups == 0 || n_out == 0 || (pr.form == Form::kWgrad && pr.n == 0)) return;
  const Params p{pr.a,         pr.a_row_stride, pr.b,          pr.b_row_stride,
                 pr.d,         pr.d_row_stride, pr.num_groups, pr.n,
                 pr.k,         pr.offsets,      pr.bias,       pr.row_scale,
                 pr.accumulate};
  with_cuda_type(pr.in_dtype, "grouped GEMM", [&](auto in) {
    with_cuda_type(pr.out_dtype, "grouped GEMM", [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      switch (pr.form) {
        case Form::kForward:
          m_grouped_kernel<Form::kForward, In, Out>
              <<<dim3(unsigned((n_out + kTile - 1) / kTile), kMGroupedRowBlocks), kThreads, 0,
                 stream>>>(p);
          break;
        case Form::kDgrad:
          m_grouped_kernel<Form::kDgrad, In, Out>
              <<<dim3(unsigned((n_out + kTile - 1) / kTile), kMGroupedRowBlocks), kThreads, 0,
                 stream>>>(p);
          break;
        case Form::kWgrad:
          k_grouped_kernel<In, Out>
              <<<dim3(unsigned((pr.k + kTile - 1) / kTile), unsigned((pr.n + kTile - 1) / kTile),
                      unsigned(pr.num_groups)),
                 kThreads, 0, stream>>>(p);
          break;
      }
      MOE_CUDA_CHECK_LAUNCH("portable grouped GEMM");
    });
  });
}

}  // namespace moe::cuda::portable
