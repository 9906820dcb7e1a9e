// Benchmark cases: bench/workloads.json (the suite shared with the anchors) plus the built-in
// `tiny` case that runs anywhere, the CPU backend included.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::tools {

struct Workload {
  std::string name;     // "qwen3-30b-a3b/balanced" or "tiny"
  int64_t experts = 0;  // G
  int64_t hidden = 0;   // H
  int64_t ffn = 0;      // F
  std::vector<int64_t> tokens_per_expert;
  int64_t capacity = 0;    // T: rows of the token buffer (>= the routed tokens)
  std::string activation;  // "swiglu", "clamped_qgeglu" (GLUs), "srelu" or "gelu_tanh"
  bool bias = false;
  // Optional in the file (bench layer reads them): "qwen3-30b-a3b", "balanced", "8192 tokens x top-8".
  std::string model, routing, note;

  int64_t routed_tokens() const;
  // FC1's rows W: 2F for a GLU, F for a non-gated activation (moe::fc1_width).
  int64_t fc1_rows() const;
  // FLOPs of the expert MLP forward + backward: 3 passes x 2 x tokens x (W*H + H*F).
  double mlp_flops() const;
};

// Odd on purpose: an empty and a 1-row expert, sizes off every tile, 32 buffer rows past the end.
Workload tiny_workload();

// Where workloads.json is: the --workloads path if given, else $MOE_ENGINE_WORKLOADS, else the
// installed copy, else the source tree's.
std::string find_workloads_file(const std::string& explicit_path);
// Every case of the file, checked: the integer fields are whole numbers (1.5 is an error, not 1),
// experts, hidden and ffn >= 1, tokens >= 0, tokens_per_expert has `experts` entries >= 0 whose
// sum is > 0 (a case that routes no token would time nothing) and <= tokens (no int64 overflow),
// the tensors' element counts fit, the activation is known, and the names are unique and not the
// built-in `tiny`. An error (kIo) names the file and the case.
std::vector<Workload> load_workloads(const std::string& path);
// "tiny", an exact case name, or a unique substring of one. An explicit `workloads_path` is loaded
// and checked even for `tiny`, which does not read it (a bad path is an error, not ignored).
Workload find_workload(const std::string& name, const std::string& workloads_path);

}  // namespace moe::tools
