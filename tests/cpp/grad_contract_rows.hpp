// The six rows of the gradient contract (docs/design.md section 6), shared by the module tests.
#pragma once

#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <tuple>

#include "moe_engine/modules.hpp"

namespace moe::test {

struct Row {
  const char* name;
  bool delay, main_grad, flag;
  GradKind backward_kind;  // what backward hands back
  bool flag_after_backward, flag_after_dw;
};

inline void PrintTo(const Row& row, std::ostream* os) { *os << row.name; }

inline const Row kRows[] = {
    {"plain", false, false, false, GradKind::kGrad, false, false},
    {"delayed", true, false, false, GradKind::kNone, false, false},
    {"main_grad_no_flag", false, true, false, GradKind::kNone, false, false},
    {"main_grad_flag", false, true, true, GradKind::kDummy, true, true},
    {"delayed_main_grad_no_flag", true, true, false, GradKind::kNone, false, false},
    {"delayed_main_grad_flag", true, true, true, GradKind::kDummy, false, true},
};

// Every row x both layouts, named "row_layout".
inline auto all_rows_and_layouts() {
  return ::testing::Combine(::testing::ValuesIn(kRows),
                            ::testing::Values(ExpertLayout::kPacked, ExpertLayout::kPerExpert));
}
inline std::string row_and_layout_name(const ::testing::TestParamInfo<std::tuple<Row, ExpertLayout>>& info) {
  return std::string(std::get<0>(info.param).name) + "_" +
         (std::get<1>(info.param) == ExpertLayout::kPacked ? "packed" : "per_expert");
}

}  // namespace moe::test
