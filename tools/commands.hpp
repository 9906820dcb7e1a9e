// The moe-engine subcommands. Each returns the process exit code.
#pragma once

#include <cstdint>
#include <string>

namespace moe::tools {

// Exit codes: 0 success; 1 an error (a "moe-engine ... error:" message on stderr); 2 a command line
// that does not parse (wrong option, bad value); 3 a correctness check failed (bench's comparison
// with the fp64 oracle, `check`).
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitCheckFailed = 3;

struct InfoOptions {
  bool json = false;
};
int run_info(const InfoOptions& options);

struct BenchOptions {
  std::string kind = "mlp";        // what to benchmark: mlp, gemm or layer
  std::string case_name = "tiny";  // a workload of bench/workloads.json or "tiny"
  std::string device = "auto";     // auto | cpu | cuda[:N]
  std::string dtype = "bfloat16";
  std::string glu_layout = "halves";
  std::string activation;  // mlp: overrides the case's activation (empty: the case's)
  std::string workloads;  // path override
  int warmup = 1;
  int iters = 0;  // 0: a default that suits the device
  uint64_t seed = 1;
  bool check = true;  // compare with the float64 oracle when small enough
  bool force = false;  // mlp, layer: run a CPU benchmark estimated to take long
  bool json = false;
  bool list = false;         // list the cases and exit
  std::string fusion = "forward";  // mlp: none | forward | all (ExpertMlpSpec::fusion)
  bool recompute = false;    // mlp: keep only x; backward recomputes FC1
  bool vs_unfused = false;   // mlp: also time the unfused path, alternating with the fused one
  bool vs_bf16 = false;      // mlp --dtype fp8: also time the bf16 MLP (--fusion), alternating
  std::string anchor;        // gemm: torch_anchor.py's JSON from the same device run
  std::string json_out;      // gemm: write the results as JSON to this file
  std::string gemm_filter;   // gemm: only this GEMM ("fc2/wgrad"); empty: all
  double min_time_ms = 100;  // gemm: time each GEMM at least this long (warm up a quarter of it)
  double settle_ms = 2000;   // gemm: run a dense GEMM this long first (steady power state)
  double l2_flush_mb = 256;  // gemm, mlp (CUDA): zero this many MB before each timed run (do_bench's L2 flush)
  bool l2_flush_given = false;  // --l2-flush-mb was on the command line (an error where nothing is flushed)
  std::string command_line;  // recorded in the JSON
};
int run_bench(const BenchOptions& options);
int run_bench_gemm(const BenchOptions& options);
int run_bench_layer(const BenchOptions& options);

struct CheckpointOptions {
  std::string input, output;
  bool json = false;
  int64_t experts = 0;
  std::string to;  // packed | per-expert
  std::string prefix, glu_from, glu_to;
};
int run_checkpoint_info(const CheckpointOptions& options);
int run_checkpoint_convert(const CheckpointOptions& options);

struct CheckOptions {
  bool json = false;
  uint64_t seed = 7;
};
int run_check(const CheckOptions& options);

}  // namespace moe::tools
