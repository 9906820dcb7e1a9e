// The expert MLP (docs/design.md section 4): y[r] = FC2(act(FC1(x[r]) + b1_g) * p[r]) + p[r] * b2_g,
// i.e. Megatron's p * (W2 act + b2), forward and backward.
//   x, y [T, H]; fc1 weight G x [W, H], bias G x [W], W = fc1_width(spec.glu, F): 2F for a GLU
//   (rows in spec.glu.layout), F for a non-gated activation (srelu, gelu_tanh);
//   fc2 weight G x [H, F], bias G x [H]; probs [T] float32 (undefined: p = 1).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "moe_engine/enum_names.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/grad_mode.hpp"
#include "moe_engine/glu.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_linear.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

namespace moe {

struct ExpertMlpWeights {
  GroupedParam fc1_weight;
  GroupedParam fc1_bias;  // optional
  GroupedParam fc2_weight;
  GroupedParam fc2_bias;  // optional; added as p[r] * b2_g
};

// Which steps run fused on CUDA (sm_90a, packed weights, a non-gated activation or the GLU layout
// pairs or blocks:s with s in 8..128 a power of two, and for the forward F a multiple of 8;
// elsewhere everything runs unfused). Results agree within rounding.
enum class MlpFusion {
  kNone,             // grouped GEMMs + activation kernels
  kForward,          // the activation (+ b1, probs) in FC1's epilogue; backward unfused
  kForwardBackward,  // also its backward + dprobs in FC2 dgrad's epilogue (slower today: see README)
};
template <>
struct EnumNames<MlpFusion> {
  static constexpr std::string_view kWhat = "MLP fusion";
  static constexpr EnumName<MlpFusion> kNames[] = {
      {MlpFusion::kNone, "none"},
      {MlpFusion::kForward, "forward"},
      {MlpFusion::kForwardBackward, "all"},
  };
};
inline const char* fusion_name(MlpFusion fusion) { return enum_name(fusion); }
inline MlpFusion parse_fusion(std::string_view name) { return parse_enum<MlpFusion>(name); }

struct ExpertMlpSpec {
  GluSpec glu;  // the activation (GLU or not) with its parameters and, for a GLU, FC1's row layout
  MlpFusion fusion = MlpFusion::kForward;
};

// Scratch the forward needs; save_fc1_out = whether the caller keeps the pre-activation. The spec's
// activation sets FC1's width (fc1_width).
MOE_API size_t expert_mlp_forward_workspace_size(int64_t capacity, int64_t hidden, int64_t ffn,
                                                 DType dtype, bool save_fc1_out, const ExpertMlpSpec& spec);

// fc1_out [T, W] (optional, W = fc1_width(spec.glu, F)): receives the pre-activation x W1^T + b1
// that backward can reuse; leave it undefined to keep only x (backward then recomputes FC1).
// `ran_fused` (optional) receives whether the activation step ran fused into FC1's epilogue: false
// on the CPU backend, with MlpFusion::kNone, or where the fused kernel does not take the problem
// (see MlpFusion).
MOE_API void expert_mlp_forward(const TensorView& x, const TensorView& probs,
                                const ExpertMlpWeights& weights, const GroupLayout& groups,
                                const TensorView& y, const TensorView& fc1_out,
                                const ExpertMlpSpec& spec, const ExecContext& ctx = {},
                                bool* ran_fused = nullptr);

struct ExpertMlpGrads {
  TensorView dx;      // [T, H], optional
  TensorView dprobs;  // [T] float32, optional (needs probs); includes <b2_g, dy[r]>
  ParamGrad fc1_weight, fc1_bias, fc2_weight, fc2_bias;
  // [T, W], optional: dL/d(fc1_out) written here instead of into the workspace, for a caller that
  // runs FC1's gradients itself (e.g. as a separate autograd node, so that FC2's weight gradient is
  // handed on before FC1's exists). Not with FP8.
  TensorView d_fc1;
  // [T, F], optional: FC2's input act(fc1_out) * p as the backward recomputes it, written here
  // (whether or not FC2's weight gradient is asked for), for a caller that runs FC2's weight
  // gradient later (a delayed wgrad). Not with FP8.
  TensorView act;
};

// Scratch the backward needs: F + W per row (W = fc1_width(spec.glu, F)), W more when FC1 is
// recomputed and the fusion is kForwardBackward, whose fused activation backward cannot run in
// place (and, with that fusion, float32 dprobs shares per 256 features). `d_fc1_given`: the
// caller passes ExpertMlpGrads::d_fc1, which the backward writes instead of a workspace buffer.
MOE_API size_t expert_mlp_backward_workspace_size(int64_t capacity, int64_t hidden, int64_t ffn,
                                                  DType dtype, bool recompute_fc1, const ExpertMlpSpec& spec,
                                                  bool d_fc1_given = false);

// fc1_out: the pre-activation saved by forward, or undefined to recompute it from x. x may be
// undefined when fc1_out is given and no FC1 weight gradient is asked for. `ran_fused`
// (optional) receives whether the activation's backward ran fused into FC2 dgrad's epilogue
// (MlpFusion::kForwardBackward where the fused kernel takes the problem).
MOE_API void expert_mlp_backward(const TensorView& dy, const TensorView& x, const TensorView& probs,
                                 const ExpertMlpWeights& weights, const GroupLayout& groups,
                                 const TensorView& fc1_out, const ExpertMlpGrads& grads,
                                 const ExpertMlpSpec& spec, const ExecContext& ctx = {},
                                 bool* ran_fused = nullptr);

}  // namespace moe
