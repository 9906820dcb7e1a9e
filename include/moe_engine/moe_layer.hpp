// The MoE layer (docs/design.md section 15): the router, the routing plan, permute, the expert MLP
// (GroupedMLP) and unpermute as one training module, forward and backward. Everything that depends
// on the routing stays on the device: no host sync, fixed launch shapes, so a whole forward +
// backward can be captured in a CUDA graph; bad routings go to the layer's device error flag.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "moe_engine/export.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/modules.hpp"
#include "moe_engine/permute.hpp"
#include "moe_engine/router.hpp"
#include "moe_engine/router_spec.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

namespace moe {

struct MoELayerOptions {
  RouterSpec router;                      // score function, k, groups, normalization, loss coefficients
  std::optional<double> capacity_factor;  // per-expert capacity (Megatron's, position drop policy)
  bool expert_bias = false;  // a bias [E] on the scores for the choice only (DeepSeek-V3's balancing)
  // The experts: dtype, device, expert layout, activation, biases, recompute, FP8, the gradient
  // contract. The router weight takes the same dtype and device, and the same main_grad options
  // (accumulate_into_main_grad, overwrite_main_grad, zero_out_wgrad); its gradient is never delayed.
  GroupedMLPOptions experts;
};

// What a MoELayer forward kept for its backward (references to shared storage, not copies).
class MOE_API MoELayerContext {
 public:
  bool computes_dgrad() const { return input_requires_grad_; }
  // Bytes held on the device for backward: the router's (x, referenced; logits [T, E] in the router's
  // float type; indices [T, k] int32; the loss's counts [E]), the routing (row_of [T, k] int32, splits,
  // offsets) and the experts' context (MlpContext::saved_bytes: x sorted, the pre-activation, probs).
  int64_t saved_bytes() const;
  const MlpContext& experts() const { return experts_; }

 private:
  friend class MoELayer;
  Tensor x_, logits_, indices_, aux_counts_;
  Tensor row_of_, splits_, offsets_;
  GroupLayout groups_;
  MlpContext experts_;
  bool input_requires_grad_ = false;
  bool router_backward_ = false;  // the router weight or x wants a gradient
  bool live_ = false;
};

struct MoELayerForwardResult {
  Tensor y;     // [T, H]
  Tensor loss;  // [] float32 (float64 for a float64 layer): aux_loss + z_loss of the router
  Tensor counts;  // [E] int64: the router's choices per expert (before capacity drops)
  Tensor splits;  // [E] int64: the assignments each expert computed (after drops)
  Tensor dropped;  // [E] int64 with a capacity factor: the assignments each expert dropped
  MoELayerContext ctx;
};

struct MoELayerBackwardResult {
  Tensor dx;  // [T, H] when the input wanted a gradient
  // What backward hands back per parameter (docs/design.md section 6).
  ParamGradResult router_weight;
  ParamGradResult fc1_weight, fc1_bias, fc2_weight, fc2_bias;
};

class MOE_API MoELayer {
 public:
  // E = num_experts experts of hidden -> ffn -> hidden; options.router is checked against E.
  MoELayer(int64_t num_experts, int64_t hidden, int64_t ffn, const MoELayerOptions& options = {});

  int64_t num_experts() const { return experts_.num_groups(); }
  int64_t hidden() const { return experts_.hidden(); }
  int64_t ffn() const { return experts_.ffn(); }
  const MoELayerOptions& options() const { return options_; }
  // The router weight: 1 x [E, H] (one group; its main_grad is 1 x [E, H] float32).
  Parameter& router_weight() { return router_weight_; }
  const Parameter& router_weight() const { return router_weight_; }
  GroupedMLP& experts() { return experts_; }
  const GroupedMLP& experts() const { return experts_; }
  // [E] float32 (float64 for a float64 layer), zeros at first; kInvalidArgument without expert_bias.
  const Tensor& expert_bias() const;
  // [E] int64 on the device: the router's choices per expert summed over the forwards since the
  // last update_expert_bias (every forward adds, an evaluation's too).
  const Tensor& tokens_per_expert() const { return tokens_per_expert_; }

  // x [T, H] in the layer's dtype and device. Also adds the routing's counts into
  // tokens_per_expert(). Keeps for backward what the input and the parameters that want a gradient
  // need (MoELayerContext::saved_bytes).
  MoELayerForwardResult forward(const Tensor& x, bool input_requires_grad = true, const ExecContext& exec = {});
  // dy [T, H]; d_loss the gradient of forward's loss: a 0-dim tensor in its dtype on the device
  // (graph replays read its value then), undefined for none. Throws if ctx was already used.
  MoELayerBackwardResult backward(MoELayerContext& ctx, const Tensor& dy, const Tensor& d_loss = {},
                                  const ExecContext& exec = {});
  // The same with d_loss given on the host (within a CUDA graph, the value at capture).
  MoELayerBackwardResult backward(MoELayerContext& ctx, const Tensor& dy, double d_loss,
                                  const ExecContext& exec = {});

  // The experts' delayed weight gradients (GroupedMLP::backward_dw) and hooks; the router weight's
  // gradient is computed in backward.
  void backward_dw(const ExecContext& exec = {}) { experts_.backward_dw(exec); }
  void register_wgrad_hook(std::function<void()> hook) { experts_.register_wgrad_hook(std::move(hook)); }

  // expert_bias[e] += rate * sign(mean - tokens_per_expert[e]) on the device (no host sync), then
  // tokens_per_expert = 0. kInvalidArgument without expert_bias.
  void update_expert_bias(float rate, const ExecContext& exec = {});

  // What the device kernels reported about the routing (indices or rows out of range, bad splits):
  // DeviceErrorFlag::check, outside graph capture.
  DeviceErrorFlag& errors() { return errors_; }
  void check_errors(Stream stream = nullptr) { errors_.check(stream); }

  // Keys PREFIX + "router.weight" [E, H], "router.expert_bias" [E] (with expert_bias) and the
  // experts' under PREFIX + "experts." (GroupedMLP::state_dict). The tensors share the layer's storage.
  std::map<std::string, Tensor> state_dict(const std::string& prefix = "") const;
  // Copies every key in (the experts' through GroupedMLP::load_state_dict with glu_from); missing,
  // unexpected, mis-shaped or wrong-dtype keys are errors.
  void load_state_dict(std::map<std::string, Tensor> state, const std::string& prefix = "",
                       std::optional<GluLayout> glu_from = std::nullopt);

 private:
  TensorView router_weight_view() const;
  DType acc_dtype() const;

  MoELayerOptions options_;
  GroupedMLP experts_;
  Parameter router_weight_;
  detail::WeightGradContract router_grad_;
  Tensor expert_bias_;        // [E] acc, with options.expert_bias
  Tensor tokens_per_expert_;  // [E] int64
  DeviceErrorFlag errors_;
};

}  // namespace moe
