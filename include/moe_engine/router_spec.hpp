// The router vocabulary shared by every layer that handles the MoE router (docs/design.md section
// 13): the score function, the spec of one routing, and the tensors the router ops write and read.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "moe_engine/enum_names.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/grad_mode.hpp"
#include "moe_engine/tensor.hpp"

namespace moe {

// How a token's logits over the E experts become scores.
enum class RouterScore {
  kSoftmax,  // softmax over the E logits (Switch, Mixtral, Qwen)
  kSigmoid,  // sigmoid of each logit on its own (DeepSeek-V3)
};
template <>
struct EnumNames<RouterScore> {
  static constexpr std::string_view kWhat = "router score function";
  static constexpr EnumName<RouterScore> kNames[] = {
      {RouterScore::kSoftmax, "softmax"},
      {RouterScore::kSigmoid, "sigmoid"},
  };
};
inline const char* router_score_name(RouterScore score) { return enum_name(score); }
inline RouterScore parse_router_score(std::string_view name) {
  return parse_enum<RouterScore>(name);
}

// One routing of T tokens over E experts (docs/design.md section 13). Group-limited routing is on
// when num_groups > 1: the experts form num_groups groups of E / num_groups consecutive experts and
// a token picks its top-k among the experts of its best topk_groups groups.
struct RouterSpec {
  RouterScore score = RouterScore::kSoftmax;
  int64_t topk = 2;            // k: experts per token, 1 <= k <= topk_groups * E / num_groups
  int64_t num_groups = 1;      // expert groups (1: no group-limited routing); divides E
  int64_t topk_groups = 1;     // groups kept per token, 1 <= topk_groups <= num_groups
  bool norm_topk_prob = true;  // divide the k probabilities by their sum (+ 1e-20)
  float scaling_factor =
      1.f;  // multiplies the k probabilities (DeepSeek-V3's routed_scaling_factor)
  float aux_loss_coeff = 0.f;  // the load-balancing loss's coefficient
  float z_loss_coeff = 0.f;    // the z-loss's coefficient

  bool group_limited() const { return num_groups > 1; }
};
// "sigmoid, topk=8, groups=8/4, norm, scaling=2.5, aux=0.001, z=0.0001" (defaults left out).
MOE_API std::string describe(const RouterSpec& spec);

// Throws kInvalidArgument, the message starting with `who`, where `spec` cannot route over E =
// num_experts experts: topk or the groups out of range, num_groups not dividing E, fewer experts in
// the kept groups than topk, coefficients or the scaling factor not finite (coefficients < 0).
MOE_API void check_router_spec(const RouterSpec& spec, int64_t num_experts, std::string_view who);

// What router_forward writes. "acc" is float32, or float64 for float64 inputs (CPU backend).
struct RouterOutputs {
  TensorView logits;           // [T, E] acc, required: x W^T; router_backward reads it
  TensorView indices;          // [T, k] int32 or int64, required: the chosen experts, best first
  TensorView probs;            // [T, k] acc, required: their probabilities
  TensorView counts;           // [E] int64, required: tokens routed to each expert
  TensorView aux_loss;         // [] acc, optional: the load-balancing loss (with aux_loss_counts)
  TensorView aux_loss_counts;  // [E] int64, with aux_loss: the loss's own top-k counts; backward
                               // reads them
  TensorView z_loss;           // [] acc, optional: the z-loss
  TensorView counts_total;     // [E] int64, optional: counts is added into it (+=), so it sums the
                               // routings of several calls (an expert-bias update's counts)
  TensorView total_loss;       // [] acc, optional: aux_loss + z_loss, those of the two requested
                               // (0 with neither), added in that order
};

// The gradients router_backward receives for router_forward's outputs; undefined ones are zero.
struct RouterOutputGrads {
  TensorView d_probs;     // [T, k] acc
  TensorView d_aux_loss;  // [] acc (needs aux_loss_counts)
  TensorView d_z_loss;    // [] acc
};

// What router_backward writes; at least one is required.
struct RouterGrads {
  TensorView dx;       // [T, H], x's dtype
  TensorView dweight;  // [E, H]: any float dtype with kWrite, float32 main_grad otherwise
  GradMode dweight_mode = GradMode::kWrite;
  // dx += dL/dlogits W instead of dx = ...: per element dx's value plus the product's float32 sum,
  // rounded once to dx's dtype (the MoE layer adds the router's part into the experts' dx); on
  // Hopper's grouped GEMM (bfloat16) the sum is rounded to bfloat16 first, then added and rounded.
  bool accumulate_dx = false;
};

}  // namespace moe
