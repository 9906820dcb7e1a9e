// FP8 block scaling (docs/design.md section 12): E4M3 operands with FP32 scales per tile, DeepSeek-V3's
// recipe (TransformerEngine's Float8BlockScaling), and the grouped GEMMs over them.
//
// Quantization of one tile of values v (bf16/fp16/fp32 in, as float), TransformerEngine's and
// DeepGEMM's rule: one multiplication per value.
//   amax = max |v| over the tile (its elements inside the tensor), then amax = max(amax, epsilon);
//   m    = 448 / amax (fp32, round to nearest), at most 2^126 (so that s is never a denormal:
//          448 / amax overflows for tiny amaxes); with pow2_scales rounded down to a power of two;
//   s    = 1 / m (fp32, round to nearest): the stored scale, what the GEMMs multiply by;
//   q    = E4M3(v * m), round to nearest even, saturated to +-448.
//   An all-zero tile (amax 0, epsilon 0) has m = s = 1. A tile holding an infinity or a NaN gets
//   s = NaN and every q = E4M3 NaN (0x7f): its values dequantize (q * s) to NaN, and every GEMM
//   output that reads the tile is NaN.
// The CPU and CUDA quantizers give bit-identical data and scales.
//
// Layouts (T = the routing's capacity, G experts, K the quantized axis' length):
//   rows    (1 x 128 tiles along K; activations and output gradients for forward and dgrad):
//           data [T, K] E4M3 (row stride >= K, a multiple of 16), scales "M-major" [ceil(K/128), S]
//           fp32 with S >= T a multiple of 4 (scale of row r, K block b at scales[b][r]).
//   columns (128 x 1 tiles along the tokens of each expert, restarting at each expert's first
//           token; the wgrad operands, stored transposed so that the tokens are contiguous):
//           data [K, C] E4M3, C = fp8_columns_capacity(T, G); expert g's tokens occupy columns
//           offsets[g] .. offsets[g] + rows_g, offsets[g] = sum over h < g of round_up(rows_h, 128)
//           (written to `offsets` [G + 1] int64 by the quantizer), the columns up to the next
//           multiple of 128 are zero; scales [C / 128, K] fp32 (128-column block j, feature k).
//   weight  (128 x 128 blocks): data [G, N, K] E4M3, scales [G, ceil(N/128), ceil(K/128)] fp32, and
//           the transposed copy dgrad reads: data_t [G, K, N], scales_t [G, ceil(K/128), ceil(N/128)].
// Rows past offsets[G] of the routing (and columns past the last expert) are never written.
#pragma once

#include <cstdint>

#include "moe_engine/bias_epilogue.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/grad_mode.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

namespace moe {

constexpr int64_t kFp8Block = 128;       // tile length along the quantized axis
constexpr float kFp8E4M3Max = 448.f;     // largest finite E4M3 value

struct Fp8Recipe {
  bool pow2_scales = false;  // multipliers rounded down to powers of two, scales exact powers of two
                             // (TransformerEngine's power_2_scale)
  float amax_epsilon = 0.f;  // lower bound of every tile's amax (>= 0)
};

// An activation or output gradient quantized along its features (forward / dgrad operand).
struct Fp8Rows {
  TensorView data;    // [T, K] float8_e4m3
  TensorView scales;  // [ceil(K/128), S] float32, S >= T, S % 4 == 0
};

// The same tensor quantized along the tokens of each expert, transposed (wgrad operand).
struct Fp8Columns {
  TensorView data;     // [K, C] float8_e4m3, C = fp8_columns_capacity(T, G)
  TensorView scales;   // [C / 128, K] float32
  TensorView offsets;  // [G + 1] int64: each expert's first column (multiples of 128)
};

// A weight G x [N, K] in 128 x 128 blocks, and its transpose for dgrad.
struct Fp8Weight {
  TensorView data;      // [G, N, K] float8_e4m3
  TensorView scales;    // [G, ceil(N/128), ceil(K/128)] float32
  TensorView data_t;    // [G, K, N] float8_e4m3 (dgrad)
  TensorView scales_t;  // [G, ceil(K/128), ceil(N/128)] float32
};

// Sizes from static shapes only (graph safe): the columns of a columnwise copy for capacity T and
// G experts, and the smallest row pitch of rowwise scales.
MOE_API int64_t fp8_columns_capacity(int64_t capacity, int64_t num_groups);
MOE_API int64_t fp8_scales_pitch(int64_t capacity);

// x [T, K] (bf16, fp16 or fp32) -> rows and/or columns (each written where its data is defined),
// in one pass over x. Only rows < offsets[G] are read and written.
MOE_API void quantize_fp8(const TensorView& x, const GroupLayout& groups, const Fp8Rows& rows,
                          const Fp8Columns& columns, const Fp8Recipe& recipe = {}, const ExecContext& ctx = {});

// rows (E4M3 data [T, K] + 1 x 128 scales, as quantize_fp8 writes them) -> out [T, K] (bf16, fp16
// or fp32): out[r][k] = float(q[r][k]) * scales[k / 128][r], rounded to out's dtype (round to
// nearest even). Only rows < offsets[G] of the routing are read and written (rows past them
// untouched). A NaN is written as the canonical NaN (0x7fff, 0x7fffffff): the CPU and CUDA bytes
// are the same.
MOE_API void dequantize_fp8(const Fp8Rows& rows, const GroupLayout& groups, const TensorView& out,
                            const ExecContext& ctx = {});

// weight G x [N, K] (bf16, fp16 or fp32; packed or per expert) -> out.data/scales and/or
// out.data_t/scales_t (each pair written where its data is defined).
MOE_API void quantize_fp8_weight(const GroupedParam& weight, const Fp8Weight& out, const Fp8Recipe& recipe = {},
                                 const ExecContext& ctx = {});

// The grouped GEMMs over FP8 operands, scales applied at every 128 of the contraction:
//   forward y[r] = x[r] W_g^T (+ bias epilogue), x rows of K, weight data/scales;  y bf16 or fp32;
//   dgrad   dx[r] = dy[r] W_g,                  dy rows of N, weight data_t/scales_t; dx bf16 or fp32;
//   wgrad   dW_g = dy_g^T x_g over the expert's tokens, columns of both; dweight per `mode`.
MOE_API void grouped_linear_forward(const Fp8Rows& x, const Fp8Weight& weight, const GroupLayout& groups,
                                    const TensorView& y, const BiasEpilogue& bias = {}, const ExecContext& ctx = {});
MOE_API void grouped_linear_dgrad(const Fp8Rows& dy, const Fp8Weight& weight, const GroupLayout& groups,
                                  const TensorView& dx, const ExecContext& ctx = {});
MOE_API void grouped_linear_wgrad(const Fp8Columns& dy, const Fp8Columns& x, const GroupLayout& groups,
                                  const GroupedParam& dweight, GradMode mode, const ExecContext& ctx = {});

}  // namespace moe
