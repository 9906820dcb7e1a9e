// Helpers shared by the modules: parameter initialization and state-dict import/export.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "moe_engine/grouped_param.hpp"
#include "moe_engine/tensor.hpp"

namespace moe::detail {

// Uniform values in [lo, hi) from (seed, packed element index): the same values in either layout.
void init_uniform(const GroupedTensor& t, uint64_t seed, float lo, float hi);
void zero(const GroupedTensor& t, Stream stream);

// state[key] (packed) or state[key + i] (per-expert): tensors sharing the parameter's storage.
void export_param(std::map<std::string, Tensor>& state, const std::string& key, const GroupedTensor& param);
// Normalizes `key` to the parameter's layout, copies the values in and removes the keys it used.
void import_param(std::map<std::string, Tensor>& state, const std::string& key, const GroupedTensor& param);
// Keys under `prefix` that no parameter took: kInvalidArgument, naming them.
void check_no_unexpected_keys(const std::map<std::string, Tensor>& state, const std::string& prefix,
                              const char* who);

}  // namespace moe::detail
