// Checkpoint layout conversion between per-expert and packed expert tensors
// (docs/design.md, "Checkpoints"):
// per-expert keys PREFIX.weight0 .. weight{G-1} ([N, K] each) and PREFIX.bias0 .. ([N]) versus
// packed PREFIX.weight ([G, N, K], or [G*N, K] as TransformerEngine writes it) and PREFIX.bias
// ([G, N] or [G*N]); optionally with the GLU column layout of FC1 rows changed on the way.
//
// FC1 groups are those whose module is named `linear_fc1` (Megatron-LM, TransformerEngine) or `fc1`
// (moe-engine's modules), e.g. "decoder.layers.0.mlp.experts.linear_fc1.weight", or the one module
// the prefix names exactly ("model.w13." or "model.w13" for "model.w13.weight"). Only their rows
// (weights [2F, K], biases [2F]) hold GLU gate/linear pairs; FC2 and every other group keep their
// row order.
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
  std::optional<GluLayout> glu_from;   // both or neither: permute the rows of every FC1 group
  std::optional<GluLayout> glu_to;     // (weights [2F, K] and biases [2F]) between layouts
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
  // The expert groups found under the prefix, by their packed key ("PREFIX.weight", ...):
  std::vector<std::string> converted;       // changed to the target layout
  std::vector<std::string> already_in_layout;  // found in the target layout already
  std::vector<std::string> glu_reordered;   // FC1 groups whose rows changed order (glu_from != glu_to)
  int64_t keys_under_prefix = 0;            // tensors whose key starts with the prefix
  // Whether the conversion changed anything: converted or reordered a group.
  bool changed() const { return !converted.empty() || !glu_reordered.empty(); }
};

// Whether `group` (a packed key such as "a.linear_fc1.weight") is an FC1 group under the rule above.
MOE_API bool is_fc1_group(const std::string& group, const std::string& prefix = "");

// Converts every expert group of `in` under `prefix` to `to` (groups already in that layout are
// copied, and GLU-permuted if they are FC1 groups and a GLU change is asked); copies every other
// tensor unchanged. A conversion that changes nothing is not an error here (see changed()).
// Throws moe::Error (kIo) on an inconsistent group: a missing or extra expert index, experts of
// different shape or dtype, a packed tensor whose first dimension does not split into G experts,
// an odd row count under GLU; kInvalidArgument when a GLU change is asked but no group under the
// prefix is an FC1 group (the message lists the groups found).
MOE_API ConvertedCheckpoint convert_checkpoint(const SafetensorsFile& in, const CheckpointConversion& conversion);
MOE_API void save_safetensors(const std::string& path, const ConvertedCheckpoint& checkpoint);

}  // namespace moe
