// Checkpoint layout conversion; see moe_engine/checkpoint.hpp.
#include "moe_engine/checkpoint.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "io/glu_rows.hpp"
#include "moe_engine/error.hpp"

namespace moe {
namespace {

// PREFIX...weight or PREFIX...bias: a packed expert tensor's key, or an indexed key's base.
bool is_packed_key(std::string_view key, std::string_view prefix) {
  return key.starts_with(prefix) && (key.ends_with(".weight") || key.ends_with(".bias"));
}

bool is_bias(std::string_view key) { return key.ends_with(".bias"); }

// "PREFIXstem.weight7" -> ("PREFIXstem.weight", 7); nullopt if the key is not an indexed
// expert tensor under the prefix.
std::optional<std::pair<std::string, int64_t>> indexed_key(const std::string& key, const std::string& prefix) {
  size_t digits = key.size();
  while (digits > 0 && key[digits - 1] >= '0' && key[digits - 1] <= '9') --digits;
  if (digits == key.size() || key.size() - digits > 9) return std::nullopt;
  if (key.size() - digits > 1 && key[digits] == '0') return std::nullopt;  // "weight01" is no index
  const std::string base = key.substr(0, digits);
  if (!is_packed_key(base, prefix)) return std::nullopt;
  return std::make_pair(base, std::stoll(key.substr(digits)));
}

// The rows of one expert's tensor (dim 0 of [N, K] or [N]) reordered from GLU layout `from` to `to`.
std::vector<uint8_t> permute_rows(std::span<const uint8_t> bytes, int64_t rows, const CheckpointConversion& c,
                                  const std::string& what) {
  if (!c.glu_from || !c.glu_to) return {bytes.begin(), bytes.end()};
  return detail::permute_glu_rows(bytes, rows, *c.glu_from, *c.glu_to, ErrorCode::kIo, what);
}

}  // namespace

ConvertedCheckpoint convert_checkpoint(const SafetensorsFile& in, const CheckpointConversion& c) {
  MOE_CHECK(c.experts >= 1, ErrorCode::kInvalidArgument, "checkpoint conversion: experts must be >= 1, got ",
            c.experts);
  MOE_CHECK(c.glu_from.has_value() == c.glu_to.has_value(), ErrorCode::kInvalidArgument,
            "checkpoint conversion: give both GLU layouts (from and to) or neither");
  const int64_t G = c.experts;
  const std::string& src = in.source();
  ConvertedCheckpoint out;
  out.metadata = in.metadata();

  // Per-expert groups: base key -> index -> entry.
  std::map<std::string, std::map<int64_t, const SafetensorsEntry*>> groups;
  for (const SafetensorsEntry& e : in.entries())
    if (auto k = indexed_key(e.name, c.prefix)) {
      MOE_CHECK(groups[k->first].emplace(k->second, &e).second, ErrorCode::kIo, src, ": '", e.name, "' twice");
    }
  std::set<std::string> emitted;
  for (const SafetensorsEntry& e : in.entries()) {
    const auto k = indexed_key(e.name, c.prefix);
    if (k) {
      const std::string& base = k->first;
      if (!emitted.insert(base).second) continue;  // the group went out with its first member
      const auto& members = groups.at(base);
      for (int64_t g = 0; g < G; ++g)
        MOE_CHECK(members.count(g), ErrorCode::kIo, src, ": group '", base, "' has no expert ", g, " ('", base,
                  g, "') of ", G);
      MOE_CHECK(int64_t(members.size()) == G, ErrorCode::kIo, src, ": group '", base, "' has ", members.size(),
                " experts ('", base, members.rbegin()->first, "'), expected ", G);
      const SafetensorsEntry& first = *members.at(0);
      for (const auto& [g, m] : members)
        MOE_CHECK(m->dtype == first.dtype && m->shape == first.shape, ErrorCode::kIo, src, ": '", m->name,
                  "' has ", m->dtype, Shape(m->shape.begin(), m->shape.end()).to_string(), ", expert 0 has ",
                  first.dtype, Shape(first.shape.begin(), first.shape.end()).to_string());
      MOE_CHECK(!first.shape.empty(), ErrorCode::kIo, src, ": '", first.name, "' is a scalar, not an expert tensor");
      MOE_CHECK(!in.find(base), ErrorCode::kIo, src, ": both '", base, "' and its per-expert keys are present");
      const int64_t rows = first.shape[0];
      if (c.to == ExpertLayout::kPacked) {
        OwnedTensorRecord r{base, first.dtype, {G}, {}};
        r.shape.insert(r.shape.end(), first.shape.begin(), first.shape.end());
        for (int64_t g = 0; g < G; ++g) {
          const std::vector<uint8_t> b = permute_rows(in.bytes(*members.at(g)), rows, c, members.at(g)->name);
          r.data.insert(r.data.end(), b.begin(), b.end());
        }
        out.tensors.push_back(std::move(r));
        out.converted.push_back(base);
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const SafetensorsEntry& m = *members.at(g);
          out.tensors.push_back({m.name, m.dtype, m.shape, permute_rows(in.bytes(m), rows, c, m.name)});
        }
        if (c.glu_from) out.converted.push_back(base);
      }
      continue;
    }
    if (is_packed_key(e.name, c.prefix) && !groups.count(e.name)) {
      // A packed group: [G, N, K] / [G, N], or [G*N, K] / [G*N].
      const bool bias = is_bias(e.name);
      const size_t expert_rank = bias ? 1 : 2;
      std::vector<int64_t> expert_shape;
      if (e.shape.size() == expert_rank + 1 && e.shape[0] == G) {
        expert_shape.assign(e.shape.begin() + 1, e.shape.end());
      } else if (!c.prefix.empty() && e.shape.size() == expert_rank && e.shape[0] > 0 && e.shape[0] % G == 0) {
        // The flattened form is taken only under an explicit prefix: without one, any weight with
        // G | rows (a router, say) would look like it.
        expert_shape = e.shape;
        expert_shape[0] /= G;
      } else if (c.prefix.empty()) {
        out.tensors.push_back({e.name, e.dtype, e.shape, {in.bytes(e).begin(), in.bytes(e).end()}});
        continue;  // without a prefix, a tensor that does not look packed is not an expert group
      } else {
        throw_error(ErrorCode::kIo, src, ": '", e.name, "' has shape ", Shape(e.shape.begin(), e.shape.end()).to_string(),
                    ", which does not split into ", G, " experts");
      }
      const std::span<const uint8_t> all = in.bytes(e);
      const size_t expert_bytes = all.size() / size_t(G);
      const int64_t rows = expert_shape[0];
      if (c.to == ExpertLayout::kPerExpert) {
        for (int64_t g = 0; g < G; ++g)
          out.tensors.push_back({e.name + std::to_string(g), e.dtype, expert_shape,
                                 permute_rows(all.subspan(size_t(g) * expert_bytes, expert_bytes), rows, c,
                                              e.name)});
        out.converted.push_back(e.name);
      } else {
        OwnedTensorRecord r{e.name, e.dtype, e.shape, {}};
        for (int64_t g = 0; g < G; ++g) {
          const std::vector<uint8_t> b = permute_rows(all.subspan(size_t(g) * expert_bytes, expert_bytes), rows, c, e.name);
          r.data.insert(r.data.end(), b.begin(), b.end());
        }
        out.tensors.push_back(std::move(r));
        if (c.glu_from) out.converted.push_back(e.name);
      }
      continue;
    }
    const std::span<const uint8_t> b = in.bytes(e);
    out.tensors.push_back({e.name, e.dtype, e.shape, {b.begin(), b.end()}});
  }
  return out;
}

void save_safetensors(const std::string& path, const ConvertedCheckpoint& checkpoint) {
  std::vector<SafetensorsRecord> records;
  records.reserve(checkpoint.tensors.size());
  for (const OwnedTensorRecord& t : checkpoint.tensors) records.push_back({t.name, t.dtype, t.shape, t.data});
  save_safetensors(path, records, checkpoint.metadata);
}

}  // namespace moe
