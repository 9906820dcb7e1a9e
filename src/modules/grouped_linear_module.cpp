// GroupedLinear: parameters, the gradient contract (docs/design.md section 6), delayed wgrad, checkpoints,
// and the FP8 GEMMs (forward / dgrad / wgrad, each optional) over a cached FP8 copy of the weight.
#include <cmath>
#include <string>
#include <utility>

#include "modules/linear_steps.hpp"
#include "modules/parameter_io.hpp"
#include "moe_engine/modules.hpp"

namespace moe {

const char* grad_kind_name(GradKind kind) {
  switch (kind) {
    case GradKind::kNone: return "none";
    case GradKind::kGrad: return "grad";
    case GradKind::kDummy: return "dummy";
  }
  return "?";
}

namespace {
// The sizes and dtype checked before any member is built from them (the parameters' tensors would
// otherwise fail first, naming an internal function).
const GroupedLinearOptions& checked_linear_args(int64_t groups, int64_t in_features, int64_t out_features,
                                                const GroupedLinearOptions& options) {
  MOE_CHECK(groups >= 1 && in_features >= 1 && out_features >= 1, ErrorCode::kInvalidArgument,
            "GroupedLinear: expected G, in_features, out_features >= 1, got ", groups, ", ", in_features,
            ", ", out_features);
  MOE_CHECK(is_floating(options.dtype), ErrorCode::kDType,
            "GroupedLinear: GroupedLinearOptions::dtype: expected float32, bfloat16, float16 or float64, got ",
            dtype_name(options.dtype));
  return options;
}
}  // namespace

GroupedLinear::GroupedLinear(int64_t groups, int64_t in_features, int64_t out_features,
                             const GroupedLinearOptions& options)
    : groups_(groups),
      in_(in_features),
      out_(out_features),
      options_(checked_linear_args(groups, in_features, out_features, options)),
      weight_(groups, {out_features, in_features}, options.dtype, options.device, options.layout),
      weight_grad_(options.accumulate_into_main_grad, options.overwrite_main_grad, options.zero_out_wgrad) {
  MOE_CHECK(!options.scale_bias || options.bias, ErrorCode::kInvalidArgument,
            "GroupedLinear: scale_bias needs bias = true");
  MOE_CHECK(!options.overwrite_main_grad || options.accumulate_into_main_grad, ErrorCode::kInvalidArgument,
            "GroupedLinear: overwrite_main_grad needs accumulate_into_main_grad = true");
  if (options.fp8) {
    const Fp8ModuleRecipe& fp8 = *options.fp8;
    detail::check_fp8_module_options(fp8, options.dtype, "GroupedLinear", "in_features", in_features, "out_features",
                                     out_features);
    weight_cache_ = detail::Fp8WeightCache(weight_, fp8.forward, fp8.dgrad);
  }
  const float bound = 1.0f / std::sqrt(float(in_features));
  detail::init_uniform(weight_.storage(), options.seed, -bound, bound);
  if (options.bias) {
    bias_.emplace(groups, Shape{out_features}, options.dtype, options.device, options.layout);
    detail::init_uniform(bias_->storage(), options.seed + 1, -bound, bound);
  }
}

Parameter& GroupedLinear::bias() {
  MOE_CHECK(bias_.has_value(), ErrorCode::kInvalidArgument, "GroupedLinear: the module has no bias");
  return *bias_;
}

int64_t LinearContext::saved_bytes() const {
  int64_t bytes = x_columns_.nbytes();
  for (const Tensor* t : {&x_, &row_scale_})
    if (t->defined()) bytes += int64_t(t->nbytes());
  return bytes;
}

LinearForwardResult GroupedLinear::forward(const Tensor& x, const GroupLayout& groups, const Tensor& row_scale,
                                           bool input_requires_grad, const ExecContext& exec) {
  MOE_CHECK(x.defined() && x.dim() == 2 && x.size(1) == in_, ErrorCode::kShape,
            "GroupedLinear.forward: expected x [T, ", in_, "], got ", x.view().describe());
  MOE_CHECK(groups.defined() && groups.num_groups() == groups_, ErrorCode::kInvalidArgument,
            "GroupedLinear.forward: expected a routing of ", groups_, " experts, got ", groups.num_groups());
  MOE_CHECK(x.dtype() == options_.dtype, ErrorCode::kDType, "GroupedLinear.forward: x is ",
            dtype_name(x.dtype()), " but the module's parameters are ", dtype_name(options_.dtype),
            " (GroupedLinearOptions::dtype); convert x or build the module with that dtype");
  MOE_CHECK(options_.scale_bias == row_scale.defined(), ErrorCode::kInvalidArgument,
            options_.scale_bias ? "GroupedLinear.forward: scale_bias needs the row scales"
                                : "GroupedLinear.forward: row scales given to a module without scale_bias");
  const int64_t T = x.size(0);
  const std::optional<Fp8ModuleRecipe>& fp8 = options_.fp8;
  LinearForwardResult r;
  LinearContext& c = r.ctx;
  r.y = Tensor::zeros_async({T, out_}, options_.dtype, options_.device, exec.stream);
  BiasEpilogue bias;
  if (bias_) bias = {bias_->value(), row_scale.view()};
  // Keep what backward needs, no more: x (or only its FP8 columns, for an FP8 wgrad) for the weight
  // gradient, the scales for the bias gradients.
  if (fp8) {
    if (weight_.requires_grad && fp8->wgrad)
      c.x_columns_ = detail::Fp8ColumnsBuffers::empty(T, groups_, in_, options_.device, exec.stream);
    detail::linear_forward({weight_, weight_cache_, *fp8}, x, groups, bias, c.x_columns_, r.y, exec);
  } else {
    grouped_linear_forward(x, weight_.value(), groups, r.y, bias, exec);
  }
  if (weight_.requires_grad && !c.x_columns_.defined()) c.x_ = x;
  if (options_.scale_bias) c.row_scale_ = row_scale;
  c.groups_ = groups;
  c.input_requires_grad_ = input_requires_grad;
  c.live_ = true;
  c.owner_ = id_.value;
  c.offloadable_ = options_.offload_activations;
  return r;
}

LinearBackwardResult GroupedLinear::backward(LinearContext& ctx, const Tensor& dy, const ExecContext& exec) {
  MOE_CHECK(ctx.live_, ErrorCode::kInvalidArgument,
            "GroupedLinear.backward: the context was already used (or comes from no forward)");
  MOE_CHECK(ctx.owner_ == id_.value, ErrorCode::kInvalidArgument,
            "GroupedLinear.backward: the context comes from another module's forward");
  MOE_CHECK(!ctx.offloaded(), ErrorCode::kInvalidArgument,
            "GroupedLinear.backward: the context's tensors are in host memory; ActivationOffload::restore it first");
  MOE_CHECK(dy.defined() && dy.dim() == 2 && dy.size(1) == out_ &&
                dy.size(0) == ctx.groups_.capacity(),
            ErrorCode::kShape, "GroupedLinear.backward: expected dy [", ctx.groups_.capacity(), ", ", out_,
            "], got ", dy.view().describe());
  MOE_CHECK(!weight_.requires_grad || ctx.saves_input(), ErrorCode::kInvalidArgument,
            "GroupedLinear.backward: the weight wants a gradient but forward kept no input (the weight's "
            "requires_grad was false when forward ran)");
  weight_grad_.check_main_grad(weight_, "GroupedLinear.backward");
  ctx.live_ = false;
  const GroupLayout& groups = ctx.groups_;
  const int64_t T = dy.size(0);
  const std::optional<Fp8ModuleRecipe>& fp8 = options_.fp8;
  // dy's FP8 rows for dgrad and columns for wgrad, in one pass over dy.
  const detail::GradCopies dy8 =
      fp8 ? detail::quantize_gradient(dy, groups, groups_, ctx.input_requires_grad_ && fp8->dgrad,
                                      weight_.requires_grad && ctx.x_columns_.defined(), fp8->quantizer, exec)
          : detail::GradCopies{};
  LinearBackwardResult r;
  if (ctx.input_requires_grad_) {
    r.dx = Tensor::zeros_async({T, in_}, options_.dtype, options_.device, exec.stream);
    if (fp8)
      detail::linear_dgrad({weight_, weight_cache_, *fp8}, dy, dy8.rows, groups, r.dx, exec);
    else
      grouped_linear_dgrad(dy, weight_.value(), groups, r.dx, exec);
  }
  if (bias_) {
    if (bias_->requires_grad) {
      r.bias.kind = GradKind::kGrad;
      r.bias.grad = GroupedTensor::zeros_async(groups_, {out_}, options_.dtype, options_.device, bias_->layout(),
                                               exec.stream);
      grouped_linear_dbias(dy, groups, r.bias.grad, GradMode::kWrite, ctx.row_scale_.view(), exec);
    }
    if (options_.scale_bias) {
      r.dscales = Tensor::zeros_async({T}, DType::kFloat32, options_.device, exec.stream);
      grouped_linear_dscales(dy, bias_->value(), groups, r.dscales, false, exec);
    }
  }
  if (weight_.requires_grad) {
    // The job keeps the wgrad's operands: dy and x, or their FP8 columns (no bf16 copy).
    detail::LinearWgradOperands job = detail::wgrad_operands(dy, dy8, ctx.x_, ctx.x_columns_, groups);
    if (options_.delay_wgrad_compute) {
      queue_.push_back(std::move(job));
      r.weight = weight_grad_.queued(weight_, exec);
    } else {
      detail::linear_wgrad(job, weight_grad_.immediate(weight_, r.weight, exec), exec);
    }
  }
  ctx.x_ = ctx.row_scale_ = Tensor();
  ctx.x_columns_ = {};
  return r;
}

void GroupedLinear::backward_dw(const ExecContext& exec) {
  if (queue_.empty()) return;
  while (!queue_.empty()) {
    detail::linear_wgrad(queue_.front(), weight_grad_.delayed_target(weight_), exec);
    weight_grad_.ran(weight_);
    queue_.pop_front();
  }
  for (const auto& hook : hooks_) hook();
}

std::map<std::string, Tensor> GroupedLinear::state_dict(const std::string& prefix) const {
  std::map<std::string, Tensor> out;
  detail::export_param(out, prefix + "weight", weight_.storage());
  if (bias_) detail::export_param(out, prefix + "bias", bias_->storage());
  return out;
}

void GroupedLinear::load_state_dict(std::map<std::string, Tensor> state, const std::string& prefix) {
  invalidate_fp8_weights();  // first: a load that fails half way may have changed the weight
  detail::import_param(state, prefix + "weight", weight_.storage());
  if (bias_) detail::import_param(state, prefix + "bias", bias_->storage());
  detail::check_no_unexpected_keys(state, prefix, "GroupedLinear.load_state_dict");
}

}  // namespace moe
