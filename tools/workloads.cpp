#include "workloads.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>

#include "json_io.hpp"
#include "moe_engine/error.hpp"
#include "moe_engine/glu_spec.hpp"

#ifndef MOE_ENGINE_SOURCE_DIR
#define MOE_ENGINE_SOURCE_DIR "."
#endif
#ifndef MOE_ENGINE_INSTALLED_WORKLOADS
#define MOE_ENGINE_INSTALLED_WORKLOADS ""
#endif

namespace moe::tools {

int64_t Workload::routed_tokens() const {
  return std::accumulate(tokens_per_expert.begin(), tokens_per_expert.end(), int64_t(0));
}

int64_t Workload::fc1_rows() const { return fc1_width(GluSpec{parse_activation(activation)}, ffn); }

double Workload::mlp_flops() const {
  return 3.0 * 2.0 * double(routed_tokens()) * double(fc1_rows() * hidden + hidden * ffn);
}

Workload tiny_workload() {
  Workload w;
  w.name = "tiny";
  w.experts = 4;
  w.hidden = 256;
  w.ffn = 192;
  w.tokens_per_expert = {160, 0, 1, 351};
  w.capacity = 544;
  w.activation = "swiglu";
  w.bias = true;
  return w;
}

std::string find_workloads_file(const std::string& explicit_path) {
  namespace fs = std::filesystem;
  if (!explicit_path.empty()) return explicit_path;
  if (const char* env = std::getenv("MOE_ENGINE_WORKLOADS")) return env;
  for (const std::string& candidate :
       {std::string(MOE_ENGINE_INSTALLED_WORKLOADS),
        std::string(MOE_ENGINE_SOURCE_DIR) + "/bench/workloads.json"})
    if (!candidate.empty() && fs::exists(candidate)) return candidate;
  throw_error(ErrorCode::kIo,
              "cannot find bench/workloads.json; pass --workloads PATH or set "
              "MOE_ENGINE_WORKLOADS");
}

std::vector<Workload> load_workloads(const std::string& path) {
  const nlohmann::json doc = read_json_file(path, "the workloads file");
  try {
    std::vector<Workload> out;
    for (const auto& c : doc.at("cases")) {
      Workload w;
      w.name = c.at("name").get<std::string>();
      w.experts = c.at("experts").get<int64_t>();
      w.hidden = c.at("hidden").get<int64_t>();
      w.ffn = c.at("ffn").get<int64_t>();
      w.tokens_per_expert = c.at("tokens_per_expert").get<std::vector<int64_t>>();
      w.capacity = c.at("tokens").get<int64_t>();
      w.activation = c.at("activation").get<std::string>();
      w.bias = c.at("bias").get<bool>();
      MOE_CHECK(w.experts >= 1 && w.hidden >= 1 && w.ffn >= 1, ErrorCode::kIo, "workload '", w.name,
                "': experts, hidden and ffn must be >= 1, got ", w.experts, ", ", w.hidden, ", ", w.ffn);
      for (int64_t n : w.tokens_per_expert)
        MOE_CHECK(n >= 0, ErrorCode::kIo, "workload '", w.name, "': tokens_per_expert has the negative entry ", n);
      MOE_CHECK(int64_t(w.tokens_per_expert.size()) == w.experts, ErrorCode::kIo, "workload '",
                w.name, "': tokens_per_expert has ", w.tokens_per_expert.size(),
                " entries, expected ", w.experts);
      MOE_CHECK(w.routed_tokens() <= w.capacity, ErrorCode::kIo, "workload '", w.name,
                "': tokens_per_expert sums past tokens");
      out.push_back(std::move(w));
    }
    return out;
  } catch (const nlohmann::json::exception& e) {
    throw_error(ErrorCode::kIo, "malformed workloads file '", path, "': ", e.what());
  }
}

Workload find_workload(const std::string& name, const std::string& workloads_path) {
  if (name == "tiny") return tiny_workload();
  const std::vector<Workload> all = load_workloads(find_workloads_file(workloads_path));
  std::vector<const Workload*> hits;
  for (const Workload& w : all) {
    if (w.name == name) return w;
    if (w.name.find(name) != std::string::npos) hits.push_back(&w);
  }
  if (hits.size() == 1) return *hits.front();
  std::string names = "tiny";
  for (const Workload& w : all) names += ", " + w.name;
  throw_error(ErrorCode::kInvalidArgument, "case '", name, "' ",
              hits.empty() ? "matches no case" : "is ambiguous", "; the cases are: ", names);
}

}  // namespace moe::tools
