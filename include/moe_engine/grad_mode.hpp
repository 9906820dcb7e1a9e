// How a parameter gradient reaches its buffer: the vocabulary of every layer that writes one
// (backends, ops, modules).
#pragma once

#include <string_view>

#include "moe_engine/enum_names.hpp"
#include "moe_engine/grouped_param.hpp"

namespace moe {

enum class GradMode {
  kWrite,       // grad = result (any float dtype); an empty expert writes zeros
  kAccumulate,  // float32 main_grad += result; an empty expert leaves it untouched
  kOverwrite,   // float32 main_grad = result; an empty expert writes zeros
};
template <>
struct EnumNames<GradMode> {
  static constexpr std::string_view kWhat = "gradient mode";
  static constexpr EnumName<GradMode> kNames[] = {
      {GradMode::kWrite, "write"},
      {GradMode::kAccumulate, "accumulate"},
      {GradMode::kOverwrite, "overwrite"},
  };
};
inline const char* grad_mode_name(GradMode mode) { return enum_name(mode); }
inline GradMode parse_grad_mode(std::string_view name) { return parse_enum<GradMode>(name); }

// Where one parameter gradient goes; an undefined grad is not computed.
struct ParamGrad {
  GroupedParam grad;
  GradMode mode = GradMode::kWrite;
};

}  // namespace moe
