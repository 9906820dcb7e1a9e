// The gradient contract (docs/design.md section 6): the decision (grad_outcome) and one weight's
// side of it in the C++ modules (WeightGradContract applies the decision to a Parameter).
#include "modules/parameter_io.hpp"
#include "moe_engine/modules.hpp"

namespace moe {

const char* grad_target_name(GradTarget target) {
  switch (target) {
    case GradTarget::kFresh: return "fresh";
    case GradTarget::kMainGrad: return "main_grad";
    case GradTarget::kGrad: return "grad";
  }
  return "?";
}

const char* flag_update_name(FlagUpdate update) {
  switch (update) {
    case FlagUpdate::kNever: return "never";
    case FlagUpdate::kBackward: return "backward";
    case FlagUpdate::kBackwardDw: return "backward_dw";
  }
  return "?";
}

GradOutcome grad_outcome(const GradContractCase& c) {
  GradOutcome o;
  o.deferred = c.delay_wgrad_compute;
  if (!c.accumulate_into_main_grad) {
    // Row 1: the gradient itself. Row 2 (delayed): nothing now; backward_dw sums it into .grad.
    o.target = c.delay_wgrad_compute ? GradTarget::kGrad : GradTarget::kFresh;
    o.mode = c.delay_wgrad_compute ? GradMode::kAccumulate : GradMode::kWrite;
    o.handed_back = c.delay_wgrad_compute ? GradKind::kNone : GradKind::kGrad;
    return o;
  }
  // Rows 3-6: into main_grad. Autograd gets nothing, so that it does not add a gradient behind
  // the GEMM's back; with Megatron's flag it gets a dummy instead, so that data-parallel hooks
  // fire, and the flag says the GEMM did the adding (once it has run).
  o.target = GradTarget::kMainGrad;
  o.mode = c.overwrite_main_grad ? GradMode::kOverwrite : GradMode::kAccumulate;
  if (c.has_grad_added_to_main_grad) {
    o.handed_back = GradKind::kDummy;
    o.zero_dummy = c.zero_out_wgrad;
    o.flag = c.delay_wgrad_compute ? FlagUpdate::kBackwardDw : FlagUpdate::kBackward;
  } else {
    o.handed_back = GradKind::kNone;
  }
  return o;
}

namespace detail {
namespace {

GroupedTensor zeros_like(const Parameter& w, DType dtype) {
  return GroupedTensor::zeros(w.num_groups(), w.expert_shape(), dtype, w.device(), w.layout());
}

}  // namespace

void WeightGradContract::check_main_grad(const Parameter& w, const char* who) const {
  if (w.requires_grad && into_main_grad_)
    MOE_CHECK(w.main_grad().defined(), ErrorCode::kInvalidArgument, who,
              ": accumulate_into_main_grad, but the weight has no main_grad (Parameter::set_main_grad)");
}

GradOutcome WeightGradContract::outcome(const Parameter& w, bool delayed) const {
  return grad_outcome({into_main_grad_, overwrite_, zero_out_, delayed, w.grad_added_to_main_grad.has_value()});
}

ParamGradResult WeightGradContract::handed_back(const Parameter& w, const GradOutcome& o, const ExecContext& exec) {
  ParamGradResult r;
  r.kind = o.handed_back;
  if (o.handed_back == GradKind::kGrad) {
    r.grad = zeros_like(w, w.dtype());
  } else if (o.handed_back == GradKind::kDummy) {
    if (!dummy_.defined())
      dummy_ = zeros_like(w, w.dtype());
    else if (o.zero_dummy)
      zero(dummy_, exec.stream);
    r.grad = dummy_;
  }
  return r;
}

ParamGrad WeightGradContract::target(Parameter& w, const GradOutcome& o, const ParamGradResult& result) const {
  switch (o.target) {
    case GradTarget::kFresh:
      return {result.grad.view(), o.mode};
    case GradTarget::kMainGrad:
      return {w.main_grad(), o.mode};
    case GradTarget::kGrad: {
      // The first gradient since zero_grad() writes a new float32 .grad; the next ones add to it.
      const bool first = !w.grad_.defined();
      if (first) w.grad_ = zeros_like(w, DType::kFloat32);
      return {w.grad_.view(), first ? GradMode::kWrite : o.mode};
    }
  }
  throw_error(ErrorCode::kInternal, "WeightGradContract: unknown gradient target");
}

ParamGrad WeightGradContract::immediate(Parameter& w, ParamGradResult& result, const ExecContext& exec) {
  const GradOutcome o = outcome(w, false);
  result = handed_back(w, o, exec);
  if (o.flag == FlagUpdate::kBackward) w.grad_added_to_main_grad = true;
  return target(w, o, result);
}

ParamGradResult WeightGradContract::queued(const Parameter& w, const ExecContext& exec) {
  return handed_back(w, outcome(w, true), exec);
}

ParamGrad WeightGradContract::delayed_target(Parameter& w) const {
  const GradOutcome o = outcome(w, true);
  if (o.target == GradTarget::kMainGrad) check_main_grad(w, "backward_dw");
  return target(w, o, {});
}

void WeightGradContract::ran(Parameter& w) const {
  if (outcome(w, true).flag == FlagUpdate::kBackwardDw) w.grad_added_to_main_grad = true;
}

}  // namespace detail
}  // namespace moe
