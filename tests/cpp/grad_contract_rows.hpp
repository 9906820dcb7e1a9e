// The rows of the gradient contract (docs/design.md section 6), shared by the module tests and
// with the Python tests: tests/data/grad_contract.json holds them (its "about" says what each
// field means).
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <ostream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "moe_engine/modules.hpp"

namespace moe::test {

struct Row {
  std::string name;
  bool delay = false, main_grad = false, flag = false, overwrite = false, zero_out = false;
  GradOutcome outcome;  // what moe::grad_outcome decides
  GradKind backward_kind = GradKind::kGrad;  // what backward hands back (outcome.handed_back)
  bool flag_after_backward = false, flag_after_dw = false;
};

inline void PrintTo(const Row& row, std::ostream* os) { *os << row.name; }

inline GradKind grad_kind_from_name(const std::string& name) {
  for (GradKind k : {GradKind::kNone, GradKind::kGrad, GradKind::kDummy})
    if (name == grad_kind_name(k)) return k;
  throw std::runtime_error("grad_contract.json: unknown handed_back '" + name + "'");
}
inline GradTarget grad_target_from_name(const std::string& name) {
  for (GradTarget t : {GradTarget::kFresh, GradTarget::kMainGrad, GradTarget::kGrad})
    if (name == grad_target_name(t)) return t;
  throw std::runtime_error("grad_contract.json: unknown target '" + name + "'");
}
inline FlagUpdate flag_update_from_name(const std::string& name) {
  for (FlagUpdate f : {FlagUpdate::kNever, FlagUpdate::kBackward, FlagUpdate::kBackwardDw})
    if (name == flag_update_name(f)) return f;
  throw std::runtime_error("grad_contract.json: unknown flag_update '" + name + "'");
}

// Read once, when the parameterized suites are instantiated; a missing or malformed file stops
// the test binary with the reason.
inline const std::vector<Row>& grad_contract_rows() {
  static const std::vector<Row> rows = [] {
    const std::string path = std::string(MOE_ENGINE_TEST_DATA_DIR) + "/grad_contract.json";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path);
    const nlohmann::json doc = nlohmann::json::parse(in);
    std::vector<Row> out;
    for (const nlohmann::json& j : doc.at("rows")) {
      Row r;
      r.name = j.at("name").get<std::string>();
      r.delay = j.at("delay").get<bool>();
      r.main_grad = j.at("main_grad").get<bool>();
      r.flag = j.at("flag").get<bool>();
      r.overwrite = j.at("overwrite").get<bool>();
      r.zero_out = j.at("zero_out").get<bool>();
      r.outcome.deferred = j.at("deferred").get<bool>();
      r.outcome.target = grad_target_from_name(j.at("target").get<std::string>());
      r.outcome.mode = parse_grad_mode(j.at("mode").get<std::string>());
      r.outcome.handed_back = grad_kind_from_name(j.at("handed_back").get<std::string>());
      r.outcome.zero_dummy = j.at("zero_dummy").get<bool>();
      r.outcome.flag = flag_update_from_name(j.at("flag_update").get<std::string>());
      r.backward_kind = r.outcome.handed_back;
      r.flag_after_backward = j.at("flag_after_backward").get<bool>();
      r.flag_after_dw = j.at("flag_after_dw").get<bool>();
      out.push_back(r);
    }
    if (out.empty()) throw std::runtime_error(path + " holds no rows");
    return out;
  }();
  return rows;
}

// The row's switches on a module's options (GroupedLinearOptions or GroupedMLPOptions).
template <class Options>
void apply_row(Options& o, const Row& row) {
  o.delay_wgrad_compute = row.delay;
  o.accumulate_into_main_grad = row.main_grad;
  o.overwrite_main_grad = row.overwrite;
  o.zero_out_wgrad = row.zero_out;
}

// The contract's steps after a backward of module m, whose wgrad hook counts into hook_calls:
// what backward handed back for each weight (pairs of the result's gradient and the parameter)
// and the flags then, the queued job; then backward_dw, the hook and the flags after it.
template <class Module>
void expect_contract_steps(Module& m, std::initializer_list<std::pair<const ParamGradResult*, Parameter*>> weights,
                           const Row& row, const int& hook_calls) {
  for (auto [got, param] : weights) {
    EXPECT_EQ(got->kind, row.backward_kind) << row.name << ": got " << grad_kind_name(got->kind);
    EXPECT_EQ(got->grad.defined(), row.backward_kind != GradKind::kNone);
    EXPECT_EQ(param->grad_added_to_main_grad.has_value(), row.flag) << "the flag appeared or vanished";
    if (row.flag) EXPECT_EQ(*param->grad_added_to_main_grad, row.flag_after_backward) << row.name;
  }
  EXPECT_EQ(m.queued_wgrads(), row.delay ? 1u : 0u);
  m.backward_dw();
  EXPECT_EQ(hook_calls, row.delay ? 1 : 0) << "hooks fire once per backward_dw that ran something";
  for (const auto& weight : weights)
    if (row.flag) EXPECT_EQ(*weight.second->grad_added_to_main_grad, row.flag_after_dw) << row.name;
}

// Every row x both layouts, named "row_layout".
inline auto all_rows_and_layouts() {
  return ::testing::Combine(::testing::ValuesIn(grad_contract_rows()),
                            ::testing::Values(ExpertLayout::kPacked, ExpertLayout::kPerExpert));
}
inline std::string row_and_layout_name(const ::testing::TestParamInfo<std::tuple<Row, ExpertLayout>>& info) {
  return std::get<0>(info.param).name + "_" +
         (std::get<1>(info.param) == ExpertLayout::kPacked ? "packed" : "per_expert");
}

}  // namespace moe::test
