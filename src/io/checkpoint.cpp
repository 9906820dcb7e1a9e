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

// The rows of one expert's tensor (dim 0 of [N, K] or [N]), reordered from GLU layout `from` to
// `to` when `glu` (an FC1 group under a GLU change), else copied.
std::vector<uint8_t> expert_rows(std::span<const uint8_t> bytes, int64_t rows, const CheckpointConversion& c,
                                 bool glu, const std::string& what) {
  if (!glu) return {bytes.begin(), bytes.end()};
  return detail::permute_glu_rows(bytes, rows, *c.glu_from, *c.glu_to, ErrorCode::kIo, what);
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "'" : ", '") + n + "'";
  return out;
}

}  // namespace

bool is_fc1_group(const std::string& group, const std::string& prefix) {
  std::string_view module = group;
  for (std::string_view suffix : {".weight", ".bias"})
    if (module.ends_with(suffix)) {
      module.remove_suffix(suffix.size());
      break;
    }
  const size_t dot = module.rfind('.');
  const std::string_view name = dot == std::string_view::npos ? module : module.substr(dot + 1);
  if (name == "linear_fc1" || name == "fc1") return true;
  return !prefix.empty() && (prefix == module || (prefix.ends_with('.') && prefix.substr(0, prefix.size() - 1) == module));
}

ConvertedCheckpoint convert_checkpoint(const SafetensorsFile& in, const CheckpointConversion& c) {
  MOE_CHECK(c.experts >= 1, ErrorCode::kInvalidArgument, "checkpoint conversion: experts must be >= 1, got ",
            c.experts);
  MOE_CHECK(c.glu_from.has_value() == c.glu_to.has_value(), ErrorCode::kInvalidArgument,
            "checkpoint conversion: give both GLU layouts (from and to) or neither");
  const int64_t G = c.experts;
  const std::string& src = in.source();
  ConvertedCheckpoint out;
  out.metadata = in.metadata();
  // Whether a group's rows change: an FC1 group under a change of GLU layout (recorded as it is
  // decided). A GLU request finding no FC1 group is an error below, even when from == to.
  bool fc1_found = false;
  auto reorders = [&](const std::string& group) {
    if (!c.glu_from || !is_fc1_group(group, c.prefix)) return false;
    fc1_found = true;
    if (*c.glu_from == *c.glu_to) return false;
    out.glu_reordered.push_back(group);
    return true;
  };
  for (const SafetensorsEntry& e : in.entries()) out.keys_under_prefix += e.name.starts_with(c.prefix);

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
      const bool glu = reorders(base);
      if (c.to == ExpertLayout::kPacked) {
        OwnedTensorRecord r{base, first.dtype, {G}, {}};
        r.shape.insert(r.shape.end(), first.shape.begin(), first.shape.end());
        for (int64_t g = 0; g < G; ++g) {
          const std::vector<uint8_t> b = expert_rows(in.bytes(*members.at(g)), rows, c, glu, members.at(g)->name);
          r.data.insert(r.data.end(), b.begin(), b.end());
        }
        out.tensors.push_back(std::move(r));
        out.converted.push_back(base);
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const SafetensorsEntry& m = *members.at(g);
          out.tensors.push_back({m.name, m.dtype, m.shape, expert_rows(in.bytes(m), rows, c, glu, m.name)});
        }
        out.already_in_layout.push_back(base);
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
      const bool glu = reorders(e.name);
      auto expert = [&](int64_t g) {
        return expert_rows(all.subspan(size_t(g) * expert_bytes, expert_bytes), rows, c, glu, e.name);
      };
      if (c.to == ExpertLayout::kPerExpert) {
        for (int64_t g = 0; g < G; ++g)
          out.tensors.push_back({e.name + std::to_string(g), e.dtype, expert_shape, expert(g)});
        out.converted.push_back(e.name);
      } else {
        OwnedTensorRecord r{e.name, e.dtype, e.shape, {}};
        for (int64_t g = 0; g < G; ++g) {
          const std::vector<uint8_t> b = expert(g);
          r.data.insert(r.data.end(), b.begin(), b.end());
        }
        out.tensors.push_back(std::move(r));
        out.already_in_layout.push_back(e.name);
      }
      continue;
    }
    const std::span<const uint8_t> b = in.bytes(e);
    out.tensors.push_back({e.name, e.dtype, e.shape, {b.begin(), b.end()}});
  }
  if (c.glu_from && !fc1_found) {
    std::vector<std::string> found = out.converted;
    found.insert(found.end(), out.already_in_layout.begin(), out.already_in_layout.end());
    throw_error(ErrorCode::kInvalidArgument, src, ": a GLU layout change reorders FC1 rows, but no expert group",
                c.prefix.empty() ? std::string() : " under prefix '" + c.prefix + "'",
                " is an FC1 group (module named linear_fc1 or fc1, or the module the prefix names exactly); ",
                found.empty() ? std::string("no expert group was found") : "groups found: " + join(found));
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
