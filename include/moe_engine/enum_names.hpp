// Names of the library's enums, one mechanism for all of them: an enum lists its names once in a
// specialization of EnumNames, and enum_name / parse_enum read that table. The first name listed
// for a value is its canonical name (what enum_name returns and what parse_enum accepts back);
// later ones are aliases that parse_enum also accepts.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "moe_engine/error.hpp"

namespace moe {

template <class E>
struct EnumName {
  E value;
  std::string_view name;
};

// Specialize with `static constexpr std::string_view kWhat` (what the values are, for messages)
// and `static constexpr EnumName<E> kNames[]`.
template <class E>
struct EnumNames;

// The canonical name of `value`, or "unknown" for a value outside the table.
template <class E>
constexpr const char* enum_name(E value) {
  for (const EnumName<E>& n : EnumNames<E>::kNames)
    if (n.value == value) return n.name.data();
  return "unknown";
}

// "a, b or c": the canonical names, for messages.
template <class E>
std::string enum_choices() {
  std::string out;
  bool first = true;
  constexpr size_t count = sizeof(EnumNames<E>::kNames) / sizeof(EnumNames<E>::kNames[0]);
  size_t canonical = 0, seen = 0;
  for (size_t i = 0; i < count; ++i)
    if (enum_name(EnumNames<E>::kNames[i].value) == EnumNames<E>::kNames[i].name.data()) ++canonical;
  for (size_t i = 0; i < count; ++i) {
    const EnumName<E>& n = EnumNames<E>::kNames[i];
    if (enum_name(n.value) != n.name.data()) continue;  // an alias
    ++seen;
    if (!first) out += seen == canonical ? " or " : ", ";
    out += n.name;
    first = false;
  }
  return out;
}

// The value named `text` (canonical names and aliases); kInvalidArgument naming the choices.
template <class E>
E parse_enum(std::string_view text) {
  for (const EnumName<E>& n : EnumNames<E>::kNames)
    if (n.name == text) return n.value;
  throw_error(ErrorCode::kInvalidArgument, "unknown ", EnumNames<E>::kWhat, " '", text, "'; expected ",
              enum_choices<E>());
}

}  // namespace moe
