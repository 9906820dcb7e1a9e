// Training modules (docs/design.md section 6). The ops compute; a module owns its parameters and
// carries the training contract around them, as TransformerEngine's GroupedLinear and Megatron's
// expert MLP do:
//  - parameters in the packed [G, ...] or per-expert layout (bit-identical results);
//  - forward keeps only what backward needs (the input only when the weight wants a gradient);
//  - the weight gradient goes where the options say (returned, queued for backward_dw, or
//    accumulated into the parameter's float32 main_grad) and backward reports what it hands back
//    per the six-row table of docs/design.md section 6, with Megatron's parameter attributes
//    (main_grad, grad_added_to_main_grad) so the PyTorch layer maps it 1:1;
//  - state_dict / load_state_dict with the checkpoint key normalization;
//  - optionally FP8 block scaling (options.fp8): the master weights stay in the module's dtype, their
//    FP8 copies are cached across micro-batches until invalidate_fp8_weights() (the optimizer step).
// The decisions of the contract and of the key normalization are pure functions (grad_outcome,
// plan_grouped_keys): these modules and the PyTorch modules (through moe_engine._C) apply the same
// ones, each to its own parameters and tensors.
// The caller keeps the routing (GroupLayout's splits and offsets) alive until backward has run.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moe_engine/checkpoint.hpp"
#include "moe_engine/expert_mlp.hpp"
#include "moe_engine/expert_mlp_fp8.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/fp8.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_linear.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/offload.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

namespace moe {

namespace detail {
class WeightGradContract;

// Which module a forward context belongs to: a fresh number for every module made or copied (a copy
// is another module), kept by a move. Backward refuses a context another module's forward made.
MOE_API uint64_t next_module_id();
struct ModuleId {
  uint64_t value = next_module_id();
  ModuleId() = default;
  ModuleId(const ModuleId&) : value(next_module_id()) {}
  ModuleId& operator=(const ModuleId&) {
    value = next_module_id();
    return *this;
  }
  ModuleId(ModuleId&&) = default;
  ModuleId& operator=(ModuleId&&) = default;
};
}  // namespace detail

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
  friend class detail::WeightGradContract;
  GroupedTensor value_;
  GroupedParam main_grad_;
  GroupedTensor grad_;
};

// What backward hands back for one parameter (docs/design.md section 6).
enum class GradKind {
  kNone,   // nothing: the gradient went to main_grad, or was queued for backward_dw
  kGrad,   // the gradient itself (in `grad`)
  kDummy,  // the module's shared dummy (in `grad`; zeros when zero_out_wgrad), so that
           // data-parallel hooks fire; main_grad already holds (or will hold) the gradient
};
MOE_API const char* grad_kind_name(GradKind kind);  // "none", "grad", "dummy"

// ---- the gradient contract as a decision ----

// What decides the fate of one weight gradient: the module's options and what the framework hung
// on the parameter (Megatron-LM's attributes).
struct GradContractCase {
  bool accumulate_into_main_grad = false;  // the module option
  bool overwrite_main_grad = false;        // the module option or the parameter's attribute
  bool zero_out_wgrad = false;             // the module option or the parameter's attribute
  bool delay_wgrad_compute = false;        // the module option
  bool has_grad_added_to_main_grad = false;  // the parameter carries grad_added_to_main_grad
};

// Where the wgrad GEMM writes.
enum class GradTarget {
  kFresh,     // a new tensor in the weight's dtype and layout, which backward hands back
  kMainGrad,  // the parameter's float32 main_grad (accumulate or overwrite)
  kGrad,      // the parameter's .grad: the first gradient since it was cleared is written, the
              // next ones are added (delayed gradients without main_grad)
};
MOE_API const char* grad_target_name(GradTarget target);  // "fresh", "main_grad", "grad"

// When grad_added_to_main_grad becomes true.
enum class FlagUpdate {
  kNever,       // the parameter has no flag, or the gradient does not go to main_grad
  kBackward,    // in backward, when the GEMM adds into main_grad
  kBackwardDw,  // in backward_dw, when the queued GEMM has run
};
MOE_API const char* flag_update_name(FlagUpdate update);  // "never", "backward", "backward_dw"

struct GradOutcome {
  bool deferred = false;  // the GEMM is queued for backward_dw instead of running in backward
  GradTarget target = GradTarget::kFresh;
  GradMode mode = GradMode::kWrite;  // the GEMM's mode into the target (kGrad: kAccumulate, see there)
  GradKind handed_back = GradKind::kGrad;  // what backward hands autograd for the parameter
  bool zero_dummy = false;  // kDummy: the dummy is zeroed each time it is handed back
  FlagUpdate flag = FlagUpdate::kNever;
};

// The six-row table of docs/design.md section 6 (plain; delayed; main_grad without and with
// grad_added_to_main_grad; delayed + main_grad without and with it), with overwrite_main_grad and
// zero_out_wgrad. Overwrite and zero_out matter only for gradients into main_grad.
MOE_API GradOutcome grad_outcome(const GradContractCase& c);

struct ParamGradResult {
  GradKind kind = GradKind::kNone;
  GroupedTensor grad;  // defined for kGrad and kDummy
};

namespace detail {

// One weight's side of the gradient contract, shared by the modules: where its gradient goes
// (a fresh tensor, main_grad, or the float32 .grad for delayed gradients without main_grad) and
// what backward hands back for it.
class MOE_API WeightGradContract {
 public:
  WeightGradContract(bool into_main_grad, bool overwrite_main_grad, bool zero_out_wgrad)
      : into_main_grad_(into_main_grad), overwrite_(overwrite_main_grad), zero_out_(zero_out_wgrad) {}

  // kInvalidArgument (naming `who`) when the gradient goes to main_grad and there is none.
  void check_main_grad(const Parameter& w, const char* who) const;
  // A gradient computed now (grad_outcome without delay): its target, and what backward hands
  // back in `result`. The caller has run check_main_grad (before consuming anything).
  ParamGrad immediate(Parameter& w, ParamGradResult& result, const ExecContext& exec);
  // A gradient queued for backward_dw: what backward hands back now (nothing, or the dummy).
  ParamGradResult queued(const Parameter& w, const ExecContext& exec);
  // backward_dw: the target of one queued gradient, and ran() once it has run.
  ParamGrad delayed_target(Parameter& w) const;
  void ran(Parameter& w) const;

 private:
  GradOutcome outcome(const Parameter& w, bool delayed) const;
  ParamGradResult handed_back(const Parameter& w, const GradOutcome& o, const ExecContext& exec);
  ParamGrad target(Parameter& w, const GradOutcome& o, const ParamGradResult& result) const;

  bool into_main_grad_, overwrite_, zero_out_;
  GroupedTensor dummy_;  // the shared dummy gradient (weight dtype), made on first use
};

}  // namespace detail

// ---- FP8 block scaling in the modules ----

// What a module runs in FP8 (docs/api.md, "Modules"): the quantizers' recipe, and which GEMMs read
// FP8 operands. A GEMM left out runs in the module's dtype (TransformerEngine's
// override_linear_precision, inverted). GroupedMLP with all three runs the FP8 expert MLP op; with
// some left out, its two layers run as GroupedLinear's around the activation op (unfused).
struct Fp8ModuleRecipe {
  Fp8Recipe quantizer{};  // for every tensor the module quantizes: weights, activations, gradients
  bool forward = true;    // y = x W^T over x's FP8 rows and the weight's FP8 copy
  bool dgrad = true;      // dx = dy W over dy's FP8 rows and the weight's transposed FP8 copy
  bool wgrad = true;      // dW = dy^T x over the FP8 columns of dy and x
};

namespace detail {

// FP8 rows of a [T, K] tensor in owned memory (moe_engine/fp8.hpp's layout).
struct MOE_API Fp8RowsBuffers {
  Tensor data, scales;
  // Stream-ordered on `stream` (Tensor::empty_async): [T, K] float8_e4m3, [ceil(K/128), pitch(T)] float32.
  static Fp8RowsBuffers empty(int64_t capacity, int64_t features, Device device, Stream stream);
  bool defined() const { return data.defined(); }
  Fp8Rows view() const { return {data, scales}; }
  int64_t nbytes() const;
};

// FP8 columns of a [T, K] tensor routed to G experts, in owned memory.
struct MOE_API Fp8ColumnsBuffers {
  Tensor data, scales, offsets;
  // Stream-ordered on `stream`: [K, C] float8_e4m3, [C/128, K] float32, [G + 1] int64.
  static Fp8ColumnsBuffers empty(int64_t capacity, int64_t groups, int64_t features, Device device, Stream stream);
  bool defined() const { return data.defined(); }
  Fp8Columns view() const { return {data, scales, offsets}; }
  int64_t nbytes() const;
};

// The FP8 copies of one weight (128 x 128 blocks: data for forward, the transpose for dgrad), in
// device memory of the weight's device allocated once. They are quantized from the master weight on
// first use and reused until invalidate(), or until the Parameter's storage is another one (the
// parameter was replaced). Writes into the master weight's values are not seen: whoever writes
// them (the optimizer step) invalidates. Inside a CUDA graph capture the quantization is always
// recorded (every replay quantizes the weights as they are then).
class MOE_API Fp8WeightCache {
 public:
  Fp8WeightCache() = default;
  // Copies for forward (data, scales) and / or dgrad (data_t, scales_t) of `weight`'s shape.
  Fp8WeightCache(const Parameter& weight, bool forward_copy, bool dgrad_copy);

  // The copies, quantized first (on exec's stream) unless fresh for `weight`'s storage.
  const Fp8Weight& get(const Parameter& weight, const Fp8Recipe& recipe, const ExecContext& exec);
  void invalidate() { fresh_ = false; }
  uint64_t quantizations() const { return quantizations_; }

 private:
  bool fresh_for(const Parameter& weight) const;
  Tensor data_, scales_, data_t_, scales_t_;
  Fp8Weight view_;
  // The storage last quantized, held so that a replacement cannot be allocated at its address.
  GroupedTensor source_;
  bool fresh_ = false;
  uint64_t quantizations_ = 0;
};

// A weight gradient's operands, kept for a delayed one: dy and x in the module's dtype, or their
// FP8 columns (an FP8 wgrad).
struct LinearWgradOperands {
  Tensor dy, x;
  Fp8ColumnsBuffers dy_columns, x_columns;
  GroupLayout groups;
};

}  // namespace detail

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
  bool offload_activations = true;         // false: ActivationOffload leaves this module's tensors on the device
  uint64_t seed = 0;                       // initialization (uniform, +-1/sqrt(in_features))
  // FP8 block scaling of the GEMMs the recipe names (bfloat16 or float32 modules, in_features and
  // out_features multiples of 16). The weight stays a master Parameter in `dtype`; its FP8 copies
  // are cached until invalidate_fp8_weights().
  std::optional<Fp8ModuleRecipe> fp8;
};

// What a forward saved for its backward. Holds references (shared tensor storage), not copies.
class MOE_API LinearContext {
 public:
  // x (or, with an FP8 wgrad, only x's FP8 columns) is kept when the weight wants a gradient.
  bool saves_input() const { return x_.defined() || x_columns_.defined(); }
  bool computes_dgrad() const { return input_requires_grad_; }
  bool offloaded() const { return offload_.away; }   // its tensors are in host memory (ActivationOffload)
  // Bytes of the tensors held for backward: x [T, in] in the input dtype, or x's FP8 columns
  // (in * C + 4 * in * C/128 + 8 * (G + 1) bytes, C = fp8_columns_capacity(T, G)); the row scales
  // [T] float32.
  int64_t saved_bytes() const;
  // x's FP8 columns, kept for an FP8 weight gradient (undefined views otherwise).
  Fp8Columns saved_x_columns() const { return x_columns_.view(); }

 private:
  friend class GroupedLinear;
  friend struct ActivationOffload::Impl;
  std::array<Tensor*, 5> saved_tensors() {
    return {&x_, &row_scale_, &x_columns_.data, &x_columns_.scales, &x_columns_.offsets};
  }
  Tensor x_;            // kept when the weight needs a gradient in the module's dtype
  detail::Fp8ColumnsBuffers x_columns_;  // ... or in FP8 (fp8 with wgrad)
  Tensor row_scale_;    // scale_bias: the row scales (for dbias and dscales)
  GroupLayout groups_;
  bool input_requires_grad_ = false;
  bool live_ = false;   // backward may run once
  uint64_t owner_ = 0;  // the module whose forward made it (detail::ModuleId)
  bool offloadable_ = true;
  detail::OffloadTicket offload_;
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
  // Also invalidates the FP8 weight cache.
  void load_state_dict(std::map<std::string, Tensor> state, const std::string& prefix = "");

  // FP8: marks the cached FP8 copies of the weight stale, so that the next FP8 GEMM quantizes the
  // weight again. Call it after every change of the weight's values (the optimizer step, a write
  // through state_dict()'s tensors); load_state_dict and replacing the Parameter need no call.
  // Without fp8: nothing to do.
  void invalidate_fp8_weights() { weight_cache_.invalidate(); }
  // How many times the weight's quantization has been enqueued, captures included (0 without fp8).
  uint64_t fp8_weight_quantizations() const { return weight_cache_.quantizations(); }

 private:
  int64_t groups_, in_, out_;
  GroupedLinearOptions options_;
  detail::ModuleId id_;
  Parameter weight_;
  std::optional<Parameter> bias_;
  detail::WeightGradContract weight_grad_;
  detail::Fp8WeightCache weight_cache_;  // fp8 only
  std::deque<detail::LinearWgradOperands> queue_;
  std::vector<std::function<void()>> hooks_;
};

struct GroupedMLPOptions {
  ExpertLayout layout = ExpertLayout::kPacked;
  DType dtype = DType::kBFloat16;
  Device device = Device::cpu();
  bool bias = false;  // fc1 bias [W] and fc2 bias [H]; the fc2 bias is added as p[r] * b2 (Megatron)
  // The activation with its parameters and, for a GLU, the column layout of the FC1 weight's rows.
  // FC1 has W = fc1_width(glu, ffn) rows: 2F for a GLU (swiglu, clamped_qgeglu), F for a non-gated
  // activation (srelu, gelu_tanh).
  GluSpec glu{};
  bool recompute_fc1 = false;  // forward keeps x only (not the [T, W] pre-activation); backward recomputes it
  bool accumulate_into_main_grad = false;  // the wgrad GEMMs add into each weight's main_grad
  bool overwrite_main_grad = false;        // ... or overwrite it (Megatron-FSDP)
  bool delay_wgrad_compute = false;        // backward queues the weight gradients; backward_dw runs them
  bool zero_out_wgrad = false;             // the dummy gradients are zeroed when handed out
  bool offload_activations = true;         // false: ActivationOffload leaves this module's tensors on the device
  uint64_t seed = 0;                       // initialization (uniform, +-1/sqrt(fan-in))
  // All six GEMMs in FP8 (the FP8 expert MLP, moe_engine/expert_mlp_fp8.hpp): bfloat16 or float32
  // modules, hidden and ffn multiples of 16, no recompute_fc1 (the pre-activation is kept in FP8);
  // the recipe must leave no GEMM out. Both weights stay master Parameters in `dtype`; their FP8
  // copies are cached until invalidate_fp8_weights(). x is kept for the FC1 weight gradient as the
  // op's rule says (expert_mlp_fp8_keeps_x_rows(T, G)): its FP8 rows where its columns would take
  // more than twice their bytes (many experts of few tokens each), else its columns.
  std::optional<Fp8ModuleRecipe> fp8;
};

// What a GroupedMLP forward saved for its backward (references to shared storage, not copies).
class MOE_API MlpContext {
 public:
  bool saves_input() const { return x_.defined() || x_columns_.defined() || x_rows_.defined(); }
  bool saves_fc1_out() const { return fc1_out_.defined() || fc1_out_rows_.defined(); }
  // fp8 with some GEMM left unquantized: FC2's input (the activation's output) is kept for FC2's
  // weight gradient, as act or its FP8 columns.
  bool saves_act() const { return act_.defined() || act_columns_.defined(); }
  bool computes_dgrad() const { return input_requires_grad_; }
  // Bytes of the tensors held on the device for backward (x, the pre-activation, probs): [T, H] + [T, W] in the
  // input dtype + [T] float32 when all are kept. x is the caller's tensor, referenced, not copied. With fp8: x's
  // FP8 columns or rows and the pre-activation's FP8 rows (expert_mlp_fp8_saved_shapes) + the probs; with some
  // GEMM left unquantized, what the two layers keep (x and act, or their FP8 columns where the wgrads run in
  // FP8) + the pre-activation [T, W] in the input dtype + the probs.
  int64_t saved_bytes() const;
  bool offloaded() const { return offload_.away; }  // its tensors are in host memory (ActivationOffload)
  // fp8: what the FP8 MLP op keeps (when the FC1 weight wants a gradient x's columns, or its rows
  // where expert_mlp_fp8_keeps_x_rows(T, G); the pre-activation's rows); undefined views without fp8.
  ExpertMlpFp8Saved fp8_saved() const { return {x_columns_.view(), fc1_out_rows_.view(), x_rows_.view()}; }

 private:
  friend class GroupedMLP;
  friend struct ActivationOffload::Impl;
  std::array<Tensor*, 14> saved_tensors() {
    return {&x_,
            &fc1_out_,
            &probs_,
            &x_columns_.data,
            &x_columns_.scales,
            &x_columns_.offsets,
            &fc1_out_rows_.data,
            &fc1_out_rows_.scales,
            &x_rows_.data,
            &x_rows_.scales,
            &act_,
            &act_columns_.data,
            &act_columns_.scales,
            &act_columns_.offsets};
  }
  Tensor x_, fc1_out_, probs_;
  detail::Fp8ColumnsBuffers x_columns_;  // fp8: in place of x ...
  detail::Fp8RowsBuffers fc1_out_rows_;  // fp8: in place of the pre-activation
  detail::Fp8RowsBuffers x_rows_;        // ... or x's rows instead (expert_mlp_fp8_keeps_x_rows)
  Tensor act_;                           // fp8, some GEMM unquantized: FC2's input ...
  detail::Fp8ColumnsBuffers act_columns_;  // ... or its FP8 columns (FC2's wgrad in FP8)
  GroupLayout groups_;
  bool input_requires_grad_ = false;
  bool live_ = false;  // backward may run once
  uint64_t owner_ = 0;  // the module whose forward made it (detail::ModuleId)
  bool offloadable_ = true;
  detail::OffloadTicket offload_;
};

struct MlpForwardResult {
  Tensor y;
  MlpContext ctx;
};

struct MlpBackwardResult {
  Tensor dx;      // [T, H] when the input wanted a gradient
  Tensor dprobs;  // [T] in the probs' dtype (float32; float64 on the CPU) when forward had probs
  ParamGradResult fc1_weight, fc1_bias, fc2_weight, fc2_bias;  // bias gradients: never delayed
};

// The expert MLP of docs/design.md section 4 with the training contract of GroupedLinear for both
// weights: y = FC2(act(FC1(x) + b1) * p) + p * b2.
class MOE_API GroupedMLP {
 public:
  GroupedMLP(int64_t groups, int64_t hidden, int64_t ffn, const GroupedMLPOptions& options = {});

  int64_t num_groups() const { return groups_; }
  int64_t hidden() const { return hidden_; }
  int64_t ffn() const { return ffn_; }
  const GroupedMLPOptions& options() const { return options_; }
  Parameter& fc1_weight() { return fc1_weight_; }  // G x [W, H] (a GLU's rows in options().glu.layout)
  Parameter& fc2_weight() { return fc2_weight_; }  // G x [H, F]
  Parameter& fc1_bias();                          // G x [W]; kInvalidArgument without biases
  Parameter& fc2_bias();                          // G x [H]
  bool has_bias() const { return fc1_bias_.has_value(); }

  // x [T, H] -> y [T, H]; probs [T] float32 (undefined: 1). What is kept: the pre-activation (unless
  // recompute_fc1) when anything needs a gradient; x when the FC1 weight needs one, or to recompute.
  MlpForwardResult forward(const Tensor& x, const GroupLayout& groups, const Tensor& probs = {},
                           bool input_requires_grad = true, const ExecContext& exec = {});
  // dy [T, H]. Throws if ctx was already used.
  MlpBackwardResult backward(MlpContext& ctx, const Tensor& dy, const ExecContext& exec = {});

  // Runs the queued weight gradients in order (each recomputes the FC2 dgrad and the GLU backward
  // rather than keeping their [T, 3F] outputs alive; with fp8 from dy and the FP8 tensors forward
  // kept), then fires the hooks once. Nothing queued: no-op.
  void backward_dw(const ExecContext& exec = {});
  size_t queued_wgrads() const { return queue_.size(); }
  void register_wgrad_hook(std::function<void()> hook) { hooks_.push_back(std::move(hook)); }

  // Keys PREFIX + "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias" (packed), or with the expert
  // index appended (per-expert), in the module's layout; FC1 rows in the module's GLU layout.
  std::map<std::string, Tensor> state_dict(const std::string& prefix = "") const;
  // As GroupedLinear's, and FC1 rows (weight and bias) are converted from `glu_from` (default: the
  // module's own GLU layout) to the module's; a module with a non-gated activation takes no glu_from.
  // Also invalidates the FP8 weight cache.
  void load_state_dict(std::map<std::string, Tensor> state, const std::string& prefix = "",
                       std::optional<GluLayout> glu_from = std::nullopt);

  // FP8: marks the cached FP8 copies of both weights stale (see GroupedLinear::invalidate_fp8_weights:
  // call it after the optimizer step).
  void invalidate_fp8_weights() {
    fc1_cache_.invalidate();
    fc2_cache_.invalidate();
  }
  // How many weight quantizations have been enqueued, both weights counted (0 without fp8).
  uint64_t fp8_weight_quantizations() const { return fc1_cache_.quantizations() + fc2_cache_.quantizations(); }

 private:
  // What backward reads of a forward: x / the pre-activation, or their FP8 copies (fp8).
  struct Saved {
    Tensor x, probs, fc1_out;
    detail::Fp8ColumnsBuffers x_columns;
    detail::Fp8RowsBuffers fc1_out_rows;
    detail::Fp8RowsBuffers x_rows;  // in place of x_columns where forward kept x's rows
  };
  struct WgradJob {
    Tensor dy;
    Saved saved;
    GroupLayout groups;
    bool fc1, fc2;  // which weight gradients it computes
    // bf16/fp16: what backward wrote out for the job, dL/d(fc1_out) (with fc1) and FC2's input act
    // (with fc2); the job then runs the wgrad GEMMs alone and `saved` keeps only x. FP8: undefined,
    // the job runs the backward op again from `saved`.
    Tensor d_fc1, act;
    // fp8 with some GEMM unquantized (linears()): each layer's wgrad operands; dy and saved unused.
    detail::LinearWgradOperands fc1_operands, fc2_operands;
  };
  ExpertMlpWeights weights() const;
  ExpertMlpSpec spec() const { return {options_.glu}; }
  ExpertMlpFp8Weights fp8_weights(const ExecContext& exec);
  void run_backward(const Tensor& dy, const Saved& saved, const GroupLayout& groups, const ExpertMlpGrads& grads,
                    const ExecContext& exec);
  // fp8 leaving some GEMM unquantized: the two layers as GroupedLinear runs them, around the
  // activation op.
  bool linears() const {
    return options_.fp8 && !(options_.fp8->forward && options_.fp8->dgrad && options_.fp8->wgrad);
  }
  void forward_linears(const Tensor& x, const GroupLayout& groups, const Tensor& probs, bool keep_fc1_out,
                       MlpForwardResult& r, const ExecContext& exec);
  void backward_linears(MlpContext& ctx, const Tensor& dy, ExpertMlpGrads& g, MlpBackwardResult& r,
                        const ExecContext& exec);

  int64_t groups_, hidden_, ffn_;
  GroupedMLPOptions options_;
  detail::ModuleId id_;
  Parameter fc1_weight_, fc2_weight_;
  std::optional<Parameter> fc1_bias_, fc2_bias_;
  detail::WeightGradContract fc1_grad_, fc2_grad_;
  detail::Fp8WeightCache fc1_cache_, fc2_cache_;  // fp8 only
  std::deque<WgradJob> queue_;
  std::vector<std::function<void()>> hooks_;
};

// ---- checkpoint key normalization ----

// A checkpoint tensor as the key normalization sees it: its shape and its dtype's name.
struct CheckpointEntry {
  Shape shape;
  std::string dtype;
};

// What the normalization does with one grouped parameter's keys, decided from the keys present and
// their shapes (docs/design.md section 9; Megatron's _normalize_grouped_parameter_keys). These
// modules and the PyTorch modules apply it, each to its own tensors.
struct GroupedKeyPlan {
  enum class Action {
    kKeep,     // leave the keys as they are (already in the layout, or a mix that is left alone)
    kStack,    // key0..key{G-1} -> key of `shape` [G, expert...]
    kSplit,    // key -> key0..key{G-1}, each of `shape` (from [G, ...] along dim 0, or [G*N, ...] in G chunks)
    kReshape,  // key [G*N, ...] (TransformerEngine's single grouped parameter) -> key of `shape` [G, N, ...]
  };
  Action action = Action::kKeep;
  Shape shape;
  // A packed layout whose checkpoint has key0.. for some experts but not all (and no key): the
  // absent keys, for the loader to report (it would otherwise report only the packed key missing).
  std::vector<std::string> missing;
  // Not empty when the keys cannot be normalized (a tensor that does not split into G experts,
  // experts of different shapes or dtypes); the loader raises it (the action is then kKeep).
  std::string error;
};
MOE_API const char* grouped_key_action_name(GroupedKeyPlan::Action action);  // "keep", "stack", "split", "reshape"

// The plan for one grouped parameter `key` (PREFIX + name) of `groups` experts towards `layout`,
// from `entries` (the checkpoint's keys; only key and key0..key{G-1} are read):
//  - packed, key absent, all G indexed keys present: stack (the experts must agree in shape and dtype);
//  - packed, key present of shape [G*N, ...] where `expert_shape` (the module's [N, ...], when given)
//    asks for [G, N, ...]: reshape;
//  - per-expert, key present and no indexed key: split [G, ...] or [G*N, ...] (anything else: error);
//  - every other mix: keep (with `missing` named for a packed layout given some experts only).
MOE_API GroupedKeyPlan plan_grouped_keys(const std::map<std::string, CheckpointEntry>& entries,
                                         const std::string& key, int64_t groups, ExpertLayout layout,
                                         const Shape& expert_shape = {});

// Applies plan_grouped_keys (without an expert shape) to a state dict of CPU tensors: stacks or
// splits into new tensors; an error of the plan is kShape. Reshapes are left to the loader.
MOE_API void normalize_grouped_keys(std::map<std::string, Tensor>& state, const std::string& key,
                                    int64_t groups, ExpertLayout layout);

}  // namespace moe
