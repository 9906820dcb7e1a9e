// GroupedMLP: the expert MLP op with GroupedLinear's training contract for both weights, delayed
// weight gradients, checkpoints with GLU layout conversion; with fp8 the FP8 expert MLP op over
// cached FP8 copies of the weights, or, where the recipe leaves a GEMM unquantized, the two layers
// as GroupedLinear runs them around the activation op. FC1's width is fc1_width(options.glu, ffn):
// 2F for a GLU, F for a non-gated activation.
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <utility>

#include "io/glu_rows.hpp"
#include "modules/linear_steps.hpp"
#include "modules/parameter_io.hpp"
#include "moe_engine/glu.hpp"
#include "moe_engine/modules.hpp"

namespace moe {

int64_t MlpContext::saved_bytes() const {
  int64_t bytes = x_columns_.nbytes() + x_rows_.nbytes() + fc1_out_rows_.nbytes() + act_columns_.nbytes();
  for (const Tensor* t : {&x_, &fc1_out_, &probs_, &act_})
    if (t->defined()) bytes += int64_t(t->nbytes());
  return bytes;
}

namespace {

// The ops' scratch, allocated per call on `device` (a module has no persistent workspace yet).
struct Scratch {
  Tensor bytes;
  ExecContext exec;
  Scratch(size_t size, Device device, const ExecContext& outer)
      : bytes(Tensor::empty_async({int64_t(size > 0 ? size : 1)}, DType::kUInt8, device, outer.stream)),
        exec{outer.stream, {bytes.data(), bytes.nbytes(), device}} {}
};

}  // namespace

namespace {
// The sizes and dtype checked before any member is built from them (the parameters' tensors would
// otherwise fail first, naming an internal function).
const GroupedMLPOptions& checked_mlp_args(int64_t groups, int64_t hidden, int64_t ffn, const GroupedMLPOptions& o) {
  MOE_CHECK(groups >= 1 && hidden >= 1 && ffn >= 1, ErrorCode::kInvalidArgument,
            "GroupedMLP: expected G, hidden, ffn >= 1, got ", groups, ", ", hidden, ", ", ffn);
  MOE_CHECK(is_floating(o.dtype), ErrorCode::kDType,
            "GroupedMLP: GroupedMLPOptions::dtype: expected float32, bfloat16, float16 or float64, got ",
            dtype_name(o.dtype));
  return o;
}
}  // namespace

GroupedMLP::GroupedMLP(int64_t groups, int64_t hidden, int64_t ffn, const GroupedMLPOptions& o)
    : groups_(groups),
      hidden_(hidden),
      ffn_(ffn),
      options_(checked_mlp_args(groups, hidden, ffn, o)),
      fc1_weight_(groups, {fc1_width(o.glu, ffn), hidden}, o.dtype, o.device, o.layout),
      fc2_weight_(groups, {hidden, ffn}, o.dtype, o.device, o.layout),
      fc1_grad_(o.accumulate_into_main_grad, o.overwrite_main_grad, o.zero_out_wgrad),
      fc2_grad_(o.accumulate_into_main_grad, o.overwrite_main_grad, o.zero_out_wgrad) {
  MOE_CHECK(!o.overwrite_main_grad || o.accumulate_into_main_grad, ErrorCode::kInvalidArgument,
            "GroupedMLP: overwrite_main_grad needs accumulate_into_main_grad = true");
  check_glu_spec(o.glu, ffn, "GroupedMLP");
  if (o.fp8) {
    const Fp8ModuleRecipe& fp8 = *o.fp8;
    detail::check_fp8_module_options(fp8, o.dtype, "GroupedMLP", "hidden", hidden, "ffn", ffn);
    MOE_CHECK(!o.recompute_fc1, ErrorCode::kInvalidArgument,
              "GroupedMLP: options.fp8 keeps the pre-activation for backward (in FP8 when all GEMMs run in FP8); "
              "expected recompute_fc1 = false, got true");
    fc1_cache_ = detail::Fp8WeightCache(fc1_weight_, fp8.forward, fp8.dgrad);
    fc2_cache_ = detail::Fp8WeightCache(fc2_weight_, fp8.forward, fp8.dgrad);
  }
  const float bound1 = 1.0f / std::sqrt(float(hidden)), bound2 = 1.0f / std::sqrt(float(ffn));
  detail::init_uniform(fc1_weight_.storage(), o.seed, -bound1, bound1);
  detail::init_uniform(fc2_weight_.storage(), o.seed + 1, -bound2, bound2);
  if (o.bias) {
    fc1_bias_.emplace(groups, Shape{fc1_width(o.glu, ffn)}, o.dtype, o.device, o.layout);
    fc2_bias_.emplace(groups, Shape{hidden}, o.dtype, o.device, o.layout);
    detail::init_uniform(fc1_bias_->storage(), o.seed + 2, -bound1, bound1);
    detail::init_uniform(fc2_bias_->storage(), o.seed + 3, -bound2, bound2);
  }
}

Parameter& GroupedMLP::fc1_bias() {
  MOE_CHECK(fc1_bias_.has_value(), ErrorCode::kInvalidArgument, "GroupedMLP: the module has no biases");
  return *fc1_bias_;
}

Parameter& GroupedMLP::fc2_bias() {
  MOE_CHECK(fc2_bias_.has_value(), ErrorCode::kInvalidArgument, "GroupedMLP: the module has no biases");
  return *fc2_bias_;
}

ExpertMlpWeights GroupedMLP::weights() const {
  return {fc1_weight_.value(), fc1_bias_ ? fc1_bias_->value() : GroupedParam(), fc2_weight_.value(),
          fc2_bias_ ? fc2_bias_->value() : GroupedParam()};
}

ExpertMlpFp8Weights GroupedMLP::fp8_weights(const ExecContext& exec) {
  const Fp8Recipe& recipe = options_.fp8->quantizer;
  return {fc1_cache_.get(fc1_weight_, recipe, exec), fc2_cache_.get(fc2_weight_, recipe, exec),
          fc1_bias_ ? fc1_bias_->value() : GroupedParam(), fc2_bias_ ? fc2_bias_->value() : GroupedParam()};
}

MlpForwardResult GroupedMLP::forward(const Tensor& x, const GroupLayout& groups, const Tensor& probs,
                                     bool input_requires_grad, const ExecContext& exec) {
  MOE_CHECK(x.defined() && x.dim() == 2 && x.size(1) == hidden_, ErrorCode::kShape,
            "GroupedMLP.forward: expected x [T, ", hidden_, "], got ", x.view().describe());
  MOE_CHECK(groups.defined() && groups.num_groups() == groups_, ErrorCode::kInvalidArgument,
            "GroupedMLP.forward: expected a routing of ", groups_, " experts, got ", groups.num_groups());
  MOE_CHECK(x.dtype() == options_.dtype, ErrorCode::kDType, "GroupedMLP.forward: x is ",
            dtype_name(x.dtype()), " but the module's parameters are ", dtype_name(options_.dtype),
            " (GroupedMLPOptions::dtype); convert x or build the module with that dtype");
  const int64_t T = x.size(0);
  // What backward will need. Everything but the fc2 bias gradient goes through the activation's
  // backward, which needs the pre-activation (kept, or recomputed from x).
  const bool bias1 = fc1_bias_ && fc1_bias_->requires_grad, bias2 = fc2_bias_ && fc2_bias_->requires_grad;
  const bool through_act = input_requires_grad || probs.defined() || fc1_weight_.requires_grad ||
                           fc2_weight_.requires_grad || bias1;
  MlpForwardResult r;
  r.y = Tensor::zeros_async({T, hidden_}, options_.dtype, options_.device, exec.stream);
  MlpContext& c = r.ctx;
  if (linears()) {
    // The pre-activation for the activation's backward; FC2's weight gradient reads act instead.
    forward_linears(x, groups, probs, input_requires_grad || probs.defined() || fc1_weight_.requires_grad || bias1,
                    r, exec);
  } else if (options_.fp8) {
    // The op keeps FP8 only: the pre-activation's rows, and for the FC1 weight gradient x's columns,
    // or its rows where the columns would take more than twice their bytes (many experts of few
    // tokens: each expert's columns are padded to 128 tokens); backward then makes the columns.
    if (through_act)
      c.fc1_out_rows_ = detail::Fp8RowsBuffers::empty(T, fc1_width(options_.glu, ffn_), options_.device, exec.stream);
    if (fc1_weight_.requires_grad) {
      if (expert_mlp_fp8_keeps_x_rows(T, groups_))
        c.x_rows_ = detail::Fp8RowsBuffers::empty(T, hidden_, options_.device, exec.stream);
      else
        c.x_columns_ = detail::Fp8ColumnsBuffers::empty(T, groups_, hidden_, options_.device, exec.stream);
    }
    const Scratch scratch(expert_mlp_fp8_forward_workspace_size(T, hidden_, ffn_, options_.dtype, spec()),
                          options_.device, exec);
    expert_mlp_forward(x, probs, fp8_weights(exec), groups, r.y, c.fp8_saved(), spec(), options_.fp8->quantizer,
                       scratch.exec);
  } else {
    if (through_act && !options_.recompute_fc1)
      c.fc1_out_ = Tensor::zeros_async({T, fc1_width(options_.glu, ffn_)}, options_.dtype, options_.device, exec.stream);
    const Scratch scratch(
        expert_mlp_forward_workspace_size(T, hidden_, ffn_, options_.dtype, c.fc1_out_.defined(), spec()),
        options_.device, exec);
    expert_mlp_forward(x, probs, weights(), groups, r.y, c.fc1_out_, spec(), scratch.exec);
    if (fc1_weight_.requires_grad || (options_.recompute_fc1 && through_act)) c.x_ = x;
  }
  if (through_act || bias2) c.probs_ = probs;
  c.groups_ = groups;
  c.input_requires_grad_ = input_requires_grad;
  c.live_ = true;
  c.owner_ = id_.value;
  c.offloadable_ = options_.offload_activations;
  return r;
}

void GroupedMLP::forward_linears(const Tensor& x, const GroupLayout& groups, const Tensor& probs, bool keep_fc1_out,
                                 MlpForwardResult& r, const ExecContext& exec) {
  MOE_CHECK(!probs.defined() || probs.dtype() == DType::kFloat32, ErrorCode::kDType,
            "GroupedMLP.forward: options.fp8 leaving a GEMM unquantized scales FC2's bias by the probs, which must "
            "be float32, got ", dtype_name(probs.dtype()));
  const Fp8ModuleRecipe& fp8 = *options_.fp8;
  const int64_t T = x.size(0);
  MlpContext& c = r.ctx;
  const Tensor h =
      Tensor::zeros_async({T, fc1_width(options_.glu, ffn_)}, options_.dtype, options_.device, exec.stream);
  if (fc1_weight_.requires_grad && fp8.wgrad)
    c.x_columns_ = detail::Fp8ColumnsBuffers::empty(T, groups_, hidden_, options_.device, exec.stream);
  const BiasEpilogue b1{fc1_bias_ ? fc1_bias_->value() : GroupedParam(), {}};
  detail::linear_forward({fc1_weight_, fc1_cache_, fp8}, x, groups, b1, c.x_columns_, h, exec);
  if (fc1_weight_.requires_grad && !c.x_columns_.defined()) c.x_ = x;
  const Tensor act = Tensor::zeros_async({T, ffn_}, options_.dtype, options_.device, exec.stream);
  glu_forward(h, probs, groups, act, options_.glu, exec);
  if (fc2_weight_.requires_grad && fp8.wgrad)
    c.act_columns_ = detail::Fp8ColumnsBuffers::empty(T, groups_, ffn_, options_.device, exec.stream);
  // p * b2: FC2's bias scaled by the probs (GroupedLinear's scale_bias).
  const BiasEpilogue b2 = fc2_bias_ ? BiasEpilogue{fc2_bias_->value(), probs.view()} : BiasEpilogue{};
  detail::linear_forward({fc2_weight_, fc2_cache_, fp8}, act, groups, b2, c.act_columns_, r.y, exec);
  if (fc2_weight_.requires_grad && !c.act_columns_.defined()) c.act_ = act;
  if (keep_fc1_out) c.fc1_out_ = h;
}

void GroupedMLP::backward_linears(MlpContext& ctx, const Tensor& dy, ExpertMlpGrads& g, MlpBackwardResult& r,
                                  const ExecContext& exec) {
  const Fp8ModuleRecipe& fp8 = *options_.fp8;
  const GroupLayout& groups = ctx.groups_;
  const int64_t T = dy.size(0);
  const bool fc1 = fc1_weight_.requires_grad, fc2 = fc2_weight_.requires_grad;
  // dL/d(pre-activation), wanted by everything before the activation.
  const bool to_fc1_out = g.dx.defined() || g.dprobs.defined() || g.fc1_bias.grad.defined() || fc1;
  MOE_CHECK(!to_fc1_out || ctx.fc1_out_.defined(), ErrorCode::kInvalidArgument,
            "GroupedMLP.backward: gradients before the activation are wanted but forward kept no pre-activation "
            "(nothing wanted one when forward ran)");
  MOE_CHECK(!fc1 || ctx.saves_input(), ErrorCode::kInvalidArgument,
            "GroupedMLP.backward: the FC1 weight wants a gradient but forward kept no input (its requires_grad was "
            "false when forward ran)");
  MOE_CHECK(!fc2 || ctx.saves_act(), ErrorCode::kInvalidArgument,
            "GroupedMLP.backward: the FC2 weight wants a gradient but forward kept no activation (its "
            "requires_grad was false when forward ran)");
  // Each weight gradient runs (or is queued) as soon as its operands exist, and each block's
  // temporaries go at its end: the step's peak holds one layer's backward at a time.
  auto weight_gradient = [&](bool wanted, Parameter& w, detail::WeightGradContract& contract,
                             ParamGradResult& result, detail::LinearWgradOperands&& operands,
                             detail::LinearWgradOperands& queued) {
    if (!wanted) return;
    if (options_.delay_wgrad_compute)
      queued = std::move(operands);
    else
      detail::linear_wgrad(operands, contract.immediate(w, result, exec), exec);
  };
  WgradJob job{{}, {}, groups, fc1, fc2, {}, {}, {}, {}};
  Tensor dh;  // dL/d(pre-activation)
  {
    // FC2: dy's FP8 copies, d(act), p-scaled db2, its weight gradient.
    const detail::GradCopies dy8 = detail::quantize_gradient(dy, groups, groups_, to_fc1_out && fp8.dgrad,
                                                             fc2 && ctx.act_columns_.defined(), fp8.quantizer, exec);
    Tensor d_act;
    if (to_fc1_out) {
      d_act = Tensor::zeros_async({T, ffn_}, options_.dtype, options_.device, exec.stream);
      detail::linear_dgrad({fc2_weight_, fc2_cache_, fp8}, dy, dy8.rows, groups, d_act, exec);
    }
    if (g.fc2_bias.grad.defined())
      grouped_linear_dbias(dy, groups, g.fc2_bias.grad, GradMode::kWrite, ctx.probs_.view(), exec);
    weight_gradient(fc2, fc2_weight_, fc2_grad_, r.fc2_weight,
                    detail::wgrad_operands(dy, dy8, ctx.act_, ctx.act_columns_, groups), job.fc2_operands);
    // The activation: dL/dh and the probs' gradient through it, plus <dy, b2> through FC2's bias.
    if (to_fc1_out) {
      dh = Tensor::zeros_async({T, fc1_width(options_.glu, ffn_)}, options_.dtype, options_.device, exec.stream);
      glu_backward(ctx.fc1_out_, ctx.probs_, d_act, groups, {dh, g.dprobs, {}}, options_.glu, exec);
    }
    if (g.dprobs.defined() && fc2_bias_)
      grouped_linear_dscales(dy, fc2_bias_->value(), groups, g.dprobs, /*accumulate=*/true, exec);
  }
  {
    // FC1: dx, db1, its weight gradient.
    if (g.fc1_bias.grad.defined()) grouped_linear_dbias(dh, groups, g.fc1_bias.grad, GradMode::kWrite, {}, exec);
    const detail::GradCopies dh8 = detail::quantize_gradient(dh, groups, groups_, g.dx.defined() && fp8.dgrad,
                                                             fc1 && ctx.x_columns_.defined(), fp8.quantizer, exec);
    if (g.dx.defined()) detail::linear_dgrad({fc1_weight_, fc1_cache_, fp8}, dh, dh8.rows, groups, g.dx, exec);
    weight_gradient(fc1, fc1_weight_, fc1_grad_, r.fc1_weight,
                    detail::wgrad_operands(dh, dh8, ctx.x_, ctx.x_columns_, groups), job.fc1_operands);
  }
  if (options_.delay_wgrad_compute) {
    if (fc1 || fc2) queue_.push_back(std::move(job));
    if (fc1) r.fc1_weight = fc1_grad_.queued(fc1_weight_, exec);
    if (fc2) r.fc2_weight = fc2_grad_.queued(fc2_weight_, exec);
  }
}

void GroupedMLP::run_backward(const Tensor& dy, const Saved& saved, const GroupLayout& groups,
                              const ExpertMlpGrads& grads, const ExecContext& exec) {
  const int64_t T = dy.size(0);
  if (options_.fp8) {
    // With x's rows kept, the FC1 weight gradient needs room for the columns made from them.
    const bool x_rows = saved.x_rows.defined() && grads.fc1_weight.grad.defined();
    const Scratch scratch(
        expert_mlp_fp8_backward_workspace_size(T, groups_, hidden_, ffn_, options_.dtype, spec(), x_rows),
        options_.device, exec);
    expert_mlp_backward(dy, {saved.x_columns.view(), saved.fc1_out_rows.view(), saved.x_rows.view()}, saved.probs,
                        fp8_weights(exec), groups, grads, spec(), options_.fp8->quantizer, scratch.exec);
    return;
  }
  const Scratch scratch(expert_mlp_backward_workspace_size(T, hidden_, ffn_, options_.dtype, !saved.fc1_out.defined(),
                                                          spec(), grads.d_fc1.defined()),
                        options_.device, exec);
  expert_mlp_backward(dy, saved.x, saved.probs, weights(), groups, saved.fc1_out, grads, spec(), scratch.exec);
}

MlpBackwardResult GroupedMLP::backward(MlpContext& ctx, const Tensor& dy, const ExecContext& exec) {
  MOE_CHECK(ctx.live_, ErrorCode::kInvalidArgument,
            "GroupedMLP.backward: the context was already used (or comes from no forward)");
  MOE_CHECK(ctx.owner_ == id_.value, ErrorCode::kInvalidArgument,
            "GroupedMLP.backward: the context comes from another module's forward");
  MOE_CHECK(!ctx.offloaded(), ErrorCode::kInvalidArgument,
            "GroupedMLP.backward: the context's tensors are in host memory; ActivationOffload::restore it first");
  MOE_CHECK(dy.defined() && dy.dim() == 2 && dy.size(1) == hidden_ && dy.size(0) == ctx.groups_.capacity(),
            ErrorCode::kShape, "GroupedMLP.backward: expected dy [", ctx.groups_.capacity(), ", ", hidden_,
            "], got ", dy.view().describe());
  fc1_grad_.check_main_grad(fc1_weight_, "GroupedMLP.backward");
  fc2_grad_.check_main_grad(fc2_weight_, "GroupedMLP.backward");
  ctx.live_ = false;
  const int64_t T = dy.size(0);
  MlpBackwardResult r;
  ExpertMlpGrads g;
  if (ctx.input_requires_grad_)
    g.dx = r.dx = Tensor::zeros_async({T, hidden_}, options_.dtype, options_.device, exec.stream);
  if (ctx.probs_.defined())
    g.dprobs = r.dprobs = Tensor::zeros_async({T}, ctx.probs_.dtype(), options_.device, exec.stream);
  auto bias_grad = [&](std::optional<Parameter>& bias, ParamGradResult& result, ParamGrad& target) {
    if (!bias || !bias->requires_grad) return;
    result.kind = GradKind::kGrad;
    result.grad = GroupedTensor::zeros_async(groups_, bias->expert_shape(), options_.dtype, options_.device,
                                             bias->layout(), exec.stream);
    target = {result.grad.view(), GradMode::kWrite};
  };
  bias_grad(fc1_bias_, r.fc1_bias, g.fc1_bias);
  bias_grad(fc2_bias_, r.fc2_bias, g.fc2_bias);
  auto release = [&] {  // backward ran: the context's tensors go
    ctx.x_ = ctx.fc1_out_ = ctx.probs_ = ctx.act_ = Tensor();
    ctx.x_columns_ = {};
    ctx.fc1_out_rows_ = {};
    ctx.x_rows_ = {};
    ctx.act_columns_ = {};
  };
  if (linears()) {
    backward_linears(ctx, dy, g, r, exec);
    release();
    return r;
  }
  const bool fc1 = fc1_weight_.requires_grad, fc2 = fc2_weight_.requires_grad;
  const Saved saved{ctx.x_, ctx.probs_, ctx.fc1_out_, ctx.x_columns_, ctx.fc1_out_rows_, ctx.x_rows_};
  if (options_.delay_wgrad_compute) {
    if (fc1 || fc2) {
      WgradJob job{dy, saved, ctx.groups_, fc1, fc2, {}, {}, {}, {}};
      if (!options_.fp8) {
        // This backward writes out what the weight gradients read (dL/d(fc1_out), FC2's input), so
        // the job runs the two wgrad GEMMs alone; with FP8 it keeps what forward kept and runs the
        // backward op again.
        if (fc1) g.d_fc1 = job.d_fc1 = Tensor::empty_async({T, fc1_width(options_.glu, ffn_)}, options_.dtype,
                                                           options_.device, exec.stream);
        if (fc2) g.act = job.act = Tensor::empty_async({T, ffn_}, options_.dtype, options_.device, exec.stream);
        job.saved = Saved{fc1 ? saved.x : Tensor(), {}, {}, {}, {}, {}};
      }
      queue_.push_back(std::move(job));
    }
    if (fc1) r.fc1_weight = fc1_grad_.queued(fc1_weight_, exec);
    if (fc2) r.fc2_weight = fc2_grad_.queued(fc2_weight_, exec);
  } else {
    if (fc1) g.fc1_weight = fc1_grad_.immediate(fc1_weight_, r.fc1_weight, exec);
    if (fc2) g.fc2_weight = fc2_grad_.immediate(fc2_weight_, r.fc2_weight, exec);
  }
  const bool through_act = g.dx.defined() || g.dprobs.defined() || g.fc1_bias.grad.defined() ||
                           g.fc1_weight.grad.defined() || g.fc2_weight.grad.defined() || g.d_fc1.defined() ||
                           g.act.defined();
  if (through_act)
    run_backward(dy, saved, ctx.groups_, g, exec);
  else if (g.fc2_bias.grad.defined())  // only db2 = sum_r p[r] dy[r]: no activation backward
    grouped_linear_dbias(dy, ctx.groups_, g.fc2_bias.grad, GradMode::kWrite, ctx.probs_, exec);
  release();
  return r;
}

void GroupedMLP::backward_dw(const ExecContext& exec) {
  if (queue_.empty()) return;
  while (!queue_.empty()) {
    const WgradJob& job = queue_.front();
    ExpertMlpGrads g;
    if (job.fc1) g.fc1_weight = fc1_grad_.delayed_target(fc1_weight_);
    if (job.fc2) g.fc2_weight = fc2_grad_.delayed_target(fc2_weight_);
    if (linears()) {
      if (job.fc2) detail::linear_wgrad(job.fc2_operands, g.fc2_weight, exec);
      if (job.fc1) detail::linear_wgrad(job.fc1_operands, g.fc1_weight, exec);
    } else if (options_.fp8) {
      run_backward(job.dy, job.saved, job.groups, g, exec);
    } else {  // the order and operands of the backward op's own wgrads: the same bits
      if (job.fc2) grouped_linear_wgrad(job.dy, job.act, job.groups, g.fc2_weight.grad, g.fc2_weight.mode, exec);
      if (job.fc1)
        grouped_linear_wgrad(job.d_fc1, job.saved.x, job.groups, g.fc1_weight.grad, g.fc1_weight.mode, exec);
    }
    if (job.fc1) fc1_grad_.ran(fc1_weight_);
    if (job.fc2) fc2_grad_.ran(fc2_weight_);
    queue_.pop_front();
  }
  for (const auto& hook : hooks_) hook();
}

std::map<std::string, Tensor> GroupedMLP::state_dict(const std::string& prefix) const {
  std::map<std::string, Tensor> out;
  detail::export_param(out, prefix + "fc1.weight", fc1_weight_.storage());
  detail::export_param(out, prefix + "fc2.weight", fc2_weight_.storage());
  if (fc1_bias_) {
    detail::export_param(out, prefix + "fc1.bias", fc1_bias_->storage());
    detail::export_param(out, prefix + "fc2.bias", fc2_bias_->storage());
  }
  return out;
}

void GroupedMLP::load_state_dict(std::map<std::string, Tensor> state, const std::string& prefix,
                                 std::optional<GluLayout> glu_from) {
  invalidate_fp8_weights();  // first: a load that fails half way may have changed the weights
  MOE_CHECK(!glu_from || options_.glu.gated(), ErrorCode::kInvalidArgument, "GroupedMLP.load_state_dict: glu_from = ",
            glu_from ? glu_from->name() : "", " given, but the module's activation ", activation_name(options_.glu.activation),
            " is not gated (FC1's rows have no GLU layout); expected no glu_from");
  const GluLayout& to = options_.glu.layout;
  // FC1 rows from glu_from to the module's layout, into new tensors (the caller's stay as they were).
  auto convert_fc1 = [&](const std::string& key) {
    normalize_grouped_keys(state, key, groups_, options_.layout);
    if (!glu_from || *glu_from == to) return;
    auto permute = [&](const std::string& k, int64_t experts) {
      auto it = state.find(k);
      if (it == state.end()) return;  // reported as missing by import_param
      const Tensor& t = it->second;
      MOE_CHECK(t.device().is_cpu() && t.view().is_contiguous(), ErrorCode::kInvalidArgument,
                "GroupedMLP.load_state_dict: converting the GLU layout of '", k, "' needs a contiguous CPU tensor, got ",
                t.view().describe());
      const size_t expert_bytes = t.nbytes() / size_t(experts);
      MOE_CHECK(t.nbytes() % (size_t(experts) * size_t(2 * ffn_)) == 0, ErrorCode::kShape,
                "GroupedMLP.load_state_dict: key '", k, "' is ", t.view().describe(), ", not ", experts, " x ", 2 * ffn_,
                " FC1 rows");
      Tensor out = Tensor::empty(t.shape(), t.dtype());
      const auto* src = static_cast<const uint8_t*>(t.data());
      for (int64_t e = 0; e < experts; ++e) {
        const std::vector<uint8_t> rows = detail::permute_glu_rows(
            std::span<const uint8_t>(src + size_t(e) * expert_bytes, expert_bytes), 2 * ffn_, *glu_from, to,
            ErrorCode::kShape, "GroupedMLP.load_state_dict: '" + k + "'");
        std::memcpy(static_cast<uint8_t*>(out.data()) + size_t(e) * expert_bytes, rows.data(), expert_bytes);
      }
      it->second = out;
    };
    if (options_.layout == ExpertLayout::kPacked) {
      permute(key, groups_);
    } else {
      for (int64_t g = 0; g < groups_; ++g) permute(key + std::to_string(g), 1);
    }
  };
  convert_fc1(prefix + "fc1.weight");
  detail::import_param(state, prefix + "fc1.weight", fc1_weight_.storage());
  detail::import_param(state, prefix + "fc2.weight", fc2_weight_.storage());
  if (fc1_bias_) {
    convert_fc1(prefix + "fc1.bias");
    detail::import_param(state, prefix + "fc1.bias", fc1_bias_->storage());
    detail::import_param(state, prefix + "fc2.bias", fc2_bias_->storage());
  }
  detail::check_no_unexpected_keys(state, prefix, "GroupedMLP.load_state_dict");
}

}  // namespace moe
