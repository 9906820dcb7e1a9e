// The router vocabulary: spec descriptions and checks.
#include "moe_engine/router_spec.hpp"

#include <cmath>
#include <sstream>

namespace moe {

std::string describe(const RouterSpec& spec) {
  const RouterSpec defaults;
  std::ostringstream os;
  os << router_score_name(spec.score) << ", topk=" << spec.topk;
  if (spec.group_limited()) os << ", groups=" << spec.num_groups << "/" << spec.topk_groups;
  os << (spec.norm_topk_prob ? ", norm" : ", no norm");
  if (spec.scaling_factor != defaults.scaling_factor) os << ", scaling=" << spec.scaling_factor;
  if (spec.aux_loss_coeff != defaults.aux_loss_coeff) os << ", aux=" << spec.aux_loss_coeff;
  if (spec.z_loss_coeff != defaults.z_loss_coeff) os << ", z=" << spec.z_loss_coeff;
  return os.str();
}

void check_router_spec(const RouterSpec& spec, int64_t num_experts, std::string_view who) {
  const int64_t E = num_experts;
  MOE_CHECK(E >= 1, ErrorCode::kInvalidArgument, who,
            ": expected at least one expert, got E = ", E);
  MOE_CHECK(spec.num_groups >= 1 && spec.num_groups <= E && E % spec.num_groups == 0,
            ErrorCode::kInvalidArgument, who, ": spec.num_groups: expected a divisor of E = ", E,
            " (the experts split into equal groups), got ", spec.num_groups);
  MOE_CHECK(spec.topk_groups >= 1 && spec.topk_groups <= spec.num_groups,
            ErrorCode::kInvalidArgument, who,
            ": spec.topk_groups: expected 1 <= topk_groups <= num_groups = ", spec.num_groups,
            ", got ", spec.topk_groups);
  const int64_t eligible = spec.topk_groups * (E / spec.num_groups);
  MOE_CHECK(spec.topk >= 1 && spec.topk <= eligible, ErrorCode::kInvalidArgument, who,
            ": spec.topk: expected 1 <= topk <= ", eligible,
            spec.group_limited()
                ? " (topk_groups x experts per group: the experts of the kept groups)"
                : " (E, the number of experts)",
            ", got ", spec.topk);
  MOE_CHECK(std::isfinite(spec.scaling_factor), ErrorCode::kInvalidArgument, who,
            ": spec.scaling_factor: expected a finite value, got ", spec.scaling_factor);
  MOE_CHECK(std::isfinite(spec.aux_loss_coeff) && spec.aux_loss_coeff >= 0.f,
            ErrorCode::kInvalidArgument, who,
            ": spec.aux_loss_coeff: expected a finite value >= 0, got ", spec.aux_loss_coeff);
  MOE_CHECK(std::isfinite(spec.z_loss_coeff) && spec.z_loss_coeff >= 0.f,
            ErrorCode::kInvalidArgument, who,
            ": spec.z_loss_coeff: expected a finite value >= 0, got ", spec.z_loss_coeff);
}

}  // namespace moe
