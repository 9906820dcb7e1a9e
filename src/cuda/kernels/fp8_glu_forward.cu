// The FP8 expert MLP's step between its two GEMMs in one pass: from FC1's output h [T, 2F] it
// writes h quantized by rows (what backward keeps) and act = GLU(h) * p quantized by rows (FC2's
// operand). The unfused steps (quantize_fp8(h), glu_forward, quantize_fp8(act)) read h twice and
// act once more; this reads h once and writes only FP8. Same bytes and scales as those steps: the
// same GLU function (common/glu_math.hpp), act rounded to h's dtype as glu_forward stores it, the
// quantizers' tile rule (common/fp8_math.hpp) on the same values.
//
// A warp takes 8 rows x 128 features (act's scale block): the two 128-column blocks of h that hold
// those features' gate and linear values, 8 columns a lane and row, in 16-byte loads. h's rows are
// quantized from the loaded words as the row quantizer does (fp8_tile_stream.cuh's
// quantize_row_slots), and act from 8 features a lane and row, exchanged between lanes where the
// layout splits a feature's gate and linear values over two (GluLanes). Layouts: pairs, blocks of
// 4, blocks of 8..64 dividing 64, blocks of a multiple of 128 (and, with h not kept, of 8); others
// take the unfused steps.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/fp8_math.hpp"
#include "common/glu_math.hpp"
#include "cuda/backend.hpp"
#include "cuda/kernels/fp8_glu_pass.cuh"
#include "cuda/kernels/fp8_tile_stream.cuh"
#include "cuda/ptx/pair16.cuh"
#include "cuda/runtime/check.hpp"

namespace moe::cuda {
namespace {

using namespace glu_pass;

struct GluQuantizeParams {
  const void* h;
  int64_t h_ld;
  const float* probs;  // [T] or null (p = 1)
  const int64_t* offsets;
  int64_t num_groups;
  int32_t ffn, block;  // F; s of the layout (1: pairs)
  detail::GluMath<float> math;
  uint8_t* h_data;  // null: h is not kept
  int64_t h_data_ld;
  float* h_scales;
  int64_t h_scales_ld;
  uint8_t* act_data;
  int64_t act_data_ld;
  float* act_scales;
  int64_t act_scales_ld;
  bool pow2;
  float epsilon;
};

// The lane's 8 values of a slot as T words, rounded to T once (as glu_forward stores act).
template <class T>
__device__ __forceinline__ void pack8(const float (&v)[8], uint32_t (&w)[8 / fp8_tiles::Words<T>::kPerWord]) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = __float_as_uint(v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = Pair16<T>::pack(v[2 * i], v[2 * i + 1]);
  }
}

// A warp's item is 8 rows x 128 features (act's scale block): half-warp `half` takes rows
// r0 + half + 2 s (slots s = 0..3), and lane m 8 columns of each of the two 128-column blocks of
// h that hold those features' gate and linear values, one 16-byte load per slot and block (8 in
// flight a lane). h's rows are quantized straight from these words and act = GLU(h) * p, 8
// features a lane and slot, the same way (quantize_row_slots: a half-warp's row amaxes by
// halving exchanges, the tile rule once per row).
// kSwiGLU: GluMath::swiglu_forward (SwiGLU's constants at compile time, no clamps: act's NaN
// payloads do not survive its quantization) instead of p.math's forward.
template <class T, GluLanes kLanes, bool kPairs, bool kSwiGLU>
__global__ void __launch_bounds__(kThreads) fp8_glu_quantize_kernel(const GluQuantizeParams p) {
  const auto glu = [&](float gate, float linear) {
    return kSwiGLU ? detail::GluMath<float>::swiglu_forward(gate, linear) : p.math.forward(gate, linear);
  };
  using fp8_tiles::quantize_row_slots;
  using fp8_tiles::Words;
  constexpr int W = 8 / Words<T>::kPerWord;  // words of 8 values
  const int64_t rows = p.offsets[p.num_groups];
  const int32_t feature_blocks = (p.ffn + kFeatures - 1) / kFeatures;
  const int64_t items = (rows + 7) / 8 * feature_blocks;
  const int lane = int(threadIdx.x % 32), half = lane / 16, m = lane % 16;
  const fp8_tiles::Recipe recipe{p.pow2, p.epsilon};
  const int64_t stride = int64_t(gridDim.x) * kWarps;
#pragma unroll 1
  for (int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; item < items; item += stride) {
    const int64_t group = item / feature_blocks;
    const int32_t fb = int32_t(item - group * feature_blocks), f0 = fb * kFeatures;
    const int64_t r0 = 8 * group + half;  // the half-warp's slot 0
    // The lane's first column in each block, and whether it and the block hold values.
    int32_t col[2];
    bool lane_in[2], block_in[2];
    if constexpr (kLanes == GluLanes::kRuns) {
      const int32_t gate0 = (f0 / p.block) * 2 * p.block + f0 % p.block;  // the item's gate run
      col[0] = gate0 + 8 * m;
      col[1] = col[0] + p.block;
      lane_in[0] = lane_in[1] = f0 + 8 * m < p.ffn;
      block_in[0] = block_in[1] = true;
    } else {
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        col[a] = 2 * f0 + kFeatures * a + 8 * m;
        lane_in[a] = col[a] < 2 * p.ffn;  // 2F % 32 == 0: a lane's 8 columns are all in or all out
        block_in[a] = 2 * f0 + kFeatures * a < 2 * p.ffn;
      }
    }
    uint32_t hw[2][4][W];
    const T* hr = static_cast<const T*>(p.h) + r0 * p.h_ld;
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int v = 0; v < W; v += 4) {
          uint4 q = make_uint4(0, 0, 0, 0);
          if (lane_in[a] && r0 + 2 * s < rows)
            q = __ldcs(reinterpret_cast<const uint4*>(hr + 2 * s * p.h_ld + col[a]) + v / 4);
          hw[a][s][v] = q.x, hw[a][s][v + 1] = q.y, hw[a][s][v + 2] = q.z, hw[a][s][v + 3] = q.w;
        }
    auto row_in = [&](int s) { return r0 + 2 * s < rows; };
    if (p.h_data != nullptr) {  // uniform
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        const int64_t block = col[a] / kFp8Block;  // the lane's block is every lane's
        quantize_row_slots<T>(recipe, hw[a], p.h_data + r0 * p.h_data_ld + col[a], 2 * p.h_data_ld,
                              p.h_scales + block * p.h_scales_ld + r0, 2,
                              [&](int s) { return block_in[a] && row_in(s); }, lane_in[a], lane);
      }
    }
    // The lane's 8 features of act: their first one and, per slot, their values.
    int32_t act_f;
    bool is_gate = true;
    if constexpr (kLanes == GluLanes::kFour) {
      act_f = m % 2 == 0 ? f0 + 4 * m : f0 + kFeatures / 2 + 4 * (m - 1);
    } else if constexpr (kLanes == GluLanes::kPartner) {
      const int32_t within = (8 * m) % (2 * p.block);  // the lane's column in its run pair
      is_gate = within < p.block;
      act_f = f0 + (is_gate ? 0 : kFeatures / 2) + (8 * m) / (2 * p.block) * p.block + within % p.block;
    } else {
      act_f = f0 + 8 * m;
    }
    const bool act_in = act_f < p.ffn;  // F % 16 == 0: the lane's 8 features are all in or all out
    uint32_t aw[4][W];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const float prob = p.probs != nullptr && row_in(s) ? __ldg(p.probs + r0 + 2 * s) : 1.f;
      using V = Words<T>;
      float act[8];  // act * p of the lane's 8 features
      if constexpr (kLanes == GluLanes::kFour) {
        // The lane's 4 features of each block; the even lane of a pair ends with both lanes'
        // block-0 features, the odd one with both lanes' block-1 features: 8 consecutive features.
        float own[2][4];
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            own[a][i] = glu(V::value(hw[a][s], kPairs ? 2 * i : i), V::value(hw[a][s], kPairs ? 2 * i + 1 : 4 + i)) * prob;
        const bool odd = m % 2;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float other = __shfl_xor_sync(~0u, odd ? own[0][i] : own[1][i], 1);
          act[i] = odd ? other : own[0][i];
          act[4 + i] = odd ? own[1][i] : other;
        }
      } else if constexpr (kLanes == GluLanes::kPartner) {
        // The gate lane takes its block-0 features (their linear values from the partner), the
        // linear lane its block-1 features (their gate values from the partner).
        uint32_t other[W];
#pragma unroll
        for (int v = 0; v < W; ++v) other[v] = __shfl_xor_sync(~0u, is_gate ? hw[1][s][v] : hw[0][s][v], p.block / 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float g = is_gate ? V::value(hw[0][s], i) : V::value(other, i);
          const float l = is_gate ? V::value(other, i) : V::value(hw[1][s], i);
          act[i] = glu(g, l) * prob;
        }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) act[i] = glu(V::value(hw[0][s], i), V::value(hw[1][s], i)) * prob;
      }
      // Features past F hold zeros (amax-neutral whatever p is).
#pragma unroll
      for (int i = 0; i < 8; ++i) act[i] = act_in ? act[i] : 0.f;
      pack8<T>(act, aw[s]);
    }
    quantize_row_slots<T>(recipe, aw, p.act_data + r0 * p.act_data_ld + act_f, 2 * p.act_data_ld,
                          p.act_scales + int64_t(fb) * p.act_scales_ld + r0, 2, row_in, act_in, lane);
  }
}

}  // namespace

bool fp8_glu_quantize(const TensorView& h, const TensorView& probs, const GroupLayout& groups, const Fp8Rows& h_rows,
                      const Fp8Rows& act_rows, const GluSpec& spec, const Fp8Recipe& recipe, Stream stream) {
  const int64_t F = act_rows.data.size(1), T = groups.capacity();
  if (!spec.gated()) return false;  // GLUs only: a non-gated activation takes the separate steps
  if (h.dtype() != DType::kBFloat16 && h.dtype() != DType::kFloat32) return false;
  if (F % 16 != 0 || F >= (int64_t(1) << 30)) return false;
  const int64_t s = F > 0 ? spec.layout.block_size(F) : 1;
  const bool keep_h = h_rows.data.defined();
  // Which lanes hold a feature's gate and linear values; without h kept (act alone) any layout of
  // 8-column runs will do.
  const GluLanes lanes = glu_lanes(s);
  if (lanes == GluLanes::kNone) return false;
  if (lanes == GluLanes::kRuns && keep_h && s % kFp8Block != 0) return false;  // h's blocks must be runs
  // 16-byte loads of 8 values of h; 8-byte stores of 8 FP8 bytes.
  if (!rows_aligned(h, 16) || !rows_aligned(act_rows.data, 8)) return false;
  if (keep_h && !rows_aligned(h_rows.data, 8)) return false;
  if (T == 0 || F == 0) return true;

  GluQuantizeParams p{};
  p.h = h.data();
  p.h_ld = h.stride(0);
  p.probs = probs.defined() ? probs.data_as<float>() : nullptr;
  set_glu_fields(p, groups, F, s, spec);
  if (keep_h) set_h_rows(p, h_rows);
  p.act_data = static_cast<uint8_t*>(act_rows.data.data());
  p.act_data_ld = act_rows.data.stride(0);
  p.act_scales = act_rows.scales.data_as<float>();
  p.act_scales_ld = act_rows.scales.stride(0);
  p.pow2 = recipe.pow2_scales;
  p.epsilon = recipe.amax_epsilon;
  const int64_t items = (T + 7) / 8 * ((F + kFeatures - 1) / kFeatures);
  const int device = h.device().index;
  auto go = [&](auto type, auto swiglu) {
    using T_ = decltype(type);
    constexpr bool kSwiGLU = decltype(swiglu)::value;
    constexpr const char* kName = "fp8_glu_quantize_kernel";
    if (lanes == GluLanes::kFour && s == 1)
      return launch_warp_items<fp8_glu_quantize_kernel<T_, GluLanes::kFour, true, kSwiGLU>>(p, items, device, stream,
                                                                                            kName);
    if (lanes == GluLanes::kFour)
      return launch_warp_items<fp8_glu_quantize_kernel<T_, GluLanes::kFour, false, kSwiGLU>>(p, items, device, stream,
                                                                                             kName);
    if (lanes == GluLanes::kPartner)
      return launch_warp_items<fp8_glu_quantize_kernel<T_, GluLanes::kPartner, false, kSwiGLU>>(p, items, device,
                                                                                                stream, kName);
    launch_warp_items<fp8_glu_quantize_kernel<T_, GluLanes::kRuns, false, kSwiGLU>>(p, items, device, stream, kName);
  };
  detail::with_swiglu_constants(spec, [&](auto swiglu) {
    if (h.dtype() == DType::kFloat32) go(float{}, swiglu);
    else go(__nv_bfloat16{}, swiglu);
  });
  return true;
}

}  // namespace moe::cuda
