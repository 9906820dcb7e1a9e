// moe-engine: the command-line front end (info, bench, check, checkpoint).
#include <CLI/CLI.hpp>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "commands.hpp"
#include "moe_engine/moe_engine.hpp"

namespace {

// A finite number in [min, max], with a plain message ("must be >= 0, got -1") instead of CLI11's
// range whose upper bound prints as a 300-digit double.
CLI::Validator number_in(double min, double max = std::numeric_limits<double>::max()) {
  auto text = [](double bound) {
    char out[32];
    std::snprintf(out, sizeof out, "%.15g", bound);
    return std::string(out);
  };
  const std::string low = text(min), high = text(max);
  return CLI::Validator(
      [min, max, low, high](std::string& value) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(value, v) || std::isnan(v)) return "expected a number, got '" + value + "'";
        if (std::isinf(v)) return "expected a finite number, got '" + value + "'";
        if (v < min) return "must be >= " + low + ", got " + value;
        if (v > max) return "must be <= " + high + ", got " + value;
        return {};
      },
      ">=" + low, "at least " + low);
}

// A whole number >= `min` for an int option: "1e3" or "2147483648" get a message saying what is
// expected instead of CLI11's "Could not convert".
CLI::Validator whole_number_at_least(int min) {
  const std::string low = std::to_string(min), high = std::to_string(std::numeric_limits<int>::max());
  return CLI::Validator(
      [min, low, high](std::string& value) -> std::string {
        int64_t v = 0;
        const char* end = value.data() + value.size();
        const auto [ptr, ec] = std::from_chars(value.data(), end, v);
        if (ec == std::errc::result_out_of_range)
          return (value.front() == '-' ? "must be >= " + low : "must be <= " + high) + ", got " + value;
        if (ec != std::errc() || ptr != end) {
          double d = 0;
          const bool number = CLI::detail::lexical_cast(value, d) && !std::isnan(d);
          return (number ? "expected a whole number, got '" : "expected a number, got '") + value + "'";
        }
        if (v < min) return "must be >= " + low + ", got " + value;
        if (v > std::numeric_limits<int>::max()) return "must be <= " + high + ", got " + value;
        return {};
      },
      ">=" + low, "at least " + low);
}

// A seed: 0 .. 2^64 - 1 in decimal digits (CLI11 would wrap -1 and saturate larger values without a
// word).
CLI::Validator seed_value() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        uint64_t v = 0;
        const char* end = value.data() + value.size();
        const auto [ptr, ec] = std::from_chars(value.data(), end, v);
        if (value.empty() || !std::isdigit(static_cast<unsigned char>(value.front())) || ec != std::errc() ||
            ptr != end)
          return "expected a whole number from 0 to " + std::to_string(std::numeric_limits<uint64_t>::max()) +
                 ", got '" + value + "'";
        return {};
      },
      "0..2^64-1", "seed");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moe::tools;
  CLI::App app{"moe-engine " MOE_ENGINE_VERSION
               ": grouped GEMMs and fused expert MLPs for Mixture-of-Experts training"};
  app.require_subcommand(1);
  app.set_version_flag("--version", MOE_ENGINE_VERSION);

  InfoOptions info;
  CLI::App* info_cmd =
      app.add_subcommand("info", "Version, build options and the GPUs this process sees");
  info_cmd->add_flag("--json", info.json, "Print JSON");

  BenchOptions bench;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench",
      "mlp: time the expert MLP forward+backward on a case and check it against the fp64 oracle; "
      "gemm: time the six grouped GEMMs of every case on a GPU; "
      "layer: time the whole MoE layer forward+backward per model of the suite, by stage");
  bench_cmd->add_option("kind", bench.kind, "mlp, gemm or layer")
      ->check(CLI::IsMember({"mlp", "gemm", "layer"}))
      ->capture_default_str();
  bench_cmd->add_option("--case", bench.case_name,
                        "mlp: 'tiny' (default) or a case of bench/workloads.json (or a unique part "
                        "of its name); gemm: 'all' (default) or a part of case names; layer: 'all' "
                        "(default on a GPU), 'tiny' (default on the CPU) or a part of model names");
  bench_cmd
      ->add_option("--device", bench.device,
                   "auto (a GPU when the CUDA backend runs the op, else the CPU), cpu, cuda[:N]")
      ->capture_default_str();
  bench_cmd->add_option("--dtype", bench.dtype,
                        "bfloat16, float16 or float32; also fp8: block-scaled E4M3 GEMMs (gemm: beside bf16; mlp: the FP8 "
                        "expert MLP, bf16 activations)")
      ->capture_default_str();
  bench_cmd->add_option("--glu-layout", bench.glu_layout, "halves, pairs or blocks:S")
      ->capture_default_str();
  bench_cmd->add_option("--activation", bench.activation,
                        "mlp: the activation instead of the case's: swiglu, clamped_qgeglu (GLUs: FC1 has 2F rows) or "
                        "srelu, gelu_tanh (non-gated: F rows)");
  bench_cmd->add_option("--workloads", bench.workloads, "Path of workloads.json");
  bench_cmd->add_option("--warmup", bench.warmup, "Untimed runs first")
      ->check(whole_number_at_least(0))
      ->capture_default_str();
  bench_cmd->add_option("--iters", bench.iters, "Timed runs (median reported; 0 = device default)")
      ->check(whole_number_at_least(0))
      ->capture_default_str();
  bench_cmd->add_option("--seed", bench.seed, "Seed of the random inputs (0 .. 2^64-1)")
      ->check(seed_value())
      ->capture_default_str();
  bool no_check = false;
  bench_cmd->add_flag("--no-check", no_check, "Skip the comparison with the fp64 oracle");
  bench_cmd->add_flag("--force", bench.force,
                      "mlp, layer: run on the CPU even when the estimate says it takes more than a few minutes");
  bench_cmd->add_flag("--json", bench.json, "Print JSON only");
  bench_cmd->add_flag("--list", bench.list, "List the cases (of --workloads) and exit; takes no other option");
  bench_cmd->add_option("--fusion", bench.fusion, "mlp: fused steps on CUDA: none, forward or all")
      ->capture_default_str();
  bench_cmd->add_flag("--recompute", bench.recompute, "mlp: keep only x for backward (recompute FC1)");
  bench_cmd->add_flag("--vs-unfused", bench.vs_unfused,
                      "mlp: also time the unfused path (grouped GEMMs + GLU kernels), run by run alternating");
  bench_cmd->add_flag("--vs-bf16", bench.vs_bf16,
                      "mlp --dtype fp8: also time the bf16 MLP (with --fusion) on the same inputs, run by run "
                      "alternating");
  bench_cmd->add_option("--anchor", bench.anchor,
                        "gemm: JSON of the anchor script from the same run (torch_anchor.py; with "
                        "--dtype fp8, bench/drivers/fp8-anchor.py)");
  bench_cmd->add_option("--gemm", bench.gemm_filter,
                        "gemm: only this GEMM of each case: fc1|fc2 / fwd|dgrad|wgrad|wgrad_acc, e.g. fc2/wgrad");
  bench_cmd->add_option("--min-time-ms", bench.min_time_ms,
                        "gemm: time each GEMM at least this long (0 with --iters 1: one run, for profilers)")
      ->check(number_in(0))
      ->capture_default_str();
  bench_cmd->add_option("--settle-ms", bench.settle_ms,
                        "gemm: first run a dense GEMM this long, so that every timing sees the GPU's "
                        "steady (power-capped) clocks rather than the boost of a cold start")
      ->check(number_in(0))
      ->capture_default_str();
  bench_cmd->add_option("--l2-flush-mb", bench.l2_flush_mb,
                        "gemm, mlp on a GPU: zero this many MB before each timed run, as the anchor's "
                        "do_bench does (0: none; at most 1000000)")
      ->check(number_in(0, 1e6))
      ->capture_default_str();
  bench_cmd->add_option("--json-out", bench.json_out,
                        "gemm: write the results as JSON to this file");

  CheckOptions check;
  CLI::App* check_cmd =
      app.add_subcommand("check", "Run the self-checks of every backend present (CPU, CUDA)");
  check_cmd->add_flag("--json", check.json, "Print JSON");
  check_cmd->add_option("--seed", check.seed, "Seed of the random inputs (0 .. 2^64-1)")
      ->check(seed_value())
      ->capture_default_str();

  CheckpointOptions ckpt;
  CLI::App* ckpt_cmd = app.add_subcommand("checkpoint", "Inspect and convert safetensors checkpoints");
  ckpt_cmd->require_subcommand(1);
  CLI::App* ckpt_info = ckpt_cmd->add_subcommand("info", "List the tensors (name, dtype, shape) and metadata");
  ckpt_info->add_option("file", ckpt.input, "A .safetensors file")->required();
  ckpt_info->add_flag("--json", ckpt.json, "Print JSON");
  CLI::App* ckpt_convert = ckpt_cmd->add_subcommand(
      "convert", "Convert expert tensors between per-expert (P.weight0..) and packed (P.weight) keys");
  ckpt_convert->add_option("input", ckpt.input, "Input .safetensors")->required();
  ckpt_convert->add_option("output", ckpt.output, "Output .safetensors")->required();
  ckpt_convert->add_option("--experts", ckpt.experts, "Number of experts G")->required()->check(number_in(1));
  ckpt_convert->add_option("--to", ckpt.to, "packed or per-expert")
      ->required()
      ->check(CLI::IsMember({"packed", "per-expert"}));
  ckpt_convert->add_option("--prefix", ckpt.prefix, "Only keys starting with this are expert tensors");
  ckpt_convert->add_option("--glu-from", ckpt.glu_from, "GLU layout of the input rows: halves, pairs, blocks:S");
  ckpt_convert->add_option("--glu-to", ckpt.glu_to, "GLU layout of the output rows");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints --help / --version, or the message
    return rc == 0 ? 0 : kExitUsage;
  }
  bench.check = !no_check;
  bench.l2_flush_given = bench_cmd->count("--l2-flush-mb") > 0;
  for (int i = 0; i < argc; ++i) bench.command_line += (i ? " " : "") + std::string(argv[i]);
  // Nothing may end the process past here but a return: every failure is a message and exit 1.
  try {
    if (info_cmd->parsed()) return run_info(info);
    if (bench_cmd->parsed()) {
      if (bench.list) {  // the cases are the same for every kind
        // --list lists and exits: any option but --workloads would be ignored.
        for (const CLI::Option* option : bench_cmd->get_options()) {
          const std::string name = option->get_name();
          MOE_CHECK(option->count() == 0 || name == "--list" || name == "--workloads" || name == "kind",
                    moe::ErrorCode::kInvalidArgument, "bench --list: ", name,
                    " does not apply (--list shows the cases of the workloads file and exits; of the options it "
                    "takes only --workloads)");
        }
        return run_bench(bench);
      }
      // An option of the other kind would be ignored: say so instead.
      const bool gemm = bench.kind == "gemm", layer = bench.kind == "layer";
      const std::vector<std::string> mlp_only = {"--fusion", "--recompute", "--vs-unfused", "--vs-bf16", "--glu-layout",
                                                 "--activation", "--no-check", "--force", "--json"};
      const std::vector<std::string> gemm_only = {"--anchor", "--gemm", "--min-time-ms", "--settle-ms", "--json-out"};
      if (layer) {
        for (const std::vector<std::string>* options : {&mlp_only, &gemm_only})
          for (const std::string& option : *options)
            MOE_CHECK(option == "--json" || option == "--force" || bench_cmd->count(option) == 0,
                      moe::ErrorCode::kInvalidArgument, "bench layer: ", option, " applies to bench ",
                      options == &mlp_only ? "mlp" : "gemm");
        MOE_CHECK(bench_cmd->count("--l2-flush-mb") == 0, moe::ErrorCode::kInvalidArgument,
                  "bench layer: --l2-flush-mb applies to bench mlp and gemm");
        if (bench_cmd->count("--case") == 0) bench.case_name.clear();  // the device decides
        return run_bench_layer(bench);
      }
      for (const std::string& option : gemm ? mlp_only : gemm_only)
        MOE_CHECK(bench_cmd->count(option) == 0, moe::ErrorCode::kInvalidArgument, "bench ", bench.kind, ": ",
                  option, " applies to bench ", gemm ? "mlp" : "gemm",
                  option == "--json"      ? " (bench gemm writes JSON with --json-out FILE)"
                  : option == "--vs-bf16" ? " (bench gemm --dtype fp8 times the bf16 GEMMs beside the FP8 ones)"
                                          : "");
      if (gemm) {
        if (bench_cmd->count("--case") == 0) bench.case_name = "all";
        return run_bench_gemm(bench);
      }
      return run_bench(bench);
    }
    if (check_cmd->parsed()) return run_check(check);
    if (ckpt_info->parsed()) return run_checkpoint_info(ckpt);
    if (ckpt_convert->parsed()) return run_checkpoint_convert(ckpt);
  } catch (const moe::Error& e) {
    std::cerr << e.what() << "\n";
    return kExitError;
  } catch (const std::bad_alloc&) {
    std::cerr << "moe-engine error: out of host memory\n";
    return kExitError;
  } catch (const std::exception& e) {
    std::cerr << "moe-engine internal error: " << e.what() << "\n";
    return kExitError;
  } catch (...) {
    std::cerr << "moe-engine internal error: an unknown exception\n";
    return kExitError;
  }
  return 0;
}
