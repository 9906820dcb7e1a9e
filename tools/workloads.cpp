#include "workloads.hpp"

#include <algorithm>
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

namespace {

// An integer of a case: a JSON whole number within int64 (1.5, "8", true and 2^63 are errors;
// nlohmann's get<int64_t> would truncate or wrap them).
int64_t whole_number(const nlohmann::json& v, const std::string& where, const std::string& field) {
  const bool fits = v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX));
  MOE_CHECK(fits, ErrorCode::kIo, where, ": ", field, " must be a whole number",
            v.is_number_integer() ? " within int64" : "", ", got ", v.dump());
  return v.get<int64_t>();
}

}  // namespace

std::vector<Workload> load_workloads(const std::string& path) {
  const nlohmann::json doc = read_json_file(path, "the workloads file");
  const std::string file = "the workloads file '" + path + "'";
  try {
    const nlohmann::json& cases = doc.at("cases");
    MOE_CHECK(cases.is_array(), ErrorCode::kIo, file, ": \"cases\" must be an array, got ", cases.type_name());
    std::vector<Workload> out;
    for (const auto& c : cases) {
      Workload w;
      w.name = c.at("name").get<std::string>();
      const std::string where = file + ", case '" + w.name + "'";
      MOE_CHECK(!w.name.empty(), ErrorCode::kIo, file, ": a case has an empty name");
      MOE_CHECK(w.name != tiny_workload().name, ErrorCode::kIo, where,
                ": the name is the built-in case's (bench --case tiny runs that one); rename the case");
      for (const Workload& earlier : out)
        MOE_CHECK(earlier.name != w.name, ErrorCode::kIo, where, ": two cases have this name; names must be unique");
      w.experts = whole_number(c.at("experts"), where, "experts");
      w.hidden = whole_number(c.at("hidden"), where, "hidden");
      w.ffn = whole_number(c.at("ffn"), where, "ffn");
      w.capacity = whole_number(c.at("tokens"), where, "tokens");
      MOE_CHECK(w.experts >= 1 && w.hidden >= 1 && w.ffn >= 1, ErrorCode::kIo, where,
                ": experts, hidden and ffn must be >= 1, got ", w.experts, ", ", w.hidden, ", ", w.ffn);
      MOE_CHECK(w.capacity >= 0, ErrorCode::kIo, where, ": tokens (the rows of the token buffer) must be >= 0, got ",
                w.capacity);
      const nlohmann::json& splits = c.at("tokens_per_expert");
      MOE_CHECK(splits.is_array(), ErrorCode::kIo, where, ": tokens_per_expert must be an array, got ", splits.dump());
      MOE_CHECK(int64_t(splits.size()) == w.experts, ErrorCode::kIo, where, ": tokens_per_expert has ", splits.size(),
                " entries, expected ", w.experts, " (experts)");
      int64_t sum = 0;
      for (size_t i = 0; i < splits.size(); ++i) {
        const int64_t n = whole_number(splits[i], where, "tokens_per_expert[" + std::to_string(i) + "]");
        MOE_CHECK(n >= 0, ErrorCode::kIo, where, ": tokens_per_expert has the negative entry ", n, " (at ", i, ")");
        MOE_CHECK(!__builtin_add_overflow(sum, n, &sum), ErrorCode::kIo, where,
                  ": tokens_per_expert sums past the int64 range (at entry ", i, ")");
        w.tokens_per_expert.push_back(n);
      }
      MOE_CHECK(sum > 0, ErrorCode::kIo, where,
                ": tokens_per_expert are all 0: the case routes no token, so a benchmark of it would time nothing");
      MOE_CHECK(sum <= w.capacity, ErrorCode::kIo, where, ": tokens_per_expert sums to ", sum, ", past tokens = ",
                w.capacity);
      w.activation = c.at("activation").get<std::string>();
      bool known = false;
      for (const EnumName<Activation>& n : EnumNames<Activation>::kNames) known |= n.name == w.activation;
      MOE_CHECK(known, ErrorCode::kIo, where, ": unknown activation '", w.activation, "'; expected ",
                enum_choices<Activation>());
      w.bias = c.at("bias").get<bool>();
      w.model = c.value("model", "");
      w.routing = c.value("routing", "");
      w.note = c.value("note", "");
      // The largest tensors (token rows, the weights of all experts) must stay far enough below
      // 2^63 bytes that the sizes and FLOPs computed from them (int64) cannot overflow: 2^55 elements,
      // 256 PiB of float64, more than any machine holds anyway.
      const double rows = double(w.capacity),
                   width = double(fc1_width(GluSpec{parse_activation(w.activation)}, 1)) * double(w.ffn);
      const double largest = std::max({rows * double(w.hidden), rows * width,
                                       double(w.experts) * width * double(w.hidden),
                                       double(w.experts) * double(w.hidden) * double(w.ffn)});
      MOE_CHECK(largest <= 0x1p55, ErrorCode::kIo, where, ": a tensor of ", largest,
                " elements (from experts, hidden, ffn and tokens) is past 2^55, more than any machine holds");
      out.push_back(std::move(w));
    }
    return out;
  } catch (const nlohmann::json::exception& e) {
    throw_error(ErrorCode::kIo, "malformed workloads file '", path, "': ", e.what());
  }
}

Workload find_workload(const std::string& name, const std::string& workloads_path) {
  if (name == "tiny") {
    if (!workloads_path.empty()) load_workloads(workloads_path);  // checked, not used
    return tiny_workload();
  }
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
