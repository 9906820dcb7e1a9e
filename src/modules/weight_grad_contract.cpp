// One weight's side of the gradient contract (DESIGN.md section 4), shared by the modules.
#include "modules/parameter_io.hpp"
#include "moe_engine/modules.hpp"

namespace moe::detail {
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

ParamGrad WeightGradContract::immediate(Parameter& w, ParamGradResult& result, const ExecContext& exec) {
  if (!into_main_grad_) {  // row 1: the gradient itself
    result.kind = GradKind::kGrad;
    result.grad = zeros_like(w, w.dtype());
    return {result.grad.view(), GradMode::kWrite};
  }
  result = main_grad_outcome(w, exec);
  if (result.kind == GradKind::kDummy) w.grad_added_to_main_grad = true;
  return {w.main_grad(), overwrite_ ? GradMode::kOverwrite : GradMode::kAccumulate};
}

ParamGradResult WeightGradContract::queued(const Parameter& w, const ExecContext& exec) {
  return main_grad_outcome(w, exec);
}

// Rows 2-6: nothing, unless the parameter carries grad_added_to_main_grad; then the shared dummy
// (the flag is set by the caller: now, or when backward_dw has run the delayed GEMM).
ParamGradResult WeightGradContract::main_grad_outcome(const Parameter& w, const ExecContext& exec) {
  ParamGradResult r;
  if (!into_main_grad_ || !w.grad_added_to_main_grad.has_value()) return r;
  if (!dummy_.defined())
    dummy_ = zeros_like(w, w.dtype());
  else if (zero_out_)
    zero(dummy_, exec.stream);
  r.kind = GradKind::kDummy;
  r.grad = dummy_;
  return r;
}

ParamGrad WeightGradContract::delayed_target(Parameter& w) const {
  if (into_main_grad_) {
    check_main_grad(w, "backward_dw");
    return {w.main_grad(), overwrite_ ? GradMode::kOverwrite : GradMode::kAccumulate};
  }
  // Without main_grad: summed into the parameter's float32 .grad.
  const bool first = !w.grad_.defined();
  if (first) w.grad_ = zeros_like(w, DType::kFloat32);
  return {w.grad_.view(), first ? GradMode::kWrite : GradMode::kAccumulate};
}

void WeightGradContract::ran(Parameter& w) const {
  if (into_main_grad_ && w.grad_added_to_main_grad.has_value()) w.grad_added_to_main_grad = true;
}

}  // namespace moe::detail
