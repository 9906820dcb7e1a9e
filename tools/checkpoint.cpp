// moe-engine checkpoint info | convert: safetensors inspection and expert layout conversion.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "io/file.hpp"
#include "moe_engine/moe_engine.hpp"

namespace moe::tools {
namespace {

// A name (or metadata text) as the text listing shows it: as it is, or, where printing it raw would
// hide or garble part of it (empty, a control character such as an embedded NUL, which printf
// would cut it at, or a leading quote), quoted and escaped as a JSON string: "x\u0000y", as --json
// shows it.
std::string shown(const std::string& text) {
  bool plain = !text.empty() && text.front() != '"';
  for (const char ch : text) plain &= static_cast<unsigned char>(ch) >= 0x20 && ch != 0x7f;
  return plain ? text : nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

int run_checkpoint_info(const CheckpointOptions& o) {
  const SafetensorsFile f = SafetensorsFile::load(o.input);
  if (o.json) {
    nlohmann::ordered_json j;
    j["file"] = o.input;
    j["metadata"] = f.metadata();
    j["tensors"] = nlohmann::ordered_json::array();
    for (const SafetensorsEntry& e : f.entries())
      j["tensors"].push_back({{"name", e.name}, {"dtype", e.dtype}, {"shape", e.shape}, {"bytes", e.end - e.begin}});
    std::cout << j.dump(1) << "\n";
    return 0;
  }
  std::printf("%s: %zu tensors\n", o.input.c_str(), f.entries().size());
  for (const auto& [k, v] : f.metadata()) std::printf("  metadata %s = %s\n", shown(k).c_str(), shown(v).c_str());
  for (const SafetensorsEntry& e : f.entries())
    std::printf("  %-48s %-8s %s\n", shown(e.name).c_str(), shown(e.dtype).c_str(),
                Shape(e.shape.begin(), e.shape.end()).to_string().c_str());
  return 0;
}

namespace {

// "'a' [3, 2, 4], 'b' [3, 4]": groups with the shape of their first tensor in the input.
std::string describe_groups(const SafetensorsFile& in, const std::vector<std::string>& groups) {
  std::string out;
  for (const std::string& g : groups) {
    const SafetensorsEntry* e = in.find(g);
    if (!e) e = in.find(g + "0");
    out += out.empty() ? "'" : ", '";
    out += g;
    out += "'";
    if (!e) continue;
    out += ' ';
    out += Shape(e->shape.begin(), e->shape.end()).to_string();
    if (!in.find(g)) out += " per expert";
  }
  return out;
}

// What a conversion that changed nothing found, for its error message.
std::string nothing_converted(const SafetensorsFile& in, const CheckpointConversion& c, const ConvertedCheckpoint& out) {
  const std::string to = c.to == ExpertLayout::kPacked ? "packed" : "per-expert";
  if (!out.already_in_layout.empty())
    return "the expert groups are " + to + " already: " + describe_groups(in, out.already_in_layout) +
           "; convert with --to " + (c.to == ExpertLayout::kPacked ? "per-expert" : "packed") +
           ", or reorder FC1 rows with --glu-from/--glu-to";
  if (!c.prefix.empty() && out.keys_under_prefix == 0) {
    std::string keys;
    size_t shown = 0;
    for (const SafetensorsEntry& e : in.entries())
      if (shown++ < 4) keys += (keys.empty() ? "'" : ", '") + e.name + "'";
    if (in.entries().size() > 4) keys += ", ...";
    return "no tensor key starts with the prefix '" + c.prefix + "' (the keys are " +
           (keys.empty() ? std::string("none") : keys) + ")";
  }
  return std::to_string(out.keys_under_prefix) + " tensor(s)" +
         (c.prefix.empty() ? std::string() : " under the prefix '" + c.prefix + "'") +
         " but no expert group: expected per-expert keys P.weight0 .. P.weight" + std::to_string(c.experts - 1) +
         " (and P.bias0 ..) or packed P.weight [" + std::to_string(c.experts) +
         ", N, K] (P.bias [" + std::to_string(c.experts) + ", N])";
}

}  // namespace

int run_checkpoint_convert(const CheckpointOptions& o) {
  CheckpointConversion c;
  c.experts = o.experts;
  c.to = parse_expert_layout(o.to);
  c.prefix = o.prefix;
  // Only one of the two is an error, reported by convert_checkpoint.
  if (!o.glu_from.empty()) c.glu_from = GluLayout::parse(o.glu_from);
  if (!o.glu_to.empty()) c.glu_to = GluLayout::parse(o.glu_to);
  // A bad output path fails now, not after a large checkpoint was read and converted.
  detail::check_output_path(o.output, "a safetensors file");
  const SafetensorsFile in = SafetensorsFile::load(o.input);
  const ConvertedCheckpoint out = convert_checkpoint(in, c);
  MOE_CHECK(out.changed(), ErrorCode::kInvalidArgument, "checkpoint convert: nothing to convert in '", o.input,
            "': ", nothing_converted(in, c, out), "; nothing was written");
  save_safetensors(o.output, out);
  std::printf("%s -> %s: %zu tensors\n", o.input.c_str(), o.output.c_str(), out.tensors.size());
  auto list = [](const char* what, const std::vector<std::string>& groups) {
    if (groups.empty()) return;
    std::printf("%s:\n", what);
    for (const std::string& g : groups) std::printf("  %s\n", shown(g).c_str());
  };
  list(("converted to " + o.to).c_str(), out.converted);
  list(("already " + o.to + ", copied").c_str(), out.already_in_layout);
  if (c.glu_from)
    list(("FC1 rows reordered from GLU layout " + c.glu_from->name() + " to " + c.glu_to->name()).c_str(),
         out.glu_reordered);
  return 0;
}

}  // namespace moe::tools
