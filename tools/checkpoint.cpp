// moe-engine checkpoint info | convert: safetensors inspection and expert layout conversion.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "moe_engine/moe_engine.hpp"

namespace moe::tools {

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
  for (const auto& [k, v] : f.metadata()) std::printf("  metadata %s = %s\n", k.c_str(), v.c_str());
  for (const SafetensorsEntry& e : f.entries())
    std::printf("  %-48s %-8s %s\n", e.name.c_str(), e.dtype.c_str(),
                Shape(e.shape.begin(), e.shape.end()).to_string().c_str());
  return 0;
}

int run_checkpoint_convert(const CheckpointOptions& o) {
  CheckpointConversion c;
  c.experts = o.experts;
  c.to = parse_expert_layout(o.to);
  c.prefix = o.prefix;
  // Only one of the two is an error, reported by convert_checkpoint.
  if (!o.glu_from.empty()) c.glu_from = GluLayout::parse(o.glu_from);
  if (!o.glu_to.empty()) c.glu_to = GluLayout::parse(o.glu_to);
  const SafetensorsFile in = SafetensorsFile::load(o.input);
  const ConvertedCheckpoint out = convert_checkpoint(in, c);
  save_safetensors(o.output, out);
  std::printf("%s -> %s: %zu tensors, %zu groups converted to %s%s\n", o.input.c_str(), o.output.c_str(),
              out.tensors.size(), out.converted.size(), o.to.c_str(),
              c.glu_from ? (" (GLU " + c.glu_from->name() + " -> " + c.glu_to->name() + ")").c_str() : "");
  for (const std::string& g : out.converted) std::printf("  %s\n", g.c_str());
  return 0;
}

}  // namespace moe::tools
