// The MoE layer (docs/design.md section 15): the router, the routing plan, permute, the expert MLP
// (GroupedMLP) and unpermute as one training module, forward and backward. Everything that depends
// on the routing stays on the device: no host sync, fixed launch shapes, so a whole forward +
// backward can be captured in a CUDA graph; bad routings go to the layer's device error flag.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moe_engine/communicator.hpp"
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
  // Expert parallelism (docs/design.md section 16): the layer is rank r of the communicator's P
  // ranks and holds experts r E/P .. (r + 1) E/P - 1 (experts() has E/P groups; E % P == 0); the
  // router stays whole and each rank routes its own tokens. The exchange is dropless: the per-expert
  // counts go through an all-to-all and are read on the host (a host sync each forward, so not
  // capturable), then the rows. Every rank calls forward and backward in the same order with the same
  // input_requires_grad. Null: no expert parallelism.
  std::shared_ptr<Communicator> expert_parallel;
  // With expert_parallel: the fixed-capacity exchange instead of the dropless one. Each (source,
  // destination) pair has C = pair_capacity(T, k, P, factor) rows; a source sends each destination
  // its first C assignments in token order and drops the rest (they add nothing to y and get zero
  // gradients; MoELayerForwardResult::dropped counts them per destination). The exchanges have
  // static sizes and nothing is read on the host: a step can be captured in a CUDA graph. Every
  // rank passes the same T.
  std::optional<double> expert_parallel_capacity_factor;
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
  // Expert parallelism: rows sent to / received from each rank, and the received rows' plan by
  // local expert (row_local [N, 1] int32, its splits and offsets; the experts' group layout).
  bool expert_parallel_ = false;
  std::vector<int64_t> send_rows_, recv_rows_;
  Tensor row_local_, splits_local_, offsets_local_;
  GroupLayout groups_local_;
  Tensor offsets_experts_;  // fixed capacity: the local experts' offsets (the plan has one group more)
  bool input_requires_grad_ = false;
  bool router_backward_ = false;  // the router weight or x wants a gradient
  bool live_ = false;
  uint64_t owner_ = 0;  // the layer whose forward made it (detail::ModuleId)
};

struct MoELayerForwardResult {
  Tensor y;     // [T, H]
  Tensor loss;  // [] float32 (float64 for a float64 layer): aux_loss + z_loss of the router
  Tensor counts;  // [E] int64: the router's choices per expert (before capacity drops)
  Tensor splits;  // [E] int64: the assignments each expert computed (after drops); with expert
                  // parallelism: this rank's assignments each expert of the layer got (with the
                  // fixed-capacity exchange: [P] int64, the send buffer's C rows per rank)
  Tensor local_splits;  // expert parallelism: [E/P] int64, the rows each local expert computed
  Tensor dropped;  // [E] int64 with a capacity factor: the assignments each expert dropped; with the
                   // fixed-capacity exchange [P] int64: the assignments not sent to each rank
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

  int64_t num_experts() const { return num_experts_; }  // E, the router's
  // The experts this layer holds: [first_local_expert(), + local_experts()) (all E without expert
  // parallelism).
  int64_t local_experts() const { return experts_.num_groups(); }
  int64_t first_local_expert() const { return ep_rank_ * local_experts(); }
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
  // Expert parallelism: the experts on the rows of every rank (x_sorted, probs_sorted: this rank's
  // [R, H] / [R] in expert order) and their outputs back in this rank's expert order.
  // With ids_send ([P C, 1] int32, the fixed-capacity send plan's local expert ids) the exchange
  // has equal sizes and the ids travel with the rows; without, it is dropless.
  Tensor exchange_forward(MoELayerContext& c, const Tensor& x_sorted, const Tensor& probs_sorted,
                          const Tensor& ids_send, bool input_requires_grad, const ExecContext& exec);
  // Its backward: dy_sorted [R, H] in this rank's expert order -> the experts' backward where they
  // are, and dx [R, H] (with an input gradient) and dprobs [R] back in this rank's expert order.
  MlpBackwardResult exchange_backward(MoELayerContext& c, const Tensor& dy_sorted, const ExecContext& exec);

  MoELayerOptions options_;
  detail::ModuleId id_;
  int64_t num_experts_ = 0;
  int ep_rank_ = 0, ep_size_ = 1;
  GroupedMLP experts_;
  Parameter router_weight_;
  detail::WeightGradContract router_grad_;
  Tensor expert_bias_;        // [E] acc, with options.expert_bias
  Tensor tokens_per_expert_;  // [E] int64
  DeviceErrorFlag errors_;
};

}  // namespace moe
