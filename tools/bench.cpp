// moe-engine bench mlp: the expert MLP forward + backward on one case, timed, and checked against
// the float64 oracle when the case is small enough for it.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "bench_device.hpp"
#include "commands.hpp"
#include "mlp_problem.hpp"
#include "progress.hpp"

namespace moe::tools {
namespace {

// The naive oracle runs at roughly 1 GFLOP/s: keep its check under a few seconds.
constexpr double kOracleFlopLimit = 5e9;

struct Stats {
  double median = 0, min = 0;
};

Stats stats_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return {n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]), v.front()};
}

std::string device_name(Device d) {
  if (d.is_cpu()) {
    const BuildInfo b = build_info();
    return b.with_openmp
               ? "OpenMP, " + std::to_string(std::thread::hardware_concurrency()) + " threads"
               : "1 thread";
  }
  for (const GpuInfo& g : query_gpus().gpus)
    if (g.index == d.index) return g.name;
  return to_string(d);
}

// What a CPU run will cost, known before it starts: the CPU backend's rate measured on the tiny
// case (the same code path), the run count and the memory the problem holds (bench_common.hpp).
struct CpuEstimate {
  double gflops = 0;     // measured rate of forward + backward on the tiny case
  double seconds = 0;    // the whole benchmark: warm-up, timed runs, oracle check
  double bytes = 0;      // host memory of the problem
};

CpuEstimate estimate_cpu_run(const Workload& w, DType dtype, bool fp8, int runs, bool checked) {
  constexpr double kOracleFlopsPerSecond = 1e9;
  CpuEstimate e;
  e.gflops = measure_cpu_gflops(dtype);
  e.seconds = kLargeShapeMargin * runs * w.mlp_flops() / (e.gflops * 1e9) +
              (checked ? 2.0 * w.mlp_flops() / kOracleFlopsPerSecond : 0.0);
  e.bytes = double(MlpProblem::bytes_needed(w, dtype, fp8));
  return e;
}

// --list: the built-in tiny case, then the cases of the workloads file.
int list_cases(const BenchOptions& o) {
  std::vector<Workload> all = {tiny_workload()};
  for (Workload& w : load_workloads(find_workloads_file(o.workloads)))
    all.push_back(std::move(w));
  std::printf("%-36s %5s %6s %6s %7s  %s\n", "case", "G", "H", "F", "tokens", "activation");
  for (const Workload& w : all)
    std::printf("%-36s %5lld %6lld %6lld %7lld  %s%s\n", w.name.c_str(), (long long)w.experts,
                (long long)w.hidden, (long long)w.ffn, (long long)w.routed_tokens(),
                w.activation.c_str(), w.bias ? ", biases" : "");
  return 0;
}

// The options resolved and checked, before any device is touched.
struct MlpSetup {
  Workload workload;
  bool fp8 = false;  // the FP8 expert MLP, whose activations (x, y and the gradients) are bf16
  DType dtype = DType::kBFloat16;
  // The path timed against the measured one, run by run alternating (--vs-unfused, --vs-bf16).
  bool vs_other = false;
  const char* other_name = "";
  GluLayout layout = GluLayout::halves();
  MlpFusion fusion = MlpFusion::kForward;
  double flops = 0;
  bool checked = false;  // compared with the oracle (asked for, and small enough for it)
};

MlpSetup resolve_options(const BenchOptions& o) {
  MlpSetup s;
  s.workload = find_workload(o.case_name, o.workloads);
  if (!o.activation.empty()) s.workload.activation = activation_name(parse_activation(o.activation));
  const BenchDType parsed_dtype = parse_bench_dtype(o.dtype, "bench", true);
  s.fp8 = parsed_dtype.fp8;
  s.dtype = parsed_dtype.dtype;
  MOE_CHECK(!o.vs_bf16 || s.fp8, ErrorCode::kInvalidArgument, "bench: --vs-bf16 compares --dtype fp8 with bf16");
  MOE_CHECK(!(o.vs_bf16 && o.vs_unfused), ErrorCode::kInvalidArgument,
            "bench: --vs-bf16 and --vs-unfused each time one other path; pick one");
  MOE_CHECK(!(o.vs_unfused && o.fusion == "none"), ErrorCode::kInvalidArgument,
            "bench: --vs-unfused times the unfused path beside the fused one, but --fusion none fuses nothing: "
            "both would run the same path; pick --fusion forward or all");
  MOE_CHECK(!(s.fp8 && o.recompute), ErrorCode::kInvalidArgument,
            "bench: --recompute: the FP8 MLP keeps its pre-activation in FP8 and has no recompute mode");
  s.vs_other = o.vs_unfused || o.vs_bf16;
  s.other_name = o.vs_bf16 ? "bf16" : "unfused";
  s.layout = GluLayout::parse(o.glu_layout);
  s.fusion = parse_fusion(o.fusion);
  s.flops = s.workload.mlp_flops();
  s.checked = o.check && s.flops <= kOracleFlopLimit;
  return s;
}

void make_problem(std::optional<MlpProblem>& problem, const MlpSetup& s, Device device, const BenchOptions& o) {
  problem.emplace(s.workload, s.layout, s.dtype, device, o.seed, s.fp8);
  problem->set_fusion(s.fusion);
  problem->set_recompute(o.recompute);
}

// The device of the run; `note` says why it is not the one asked for, where it is not.
struct DeviceChoice {
  Device device;
  std::string note;
};

// On CUDA the problem is built and run forward once here: --device auto falls back to the CPU
// where this build has no expert-MLP kernel for the GPU.
DeviceChoice choose_device(const BenchOptions& o, const MlpSetup& s, std::optional<MlpProblem>& problem) {
  DeviceChoice d;
  d.device = bench_device(o.device, "bench", d.note);
  if (d.device.is_cuda()) {
    try {
      make_problem(problem, s, d.device, o);
      problem->forward();
    } catch (const Error& e) {
      // auto never fails over silently: the fallback is printed and recorded.
      if (o.device != "auto" || e.code() != ErrorCode::kNotImplemented) throw;
      d.note = to_string(d.device) + " has no expert-MLP kernel in this build yet: the CPU backend runs";
      d.device = Device::cpu();
      problem.reset();
    }
  }
  return d;
}

// What the CPU backend would ignore is an error, as an option of the other kind is.
void reject_options_the_cpu_ignores(const BenchOptions& o, const std::string& device_note) {
  const std::string where = "this run is on the CPU (" + (o.device == "cpu" ? "--device cpu" : device_note) + ")";
  MOE_CHECK(!o.vs_unfused, ErrorCode::kInvalidArgument,
            "bench: --vs-unfused times the unfused path beside the fused one, but ", where,
            " and the CPU backend fuses nothing: both paths would be the same; use a GPU (--device cuda) or "
            "leave out --vs-unfused");
  MOE_CHECK(!o.l2_flush_given || o.l2_flush_mb == 0, ErrorCode::kInvalidArgument,
            "bench: --l2-flush-mb flushes the GPU's L2 cache before each timed run, but ", where,
            ", where it would be ignored; use a GPU (--device cuda) or leave out --l2-flush-mb");
}

// A CPU run estimated past kAskBeforeSeconds needs --force.
CpuEstimate gate_cpu_run(const BenchOptions& o, const MlpSetup& s, int iters, int runs) {
  const Workload& w = s.workload;
  const CpuEstimate estimate = estimate_cpu_run(w, s.dtype, s.fp8, runs, s.checked);
  MOE_CHECK(o.force || estimate.seconds <= kAskBeforeSeconds, ErrorCode::kInvalidArgument, "bench: ",
            w.name, " on the CPU backend would take about ", format_duration(estimate.seconds), " (",
            runs, " runs of ", flop_count(s.flops), " at the ", std::lround(estimate.gflops),
            " GFLOP/s measured here) and hold about ", memory_size(estimate.bytes), " of memory. ",
            force_hint({"a GPU (--device cuda)", w.name == "tiny" ? "" : "a smaller case (--case tiny)",
                        o.vs_bf16 ? "the FP8 path alone (no --vs-bf16)" : "", fewer_runs_hint(o.warmup, iters)}));
  return estimate;
}

void print_header(const MlpSetup& s, const DeviceChoice& d, const MlpProblem& problem,
                  const std::optional<CpuEstimate>& estimate, int runs) {
  const Workload& w = s.workload;
  std::printf(
      "moe-engine bench mlp: case %s (G=%lld, H=%lld, F=%lld, tokens=%lld, capacity=%lld, %s%s), "
      "%s\n",
      w.name.c_str(), (long long)w.experts, (long long)w.hidden, (long long)w.ffn,
      (long long)w.routed_tokens(), (long long)w.capacity, describe(problem.spec().glu).c_str(),
      w.bias ? ", biases" : "", s.fp8 ? "fp8 (block-scaled E4M3 GEMMs, bf16 activations)" : dtype_name(s.dtype));
  std::printf("device: %s (%s)%s%s\n", to_string(d.device).c_str(), device_name(d.device).c_str(),
              d.note.empty() ? "" : "; ", d.note.c_str());
  if (estimate)
    std::printf("estimate: about %s for %d runs at %.0f GFLOP/s%s; %s of memory\n",
                format_duration(estimate->seconds).c_str(), runs, estimate->gflops,
                s.checked ? " and the fp64 oracle check" : "", memory_size(estimate->bytes).c_str());
  std::fflush(stdout);
}

// Runs of the problem on the default stream, counted on the progress line: on the CPU every run
// is synchronous; on CUDA the runs are enqueued back to back and only the waits show.
struct Runner {
  MlpProblem& problem;
  Device device;
  ProgressLine& progress;
  int runs = 0;           // all of them: warm-up and timed, of both paths
  double estimate_s = 0;  // the CPU estimate of the whole benchmark (0 on CUDA)
  Stream stream = nullptr;
  int done = 0;

  void wait() const {
    if (device.is_cuda()) synchronize(stream);
  }
  void ran(const char* phase) {
    ++done;
    if (device.is_cpu()) progress.update(phase, done, runs, "runs", estimate_s);
  }
  void forward_backward(const char* phase) {
    problem.forward(stream);
    problem.backward(stream);
    ran(phase);
  }
};

// With --vs-unfused / --vs-bf16: switches the problem between the measured path and the other one.
void use_other_path(MlpProblem& problem, const BenchOptions& o, MlpFusion fusion, bool other) {
  if (o.vs_unfused) problem.set_fusion(other ? MlpFusion::kNone : fusion);
  if (o.vs_bf16) problem.use_fp8(!other);
}

// With --vs-unfused / --vs-bf16 the other path is warmed up too, after the measured one.
void warm_up(Runner& r, const BenchOptions& o, const MlpSetup& s, int iters) {
  const auto warmup_start = std::chrono::steady_clock::now();
  for (int i = 0; i < o.warmup; ++i) r.forward_backward("warm-up");
  r.wait();
  if (r.device.is_cuda() && o.warmup > 0 && !o.json) {
    // The GPU's estimate comes from its warm-up (a CPU run's came before it started).
    const double per_run =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - warmup_start).count() / o.warmup;
    std::printf("estimate: about %s for %d timed runs (from the warm-up)\n",
                format_duration(per_run * iters * (s.vs_other ? 2 : 1)).c_str(), iters * (s.vs_other ? 2 : 1));
    std::fflush(stdout);
  }
  if (s.vs_other) {
    use_other_path(r.problem, o, s.fusion, true);
    for (int i = 0; i < o.warmup; ++i) r.forward_backward("warm-up");
    r.wait();
    use_other_path(r.problem, o, s.fusion, false);
  }
}

// What the timed runs zero before each (CUDA with --l2-flush-mb above 0; else undefined).
Tensor l2_flush_buffer(Device device, const BenchOptions& o) {
  return device.is_cuda() && o.l2_flush_mb > 0
             ? Tensor::empty({int64_t(o.l2_flush_mb * 1e6)}, DType::kUInt8, device)
             : Tensor();
}

struct TimedRun {
  std::unique_ptr<StreamTimer> forward, backward;
};

// The timers of the timed runs, read once all are enqueued.
struct TimedRuns {
  std::vector<TimedRun> measured, other;  // other: the --vs-unfused / --vs-bf16 path's
  std::string fused_steps;                // what the measured path ran fused (the other path runs after it)
};

// Timed as the anchor's do_bench times the PyTorch-eager MLP: runs are recorded back to back with
// events and no host synchronization between them (so host-side launch work stays out of the
// intervals), each after zeroing `flush` (do_bench's L2 clear, untimed). With --vs-unfused /
// --vs-bf16 each timed run of the measured path is followed by one of the other (same inputs, same
// clocks on average).
TimedRuns time_runs(Runner& r, const BenchOptions& o, const MlpSetup& s, int iters, const Tensor& flush) {
  TimedRuns timed;
  auto record = [&](std::vector<TimedRun>& runs) {
    TimedRun t{std::make_unique<StreamTimer>(r.device, r.stream), std::make_unique<StreamTimer>(r.device, r.stream)};
    if (flush.defined()) fill_bytes(flush, 0, r.stream);
    t.forward->start();
    r.problem.forward(r.stream);
    t.forward->stop();
    t.backward->start();
    r.problem.backward(r.stream);
    t.backward->stop();
    runs.push_back(std::move(t));
    r.ran("timing");
  };
  if (r.device.is_cuda()) r.progress.update("timing (enqueued back to back)", 0, iters, "runs");
  for (int i = 0; i < iters; ++i) {
    record(timed.measured);
    timed.fused_steps = r.problem.fusion_ran();
    if (s.vs_other) {
      use_other_path(r.problem, o, s.fusion, true);
      record(timed.other);
      use_other_path(r.problem, o, s.fusion, false);
    }
  }
  return timed;
}

// Per-run times in ms.
struct RunTimes {
  std::vector<double> forward, backward, total;
};

RunTimes read_times(std::vector<TimedRun>& runs) {
  RunTimes times;
  for (TimedRun& r : runs) {
    times.forward.push_back(r.forward->elapsed_ms());
    times.backward.push_back(r.backward->elapsed_ms());
    times.total.push_back(times.forward.back() + times.backward.back());
  }
  return times;
}

struct PathStats {
  Stats forward, backward, total;
};

PathStats stats_of(const RunTimes& times) {
  return {stats_of(times.forward), stats_of(times.backward), stats_of(times.total)};
}

nlohmann::json time_ms_json(const PathStats& p) {
  return {{"forward", {{"median", p.forward.median}, {"min", p.forward.min}}},
          {"backward", {{"median", p.backward.median}, {"min", p.backward.min}}},
          {"total", {{"median", p.total.median}, {"min", p.total.min}}}};
}

// What the reports show of the timed runs.
struct Timings {
  std::string fused_steps;
  PathStats measured;
  double tflops = 0;               // of the measured path, from its median total
  std::optional<PathStats> other;  // with --vs-unfused / --vs-bf16
};

Timings read_timings(TimedRuns& timed, const MlpSetup& s) {
  Timings t;
  t.fused_steps = timed.fused_steps;
  const RunTimes measured = read_times(timed.measured), other = read_times(timed.other);
  t.measured = stats_of(measured);
  t.tflops = s.flops / (t.measured.total.median * 1e-3) / 1e12;
  if (s.vs_other) t.other = stats_of(other);
  return t;
}

// The comparison with the float64 oracle, or why there is none.
struct OracleResult {
  std::optional<OracleCheck> check;
  std::string skipped;
};

OracleResult run_oracle_check(Runner& r, const BenchOptions& o, const MlpSetup& s) {
  OracleResult result;
  if (!o.check)
    result.skipped = "skipped (--no-check)";
  else if (!s.checked)
    result.skipped = "skipped: the case is too large for the fp64 oracle (use --case tiny)";
  if (s.checked) {
    if (r.progress.enabled()) {
      r.progress.clear();
      std::fprintf(stderr, "checking against the fp64 oracle...");
      std::fflush(stderr);
    }
    if (s.vs_other) {  // the last run was the other path's: run the measured one again
      r.problem.forward(r.stream);
      r.problem.backward(r.stream);
      r.wait();
    }
    result.check = r.problem.check_against_oracle();
    if (r.progress.enabled()) std::fprintf(stderr, "\r\033[K");
  }
  return result;
}

// `problem` is switched to bf16 and back (fp8) for the bf16 MLP's saved bytes.
void print_json_report(const BenchOptions& o, const MlpSetup& s, const DeviceChoice& d, MlpProblem& problem, int iters,
                       const Timings& timings, const OracleResult& oracle) {
  const Workload& w = s.workload;
  const Stats& t = timings.measured.total;
  const std::optional<OracleCheck>& check = oracle.check;
  nlohmann::json j;
  j["command"] = o.command_line;
  j["version"] = build_info().version;
  j["device"] = to_string(d.device);
  j["device_name"] = device_name(d.device);
  if (!d.note.empty()) j["device_note"] = d.note;
  j["kind"] = o.kind;
  j["dtype"] = s.fp8 ? "fp8" : dtype_name(s.dtype);
  if (s.fp8) j["activation_dtype"] = dtype_name(s.dtype);
  j["glu"] = describe(problem.spec().glu);
  j["fusion"] = timings.fused_steps;  // what the measured path ran (the CPU backend never fuses)
  j["fusion_requested"] = fusion_name(s.fusion);
  j["recompute"] = o.recompute;
  j["case"] = {{"name", w.name},
               {"experts", w.experts},
               {"hidden", w.hidden},
               {"ffn", w.ffn},
               {"tokens", w.routed_tokens()},
               {"capacity", w.capacity},
               {"activation", w.activation},
               {"bias", w.bias},
               {"tokens_per_expert", w.tokens_per_expert}};
  j["warmup"] = o.warmup;
  j["iters"] = iters;
  j["timing"] = d.device.is_cuda() ? "CUDA events, runs back to back without host waits, " +
                                         std::to_string(int(o.l2_flush_mb)) + " MB zeroed before each"
                                   : "host clock";
  j["flops"] = s.flops;
  j["time_ms"] = time_ms_json(timings.measured);
  j["tflops"] = timings.tflops;
  j["saved_bytes_per_token"] = problem.saved_bytes_per_token();
  if (timings.other) {
    const Stats& ut = timings.other->total;
    j[std::string(s.other_name) + "_time_ms"] = time_ms_json(*timings.other);
    if (o.vs_bf16) j["time_ratio_fp8_vs_bf16"] = t.median / ut.median;
    else j["speedup_vs_unfused"] = ut.median / t.median;
  }
  if (s.fp8) {
    problem.use_fp8(false);
    j["bf16_saved_bytes_per_token"] = problem.saved_bytes_per_token();
    problem.use_fp8(true);
    j["saved_bytes_ratio_fp8_vs_bf16"] =
        double(problem.saved_bytes_per_token()) / double(j["bf16_saved_bytes_per_token"].get<int64_t>());
  }
  j["roofline_fraction"] = nullptr;  // measured against the H200 ceilings on CUDA only
  if (check)
    j["check"] = {{"oracle", "float64"},
                  {"metric", check->metric},
                  {"rel_error", check->rel_error},
                  {"max_rel_error", check->max_rel_error},
                  {"tolerance", check->tolerance},
                  {"passed", check->passed}};
  else
    j["check"] = {{"skipped", oracle.skipped}};
  std::cout << j.dump(2) << "\n";
}

void print_text_report(const BenchOptions& o, const MlpSetup& s, const DeviceChoice& d, const MlpProblem& problem,
                       int iters, const Timings& timings, const OracleResult& oracle) {
  const double flops = s.flops, tflops = timings.tflops;
  const Stats &f = timings.measured.forward, &b = timings.measured.backward, &t = timings.measured.total;
  const std::string& ran = timings.fused_steps;
  const MlpFusion fusion = s.fusion;
  const char* other_name = s.other_name;
  const std::optional<OracleCheck>& check = oracle.check;
  std::printf("fused steps: %s%s\n", ran.c_str(),
              ran == fusion_name(fusion) ? ""
              : d.device.is_cpu()        ? " (the CPU backend runs the steps unfused)"
                                         : (" (requested " + std::string(fusion_name(fusion)) +
                                            "; the fused kernels do not take this problem)").c_str());
  std::printf("%-10s %12s %12s %12s\n", "phase", "median ms", "min ms", "TFLOP/s");
  std::printf("%-10s %12.3f %12.3f %12.4f\n", "forward", f.median, f.min,
              flops / 3 / (f.median * 1e9));
  std::printf("%-10s %12.3f %12.3f %12.4f\n", "backward", b.median, b.min,
              flops * 2 / 3 / (b.median * 1e9));
  std::printf("%-10s %12.3f %12.3f %12.4f\n", "total", t.median, t.min, tflops);
  if (timings.other) {
    const Stats &uf = timings.other->forward, &ub = timings.other->backward, &ut = timings.other->total;
    // Where the fused kernels did not take the problem (a GPU), both paths were the unfused one.
    const bool same = o.vs_unfused && ran == "none";
    std::printf("%-10s %12.3f %12.3f %12.4f   %s: fwd %.3f bwd %.3f; %s %.3fx%s\n", other_name, ut.median, ut.min,
                flops / (ut.median * 1e9), other_name, uf.median, ub.median,
                same        ? "nothing ran fused, so both paths were the same: their ratio"
                : o.vs_bf16 ? "fp8 is"
                            : "fused is",
                ut.median / t.median, same ? " is run-to-run noise" : " faster");
  }
  std::printf("saved for backward: %lld bytes per token\n", (long long)problem.saved_bytes_per_token());
  std::printf("(median of %d runs after %d warm-up%s)\n", iters, o.warmup,
              d.device.is_cuda() ? "; events, no host waits between runs, L2 flushed before each" : "");
  if (check) {
    std::printf("check against the fp64 oracle: max %s %.3g (tolerance %.3g): %s\n",
                check->metric == "rel_error" ? "rel. error" : check->metric.c_str(), check->max_rel_error,
                check->tolerance, check->passed ? "PASS" : "FAIL");
    std::printf("  ");
    for (const auto& [name, err] : check->rel_error) std::printf(" %s %.2e", name.c_str(), err);
    std::printf("\n");
  } else {
    std::printf("check against the fp64 oracle: %s\n", oracle.skipped.c_str());
  }
}

}  // namespace

int run_bench(const BenchOptions& o) {
  if (o.list) return list_cases(o);
  const MlpSetup s = resolve_options(o);

  std::optional<MlpProblem> problem;
  const DeviceChoice d = choose_device(o, s, problem);
  if (d.device.is_cpu()) reject_options_the_cpu_ignores(o, d.note);
  const int iters = o.iters > 0 ? o.iters : (d.device.is_cpu() ? 5 : 50);
  const int runs = (o.warmup + iters) * (s.vs_other ? 2 : 1);
  std::optional<CpuEstimate> estimate;
  if (d.device.is_cpu()) {
    estimate = gate_cpu_run(o, s, iters, runs);
    make_problem(problem, s, d.device, o);
  }

  if (!o.json) print_header(s, d, *problem, estimate, runs);
  ProgressLine progress(!o.json);
  Runner runner{*problem, d.device, progress, runs, estimate ? estimate->seconds : 0};
  warm_up(runner, o, s, iters);
  const Tensor flush = l2_flush_buffer(d.device, o);
  TimedRuns timed = time_runs(runner, o, s, iters, flush);
  const Timings timings = read_timings(timed, s);
  const OracleResult oracle = run_oracle_check(runner, o, s);
  progress.clear();

  if (o.json)
    print_json_report(o, s, d, *problem, iters, timings, oracle);
  else
    print_text_report(o, s, d, *problem, iters, timings, oracle);
  return (!oracle.check || oracle.check->passed) ? 0 : kExitCheckFailed;
}

}  // namespace moe::tools
