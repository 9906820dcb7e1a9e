// The expert MLP with FP8 block-scaled GEMMs (docs/design.md, "FP8 expert MLP"): the same math and
// training contract as expert_mlp.hpp, y[r] = FC2(act(FC1(x[r]) + b1_g) * p[r]) + p[r] * b2_g, with
// all six GEMMs of a forward + backward in FP8 (moe_engine/fp8.hpp):
//   forward   x -> rows (FC1) and columns (kept for FC1's wgrad), one pass; FC1 -> h (x's dtype);
//             h -> FP8 rows (kept for backward); act = GLU(h) * p; act -> rows; FC2 -> y.
//   backward  dy -> rows (FC2 dgrad) and columns (FC2 wgrad); FC2 dgrad -> d_act; the kept h
//             dequantized; GLU backward -> d_fc1 (+ dprobs, and act recomputed for FC2's wgrad,
//             quantized by columns); d_fc1 -> rows (FC1 dgrad) and columns (FC1 wgrad).
// The weights arrive quantized (quantize_fp8_weight, both copies: forward reads data, dgrad
// data_t), so that a caller quantizes them once per optimizer step; the biases stay unquantized.
// What forward keeps is FP8: x's columns (H + H/32 bytes per row) and h's rows (W + W/32, W = 2F for a
// GLU, F for a non-gated activation), against the 16-bit path's x and h (2H + 2W). Activations are bfloat16 or float32 (the FP8 GEMMs write
// those). The forward GLU reads h before it is quantized, the backward's the dequantized h
// (DeepSeek-V3's recipe: the SwiGLU input cached in FP8).
#pragma once

#include <cstddef>
#include <cstdint>

#include "moe_engine/enum_names.hpp"
#include "moe_engine/expert_mlp.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/fp8.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

namespace moe {

struct ExpertMlpFp8Weights {
  Fp8Weight fc1;              // G x [W, H] (W = fc1_width(spec.glu, F); a GLU's rows in its layout) and its transpose
  Fp8Weight fc2;              // G x [H, F] and its transpose
  GroupedParam fc1_bias;      // optional, G x [W], unquantized
  GroupedParam fc2_bias;      // optional, G x [H]; added as p[r] * b2_g
};

// What forward keeps for backward, in caller-owned memory (sizes: expert_mlp_fp8_saved_shapes).
// For the FC1 weight gradient x is kept in one of two forms: its columns (what the wgrad reads), or
// its rows (FC1's own operand, which forward writes anyway), from which backward makes the columns
// (dequantized, then quantized by columns: a second rounding of x, within FP8's error). The columns
// pad every expert to a multiple of 128 tokens: with many experts of few tokens each they are
// several times the rows' bytes (expert_mlp_fp8_keeps_x_rows says which to keep).
struct ExpertMlpFp8Saved {
  Fp8Columns x;     // x's columns [H, C], or undefined
  Fp8Rows fc1_out;  // the pre-activation x W1^T + b1, rows [T, W]: always needed by backward
  Fp8Rows x_rows;   // x's rows [T, H] instead of its columns, or undefined (at most one of the two)
};

// True where x's columns would take more than twice the bytes of its rows, fp8_columns_capacity(T, G)
// > 2 T: forward should keep the rows (the extra pass it costs backward is small next to the bytes
// it saves there; elsewhere the columns save the pass).
MOE_API bool expert_mlp_fp8_keeps_x_rows(int64_t capacity, int64_t num_groups);

// The shapes of ExpertMlpFp8Saved's tensors for capacity T, G experts (all from static shapes; the
// spec's activation sets W = fc1_width(spec.glu, F)).
struct ExpertMlpFp8SavedShapes {
  Shape x_data, x_scales, x_offsets;   // [H, C] e4m3, [C/128, H] float32, [G + 1] int64
  Shape fc1_out_data, fc1_out_scales;  // [T, W] e4m3, [ceil(W/128), fp8_scales_pitch(T)] float32
  Shape x_rows_data, x_rows_scales;    // [T, H] e4m3, [ceil(H/128), fp8_scales_pitch(T)] float32
};
MOE_API ExpertMlpFp8SavedShapes expert_mlp_fp8_saved_shapes(int64_t capacity, int64_t num_groups, int64_t hidden,
                                                            int64_t ffn, const ExpertMlpSpec& spec);

// Scratch of the forward: x's rows, h, act and act's rows.
MOE_API size_t expert_mlp_fp8_forward_workspace_size(int64_t capacity, int64_t hidden, int64_t ffn, DType dtype,
                                                     const ExpertMlpSpec& spec);

// Which way the FP8 backward went between FC2's dgrad and the weight gradients (expert_mlp_backward's
// `ran`, optional): the conditions of each are in expert_mlp_forward's comment below.
enum class Fp8GluBackwardPath : int {
  kSeparate = 0,  // h dequantized, the GLU backward, the quantizers: each its own op
  kRows = 1,      // h's dequantization and the GLU backward in one pass, the quantizers after it
  kOnePass = 2,   // h's dequantization, the GLU backward and the quantization of dL/dh and act in one pass
};
template <>
struct EnumNames<Fp8GluBackwardPath> {
  static constexpr std::string_view kWhat = "FP8 GLU backward path";
  static constexpr EnumName<Fp8GluBackwardPath> kNames[] = {
      {Fp8GluBackwardPath::kSeparate, "separate"},
      {Fp8GluBackwardPath::kRows, "rows"},
      {Fp8GluBackwardPath::kOnePass, "one-pass"},
  };
};

// x [T, H], y [T, H] (bfloat16 or float32, alike); probs [T] float32 or undefined (p = 1).
// saved.fc1_out is written when defined (leave it undefined for a forward without backward), and
// saved.x or saved.x_rows when its data is defined. spec.fusion: kNone runs every step as its own op;
// kForward and kForwardBackward alike (on CUDA) h's and act's quantization and the GLU as one pass
// between the GEMMs, and in backward h's dequantization, the GLU backward and the quantization of
// dL/dh and act as one pass (bfloat16, both weight gradients and no FC1 bias gradient asked for,
// not where expert_mlp_fp8_keeps_x_rows(T, G)), else h's dequantization with the GLU backward. The
// same bytes, but dprobs (summed in another order). Those passes take GLUs only: a non-gated
// activation (srelu, gelu_tanh) runs its steps unfused. `ran_fused` (optional) receives whether
// forward's pass ran (false on the CPU backend, with MlpFusion::kNone, or where the pass does not
// take the layout, dtype or alignment).
MOE_API void expert_mlp_forward(const TensorView& x, const TensorView& probs, const ExpertMlpFp8Weights& weights,
                                const GroupLayout& groups, const TensorView& y, const ExpertMlpFp8Saved& saved,
                                const ExpertMlpSpec& spec, const Fp8Recipe& recipe = {},
                                const ExecContext& ctx = {}, bool* ran_fused = nullptr);

// Scratch of the backward (G: the routing's expert count; the columnwise copies are sized by it).
// x_rows: forward kept x's rows (backward then also makes x's columns).
MOE_API size_t expert_mlp_fp8_backward_workspace_size(int64_t capacity, int64_t num_groups, int64_t hidden,
                                                      int64_t ffn, DType dtype, const ExpertMlpSpec& spec,
                                                      bool x_rows = false);

// dy [T, H] in x's dtype; saved: forward's (saved.x or saved.x_rows required when the FC1 weight
// gradient is asked for; the workspace sized with x_rows accordingly). Gradients as in expert_mlp_backward (ParamGrad modes, dprobs including <b2_g, dy[r]>).
// `ran` (optional) receives the way backward went around the GLU (Fp8GluBackwardPath).
MOE_API void expert_mlp_backward(const TensorView& dy, const ExpertMlpFp8Saved& saved, const TensorView& probs,
                                 const ExpertMlpFp8Weights& weights, const GroupLayout& groups,
                                 const ExpertMlpGrads& grads, const ExpertMlpSpec& spec,
                                 const Fp8Recipe& recipe = {}, const ExecContext& ctx = {},
                                 Fp8GluBackwardPath* ran = nullptr);

}  // namespace moe
