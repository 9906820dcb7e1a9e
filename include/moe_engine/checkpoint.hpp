// Checkpoint layout conversion between per-expert and packed expert tensors (DESIGN.md section 4):
// per-expert keys PREFIX.weight0 .. weight{G-1} ([N, K] each) and PREFIX.bias0 .. ([N]) versus
// packed PREFIX.weight ([G, N, K], or [G*N, K] as TransformerEngine writes it) and PREFIX.bias
// ([G, N] or [G*N]); optionally with the GLU column layout of FC1 rows changed on the way.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moe_engine/export.hpp"
#include "moe_engine/glu.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/safetensors.hpp"

namespace moe {


struct CheckpointConversion {
  int64_t experts = 0;                 // G
  ExpertLayout to = ExpertLayout::kPacked;
  // Only keys starting with this are expert tensors. Without a prefix, only the unambiguous packed
  // shapes ([G, N, K], [G, N]) count as groups; the flattened [G*N, K] / [G*N] need one.
  std::string prefix;
  std::optional<GluLayout> glu_from;   // both or neither: permute the rows of every converted
  std::optional<GluLayout> glu_to;     // group (FC1 weights [2F, K] and biases [2F]) between layouts
};

// A tensor with its own bytes (the conversion's output).
struct OwnedTensorRecord {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

struct ConvertedCheckpoint {
  std::vector<OwnedTensorRecord> tensors;  // in the input's order, each group where its first member was
  std::map<std::string, std::string> metadata;
  std::vector<std::string> converted;      // the groups converted ("PREFIX.weight", ...)
};

// Converts every expert group of `in` under `prefix` to `to` (groups already in that layout are
// only GLU-permuted, if asked); copies every other tensor unchanged. Throws moe::Error (kIo) on an
// inconsistent group: a missing or extra expert index, experts of different shape or dtype, a
// packed tensor whose first dimension does not split into G experts, an odd row count under GLU.
MOE_API ConvertedCheckpoint convert_checkpoint(const SafetensorsFile& in, const CheckpointConversion& conversion);
MOE_API void save_safetensors(const std::string& path, const ConvertedCheckpoint& checkpoint);

}  // namespace moe
