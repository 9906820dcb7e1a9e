// The router's products for 16-bit operands (router_linear_16bit.cuh says what and in which order).
#include "cuda/kernels/router_linear_16bit.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <initializer_list>

#include "cuda/ptx/cp_async.cuh"
#include "cuda/runtime/check.hpp"
#include "cuda/runtime/dtype_dispatch.cuh"

namespace moe::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kVec = 8;  // 16-bit elements per 16-byte load

// 8 packed 16-bit values -> float (exact).
__device__ __forceinline__ void unpack8(const uint4& v, const __nv_bfloat16*, float (&f)[kVec]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack8(const uint4& v, const __half*, float (&f)[kVec]) {
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __half22float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// Rows of 16-bit elements that 16-byte loads can read: contiguous rows, the row stride and the
// base 16-byte aligned.
bool vector_rows(const TensorView& t) {
  return t.stride(1) == 1 && t.stride(0) % kVec == 0 && is_aligned(t.data(), 16);
}

bool sixteen_bit(DType d) { return d == DType::kBFloat16 || d == DType::kFloat16; }

// ---- logits [T, E] = x [T, H] W [E, H]^T ----
//
// A thread owns kTok tokens and kC consecutive experts (a "chunk"); a block of kThreads holds chunks
// x (kThreads / chunks) such thread rows. Both operands stream through shared memory by cp.async,
// kStages stages of kStageK columns in flight; a thread reads 8 columns of each of its tokens and
// experts per 16-byte load, so each unpacked weight value feeds kTok sums and each unpacked x value
// kC of them (logits_config picks both from T and E).
constexpr int kStageK = 32;
constexpr int kStages = 4;
constexpr int kMaxExperts = 256;
constexpr int kRowPad = kVec;  // 16-bit elements after each staged row: 80-byte rows, conflict-free reads

struct LogitsShape {
  int64_t T, H, E, x_ld, w_ld, out_ld;
  int chunks, tokens_per_block, weight_rows;  // weight_rows = chunks * kC
};

// Staged weight row e: rows of kStageK + kRowPad elements, and 8 more elements after each 8 rows,
// so the rows of the 8 chunks a quarter-warp reads at once start on different banks.
__device__ __forceinline__ int weight_row_offset(int e) { return e * (kStageK + kRowPad) + (e / 8) * kVec; }

template <class T, int kC, int kTok>
__global__ void __launch_bounds__(kThreads) router_logits_16bit_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                                      float* __restrict__ logits, LogitsShape s) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kRow = kStageK + kRowPad;
  const int x_stage = s.tokens_per_block * kRow;
  const int w_stage = weight_row_offset(s.weight_rows);
  T* xs = reinterpret_cast<T*>(smem);  // [kStages][tokens_per_block][kRow]
  T* ws = xs + kStages * x_stage;      // [kStages][weight rows, padded]
  const int tid = int(threadIdx.x);
  // A thread's tokens are kThreads / chunks apart, so a quarter-warp reads x as with one token each.
  const int chunk = tid % s.chunks, token = tid / s.chunks, token_stride = kThreads / s.chunks;
  const int64_t t0 = int64_t(blockIdx.x) * s.tokens_per_block;
  const int stages = int((s.H + kStageK - 1) / kStageK);
  constexpr int kPiecesPerRow = kStageK / kVec;
  const int x_pieces = s.tokens_per_block * kPiecesPerRow, all_pieces = x_pieces + s.weight_rows * kPiecesPerRow;

  auto issue = [&](int stage) {
    if (stage < stages) {
      const int64_t k0 = int64_t(stage) * kStageK;
      for (int p = tid; p < all_pieces; p += kThreads) {
        const bool is_x = p < x_pieces;
        const int q = is_x ? p : p - x_pieces;
        const int r = q / kPiecesPerRow, c = (q % kPiecesPerRow) * kVec;
        const int64_t k = k0 + c;
        // H % 8 == 0: a piece is wholly inside or outside; outside reads nothing and stores zeros
        const bool valid = k < s.H && (is_x ? t0 + r < s.T : r < s.E);
        const T* src = !valid ? x : is_x ? x + (t0 + r) * s.x_ld + k : w + r * s.w_ld + k;
        T* dst = is_x ? xs + (stage % kStages) * x_stage + r * kRow + c
                      : ws + (stage % kStages) * w_stage + weight_row_offset(r) + c;
        ptx::cp_async_16(uint32_t(__cvta_generic_to_shared(dst)), src, valid);
      }
    }
    ptx::cp_async_commit_group();  // empty groups past the end keep the wait count uniform
  };

  float acc[kTok][kC] = {};
  for (int st = 0; st < kStages - 1; ++st) issue(st);
  for (int st = 0; st < stages; ++st) {
    ptx::cp_async_wait_group<kStages - 2>();  // stage st has landed (this thread's copies)
    __syncthreads();                          // ... and everyone's; stage st - 1's buffers are free
    issue(st + kStages - 1);
    const T* xr = xs + (st % kStages) * x_stage + token * kRow;
    const T* wr = ws + (st % kStages) * w_stage;
#pragma unroll
    for (int kk = 0; kk < kStageK; kk += kVec) {
      float xf[kTok][kVec];
#pragma unroll
      for (int u = 0; u < kTok; ++u)
        unpack8(*reinterpret_cast<const uint4*>(xr + u * token_stride * kRow + kk), static_cast<const T*>(nullptr),
                xf[u]);
#pragma unroll
      for (int j = 0; j < kC; ++j) {
        float wf[kVec];
        unpack8(*reinterpret_cast<const uint4*>(wr + weight_row_offset(chunk * kC + j) + kk),
                static_cast<const T*>(nullptr), wf);
#pragma unroll
        for (int u = 0; u < kTok; ++u)
#pragma unroll
          for (int v = 0; v < kVec; ++v) acc[u][j] = fmaf(xf[u][v], wf[v], acc[u][j]);  // h in increasing order
      }
    }
  }
  ptx::cp_async_wait_group<0>();
#pragma unroll
  for (int u = 0; u < kTok; ++u) {
    const int64_t t = t0 + token + u * token_stride;
    if (t >= s.T) break;
#pragma unroll
    for (int j = 0; j < kC; ++j) {
      const int64_t e = int64_t(chunk) * kC + j;
      if (e < s.E) logits[t * s.out_ld + e] = acc[u][j];
    }
  }
}

// ---- dx [T, H] (+)= d_logits [T, E] W [E, H]: a thread owns kRows tokens x 8 columns ----
// (8 rows: 64 sums per 16-byte weight load; faster than 2 even where 8 leave the GPU half idle.)
constexpr int kRows = 8;

template <class T>
__global__ void __launch_bounds__(kThreads) router_dgrad_16bit_kernel(const float* __restrict__ dl, int64_t dl_ld,
                                                                     const T* __restrict__ w, int64_t w_ld,
                                                                     T* __restrict__ dx, int64_t dx_ld, int64_t T_,
                                                                     int64_t H, int64_t E, bool accumulate) {
  const int64_t h = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * kVec;
  const int64_t t0 = int64_t(blockIdx.y) * kRows;
  if (h >= H) return;
  float acc[kRows][kVec] = {};
  const float* dl_rows[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) dl_rows[r] = dl + (t0 + r < T_ ? t0 + r : T_ - 1) * dl_ld;
#pragma unroll 4
  for (int64_t e = 0; e < E; ++e) {
    float wf[kVec];
    unpack8(__ldg(reinterpret_cast<const uint4*>(w + e * w_ld + h)), static_cast<const T*>(nullptr), wf);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float d = __ldg(dl_rows[r] + e);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[r][j] = fmaf(d, wf[j], acc[r][j]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t t = t0 + r;
    if (t >= T_) break;
    T* out = dx + t * dx_ld + h;
    float v[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = acc[r][j];
    if (accumulate) {
      float old[kVec];
      unpack8(*reinterpret_cast<const uint4*>(out), static_cast<const T*>(nullptr), old);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = old[j] + v[j];
    }
    alignas(16) T packed[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) from_float(v[j], &packed[j]);
    *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(packed);
  }
}

// ---- dW [E, H] = sum_t d_logits [T, E]^T x [T, H]: a thread owns 8 experts x 8 columns of one
// token slice, summed over its tokens in order; blockIdx.z is the slice. The slice's d_logits
// columns pass through shared memory kWgradTokens at a time; x rows are loaded 8 tokens ahead. ----
constexpr int kWgradExperts = 8;
constexpr int kWgradTokens = 256;
constexpr int kWgradAhead = 8;

template <class T, class TC>
__global__ void __launch_bounds__(kThreads) router_wgrad_16bit_kernel(const float* __restrict__ dl, int64_t dl_ld,
                                                                     const T* __restrict__ x, int64_t x_ld,
                                                                     float* __restrict__ partials, TC* __restrict__ dw,
                                                                     int64_t dw_ld, int64_t T_, int64_t H, int64_t E,
                                                                     int64_t slice_tokens, bool accumulate) {
  __shared__ __align__(16) float dls[kWgradTokens][kWgradExperts];
  // blockIdx.x runs over the expert chunks fastest: the blocks reading the same x tile run together
  // (x from L2 once for all of them).
  const int64_t chunks = (E + kWgradExperts - 1) / kWgradExperts;
  const int64_t e0 = (int64_t(blockIdx.x) % chunks) * kWgradExperts;
  const int64_t h = ((int64_t(blockIdx.x) / chunks) * kThreads + threadIdx.x) * kVec;
  const int64_t t_begin = int64_t(blockIdx.z) * slice_tokens;
  const int64_t t_end = t_begin + slice_tokens < T_ ? t_begin + slice_tokens : T_;
  const bool active = h < H;  // H % 8 == 0: all 8 columns inside
  float acc[kWgradExperts][kVec] = {};
  auto add_token = [&](const uint4& xv, int r) {
    float xf[kVec];
    unpack8(xv, static_cast<const T*>(nullptr), xf);
    const float4 d0 = *reinterpret_cast<const float4*>(&dls[r][0]);
    const float4 d1 = *reinterpret_cast<const float4*>(&dls[r][4]);
    const float d[kWgradExperts] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
#pragma unroll
    for (int i = 0; i < kWgradExperts; ++i)
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[i][j] = fmaf(d[i], xf[j], acc[i][j]);
  };
  for (int64_t tb = t_begin; tb < t_end; tb += kWgradTokens) {
    const int n = int(t_end - tb < kWgradTokens ? t_end - tb : kWgradTokens);
    __syncthreads();  // the previous tokens' reads of dls are done
    for (int i = int(threadIdx.x); i < n * kWgradExperts; i += kThreads) {
      const int r = i / kWgradExperts, j = i % kWgradExperts;
      dls[r][j] = e0 + j < E ? dl[(tb + r) * dl_ld + e0 + j] : 0.f;
    }
    __syncthreads();
    if (!active) continue;
    const T* xp = x + tb * x_ld + h;
    int r = 0;
    for (; r + kWgradAhead <= n; r += kWgradAhead) {
      uint4 xv[kWgradAhead];
#pragma unroll
      for (int u = 0; u < kWgradAhead; ++u) xv[u] = __ldg(reinterpret_cast<const uint4*>(xp + (r + u) * x_ld));
#pragma unroll
      for (int u = 0; u < kWgradAhead; ++u) add_token(xv[u], r + u);
    }
    for (; r < n; ++r) add_token(__ldg(reinterpret_cast<const uint4*>(xp + r * x_ld)), r);
  }
  if (!active) return;
  const bool sliced = partials != nullptr;
#pragma unroll
  for (int i = 0; i < kWgradExperts; ++i) {
    const int64_t e = e0 + i;
    if (e >= E) break;
    if (sliced) {
      float* out = partials + (int64_t(blockIdx.z) * E + e) * H + h;
      *reinterpret_cast<float4*>(out) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      *reinterpret_cast<float4*>(out + 4) = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
    } else {
      TC* out = dw + e * dw_ld + h;
#pragma unroll
      for (int j = 0; j < kVec; ++j) from_float(accumulate ? to_float(out[j]) + acc[i][j] : acc[i][j], out + j);
    }
  }
}

}  // namespace

LogitsConfig logits_config(int64_t tokens, int64_t experts) {
  // The first of these that leaves ~6 warps an SM of a 132-SM part: more tokens a thread share each
  // unpacked weight value, more experts each x value (bench/experiments/router_schedules.cu: at the
  // suite's shapes this picks the fastest of 8 x 4, 8 x 2, 8 x 1, 2 x 2 and 2 x 1 or within 15% of
  // it; 8 x 2 and 8 x 1 were never the only fast one, so they are not built).
  constexpr int64_t kEnoughThreads = 132 * 6 * 32;
  for (const LogitsConfig c : {LogitsConfig{8, 4}, LogitsConfig{2, 2}})
    if (tokens * ((experts + c.experts_per_thread - 1) / c.experts_per_thread) / c.tokens_per_thread >= kEnoughThreads)
      return c;
  return LogitsConfig{2, 1};
}

namespace {

template <int kC, int kTok, class T16>
void launch_logits(const TensorView& x, const TensorView& weight, const TensorView& logits, Stream stream) {
  const int64_t T = x.size(0), H = x.size(1), E = weight.size(0);
  int chunks = 1;
  while (chunks * kC < E) chunks *= 2;  // a power of 2 that divides kThreads
  LogitsShape s{T, H, E, x.stride(0), weight.stride(0), logits.stride(0), chunks, kThreads / chunks * kTok,
                chunks * kC};
  const int64_t blocks = (T + s.tokens_per_block - 1) / s.tokens_per_block;
  const int padded_rows = s.weight_rows * (kStageK + kRowPad) + (s.weight_rows / 8) * kVec;
  const size_t smem = 2 * size_t(kStages) * (size_t(s.tokens_per_block) * (kStageK + kRowPad) + padded_rows);
  auto kernel = router_logits_16bit_kernel<T16, kC, kTok>;
  if (smem > 48 * 1024)  // per launch: the setting belongs to the current device
    MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
                   "router logits: shared memory");
  kernel<<<unsigned(blocks), kThreads, smem, stream>>>(x.data_as<T16>(), weight.data_as<T16>(),
                                                       logits.data_as<float>(), s);
  MOE_CUDA_CHECK_LAUNCH("router logits (16-bit)");
}

}  // namespace

bool router_logits_16bit(const TensorView& x, const TensorView& weight, const TensorView& logits, Stream stream,
                         std::optional<LogitsConfig> config) {
  const int64_t T = x.size(0), H = x.size(1), E = weight.size(0);
  if (!sixteen_bit(x.dtype()) || weight.dtype() != x.dtype() || logits.dtype() != DType::kFloat32) return false;
  if (E > kMaxExperts || H % kVec != 0 || !vector_rows(x) || !vector_rows(weight) || logits.stride(1) != 1)
    return false;
  if (T == 0) return true;
  const LogitsConfig c = config ? *config : logits_config(T, E);
  bool launched = false;
  with_cuda_type(x.dtype(), "router_forward", [&](auto type) {
    using T16 = decltype(type);
    if constexpr (sizeof(T16) == 2) {
      const auto is = [&](int experts, int tokens) {
        return c.experts_per_thread == experts && c.tokens_per_thread == tokens;
      };
      launched = true;
      if (is(8, 4))
        launch_logits<8, 4, T16>(x, weight, logits, stream);
      else if (is(2, 2))
        launch_logits<2, 2, T16>(x, weight, logits, stream);
      else if (is(2, 1))
        launch_logits<2, 1, T16>(x, weight, logits, stream);
      else
        launched = false;
    }
  });
  return launched;
}

bool router_dgrad_16bit(const TensorView& d_logits, const TensorView& weight, const TensorView& dx,
                        bool accumulate, Stream stream) {
  const int64_t T = dx.size(0), H = dx.size(1), E = weight.size(0);
  if (!sixteen_bit(weight.dtype()) || dx.dtype() != weight.dtype() || d_logits.dtype() != DType::kFloat32 ||
      d_logits.stride(1) != 1)
    return false;
  if (H % kVec != 0 || !vector_rows(weight) || !vector_rows(dx)) return false;
  if (T == 0 || H == 0) return true;
  const dim3 grid(unsigned((H / kVec + kThreads - 1) / kThreads), unsigned((T + kRows - 1) / kRows));
  if ((T + kRows - 1) / kRows > 65535) return false;
  with_cuda_type(weight.dtype(), "router_backward", [&](auto type) {
    using T16 = decltype(type);
    if constexpr (sizeof(T16) == 2) {
      router_dgrad_16bit_kernel<T16><<<grid, kThreads, 0, stream>>>(d_logits.data_as<float>(), d_logits.stride(0),
                                                                    weight.data_as<T16>(), weight.stride(0),
                                                                    dx.data_as<T16>(), dx.stride(0), T, H, E,
                                                                    accumulate);
      MOE_CUDA_CHECK_LAUNCH("router dgrad (16-bit)");
    }
  });
  return true;
}

bool router_wgrad_16bit(const TensorView& d_logits, const TensorView& x, const TensorView& partials,
                        const TensorView& dweight, bool accumulate, Stream stream) {
  const int64_t T = x.size(0), H = x.size(1), E = dweight.size(0);
  if (!sixteen_bit(x.dtype()) || d_logits.dtype() != DType::kFloat32 || d_logits.stride(1) != 1 ||
      dweight.stride(1) != 1)
    return false;
  if (H % kVec != 0 || !vector_rows(x)) return false;
  const bool sliced = partials.defined();
  const int64_t slices = sliced ? partials.size(0) : 1;
  if (sliced && (!partials.is_contiguous() || !is_aligned(partials.data(), 16))) return false;
  const int64_t chunks = (E + kWgradExperts - 1) / kWgradExperts;
  const int64_t hblocks = (H / kVec + kThreads - 1) / kThreads;
  const int64_t slice_tokens = (T + slices - 1) / slices;
  bool launched = false;
  with_cuda_type(x.dtype(), "router_backward", [&](auto in) {
    with_cuda_type(dweight.dtype(), "router_backward", [&](auto out) {
      using T16 = decltype(in);
      using TC = decltype(out);
      if constexpr (sizeof(T16) == 2) {
        router_wgrad_16bit_kernel<T16, TC><<<dim3(unsigned(chunks * hblocks), 1, unsigned(slices)), kThreads, 0,
                                             stream>>>(d_logits.data_as<float>(), d_logits.stride(0),
                                                       x.data_as<T16>(), x.stride(0),
                                                       sliced ? partials.data_as<float>() : nullptr,
                                                       dweight.data_as<TC>(), dweight.stride(0), T, H, E,
                                                       slice_tokens, accumulate);
        MOE_CUDA_CHECK_LAUNCH("router wgrad (16-bit)");
        launched = true;
      }
    });
  });
  return launched;
}

}  // namespace moe::cuda
