// The CLI's JSON files (workloads, anchors, results) through the library's checked file access
// (io/file.hpp): bad paths and malformed JSON are moe::Error (kIo) naming the file.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "io/file.hpp"
#include "moe_engine/error.hpp"

namespace moe::tools {

// `what` names the file's role, e.g. "the workloads file".
inline nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  const std::vector<uint8_t> bytes = detail::read_file(path, "a JSON file (" + what + ")");
  nlohmann::json doc = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, false);
  MOE_CHECK(!doc.is_discarded(), ErrorCode::kIo, what, " '", path, "' is not valid JSON");
  return doc;
}

inline void check_json_output_path(const std::string& path, const std::string& what) {
  detail::check_output_path(path, "a JSON file (" + what + ")");
}

inline void write_json_file(const std::string& path, const nlohmann::json& doc, const std::string& what) {
  const std::string text = doc.dump(1) + "\n";
  detail::write_file(path, {reinterpret_cast<const uint8_t*>(text.data()), text.size()}, "a JSON file (" + what + ")");
}

}  // namespace moe::tools
