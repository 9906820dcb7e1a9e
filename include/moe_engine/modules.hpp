// Training modules (DESIGN.md section 4). The ops compute; a module owns its parameters and
// carries the training contract around them, as TransformerEngine's GroupedLinear and Megatron's
// expert MLP do:
//  - parameters in the packed [G, ...] or per-expert layout (bit-identical results);
//  - forward keeps only what backward needs (the input only when the weight wants a gradient);
//  - the weight gradient goes where the options say (returned, queued for backward_dw, or
//    accumulated into the parameter's float32 main_grad) and backward reports what it hands back
//    per the six-row table of DESIGN.md section 4, with Megatron's parameter attributes
//    (main_grad, grad_added_to_main_grad) so the PyTorch layer maps it 1:1;
//  - state_dict / load_state_dict with the checkpoint key normalization.
// The caller keeps the routing (GroupLayout's splits and offsets) alive until backward has run.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moe_engine/checkpoint.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_linear.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

namespace moe {

// One grouped parameter (a weight G x [N, K] or a bias G x [N]) and the attributes a training
// framework hangs on it. The module owns the values; main_grad is caller-owned memory.
class MOE_API Parameter {
 public:
  Parameter(int64_t groups, const Shape& expert_shape, DType dtype, Device device, ExpertLayout layout);

  const GroupedParam& value() const { return value_.view(); }
  const GroupedTensor& storage() const { return value_; }
  ExpertLayout layout() const { return value_.layout(); }
  int64_t num_groups() const { return value().num_groups(); }
  const Shape& expert_shape() const { return value().expert_shape(); }
  DType dtype() const { return value().dtype(); }
  Device device() const { return value().device(); }

  bool requires_grad = true;
  // Megatron's param.grad_added_to_main_grad: absent (nullopt) unless the framework added it.
  std::optional<bool> grad_added_to_main_grad;

  // The float32 gradient buffer (Megatron's param.main_grad): G x expert_shape on the
  // parameter's device, each expert contiguous, packed or per-expert independently of the
  // values' layout. Anything else is a clear error (kShape, kDType, kDevice).
  void set_main_grad(const GroupedParam& main_grad);
  const GroupedParam& main_grad() const { return main_grad_; }

  // .grad: where backward_dw leaves a delayed weight gradient when there is no main_grad:
  // float32, in the parameter's layout, the sum of the queued gradients since zero_grad().
  const GroupedTensor& grad() const { return grad_; }
  void zero_grad() { grad_ = GroupedTensor(); }

 private:
  friend class GroupedLinear;
  GroupedTensor value_;
  GroupedParam main_grad_;
  GroupedTensor grad_;
};

// What backward hands back for one parameter (DESIGN.md section 4).
enum class GradKind {
  kNone,   // nothing: the gradient went to main_grad, or was queued for backward_dw
  kGrad,   // the gradient itself (in `grad`)
  kDummy,  // the module's shared dummy (in `grad`; zeros when zero_out_wgrad), so that
           // data-parallel hooks fire; main_grad already holds (or will hold) the gradient
};
MOE_API const char* grad_kind_name(GradKind kind);

struct ParamGradResult {
  GradKind kind = GradKind::kNone;
  GroupedTensor grad;  // defined for kGrad and kDummy
};

struct GroupedLinearOptions {
  ExpertLayout layout = ExpertLayout::kPacked;
  DType dtype = DType::kBFloat16;
  Device device = Device::cpu();
  bool bias = false;
  bool scale_bias = false;  // the bias is added as p[r] * b_g; forward takes the row scales p
  bool accumulate_into_main_grad = false;  // the wgrad GEMM adds into each weight's main_grad
  bool overwrite_main_grad = false;        // ... or overwrites it (Megatron-FSDP)
  bool delay_wgrad_compute = false;        // backward queues the wgrad; backward_dw runs it
  bool zero_out_wgrad = false;             // the dummy gradient is zeroed when handed out
  uint64_t seed = 0;                       // initialization (uniform, +-1/sqrt(in_features))
};

// What a forward saved for its backward. Holds references (shared tensor storage), not copies.
class MOE_API LinearContext {
 public:
  bool saves_input() const { return x_.defined(); }  // only when the weight wants a gradient
  bool computes_dgrad() const { return input_requires_grad_; }

 private:
  friend class GroupedLinear;
  Tensor x_;            // kept when the weight needs a gradient
  Tensor row_scale_;    // scale_bias: the row scales (for dbias and dscales)
  GroupLayout groups_;
  bool input_requires_grad_ = false;
  bool live_ = false;   // backward may run once
};

struct LinearForwardResult {
  Tensor y;
  LinearContext ctx;
};

struct LinearBackwardResult {
  Tensor dx;       // [T, in] when the input wanted a gradient
  Tensor dscales;  // [T] float32, with scale_bias: the gradient of the row scales, <dy[r], b_g>
  ParamGradResult weight, bias;  // the bias gradient is always computed here (never delayed)
};

class MOE_API GroupedLinear {
 public:
  GroupedLinear(int64_t groups, int64_t in_features, int64_t out_features,
                const GroupedLinearOptions& options = {});

  int64_t num_groups() const { return groups_; }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  const GroupedLinearOptions& options() const { return options_; }
  Parameter& weight() { return weight_; }
  const Parameter& weight() const { return weight_; }
  Parameter& bias();  // kInvalidArgument without a bias
  bool has_bias() const { return bias_.has_value(); }

  // y [T, out] = x [T, in] W_g^T (+ b_g, or + p[r] b_g with scale_bias: row_scale [T] float32).
  LinearForwardResult forward(const Tensor& x, const GroupLayout& groups, const Tensor& row_scale = {},
                              bool input_requires_grad = true, const ExecContext& exec = {});
  // dy [T, out]. Throws if ctx was already used.
  LinearBackwardResult backward(LinearContext& ctx, const Tensor& dy, const ExecContext& exec = {});

  // Runs the queued weight gradients in order, then fires the hooks once. Nothing queued: no-op.
  void backward_dw(const ExecContext& exec = {});
  size_t queued_wgrads() const { return queue_.size(); }
  void register_wgrad_hook(std::function<void()> hook) { hooks_.push_back(std::move(hook)); }

  // Keys PREFIX + "weight" ([G, out, in]) or "weight0".."weight{G-1}" ([out, in]), same for
  // "bias", in the module's layout. The tensors share the parameters' storage.
  std::map<std::string, Tensor> state_dict(const std::string& prefix = "") const;
  // Normalizes the keys to the module's layout (normalize_grouped_keys), then copies every
  // parameter in; missing, unexpected or mis-shaped keys are errors (kInvalidArgument).
  void load_state_dict(std::map<std::string, Tensor> state, const std::string& prefix = "");

 private:
  struct WgradJob {
    Tensor dy, x;
    GroupLayout groups;
  };
  void run_wgrad(const WgradJob& job, const ExecContext& exec);
  ParamGradResult main_grad_outcome(bool delayed, const ExecContext& exec);
  GroupedTensor weight_like(DType dtype) const;  // zeros shaped and laid out like the weight

  int64_t groups_, in_, out_;
  GroupedLinearOptions options_;
  Parameter weight_;
  std::optional<Parameter> bias_;
  GroupedTensor dummy_;  // the shared dummy weight gradient (weight dtype), made on first use
  std::deque<WgradJob> queue_;
  std::vector<std::function<void()>> hooks_;
};

// Checkpoint key normalization for one grouped parameter `key` (PREFIX + name) of G experts,
// towards `layout` (DESIGN.md section 4): packed + all G indexed keys present and the packed key
// absent -> stack them; per-expert + the packed key present and no indexed key -> split it
// ([G, ...] along dim 0, or [G*N, ...] into G equal chunks; any other shape: kInvalidArgument);
// every other mix is left alone. CPU tensors only.
MOE_API void normalize_grouped_keys(std::map<std::string, Tensor>& state, const std::string& key,
                                    int64_t groups, ExpertLayout layout);

}  // namespace moe
