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

CpuEstimate estimate_cpu_run(const Workload& w, DType dtype, int runs, bool checked) {
  constexpr double kOracleFlopsPerSecond = 1e9;
  CpuEstimate e;
  e.gflops = measure_cpu_gflops(dtype);
  e.seconds = kLargeShapeMargin * runs * w.mlp_flops() / (e.gflops * 1e9) +
              (checked ? 2.0 * w.mlp_flops() / kOracleFlopsPerSecond : 0.0);
  e.bytes = double(MlpProblem::bytes_needed(w, dtype));
  return e;
}

}  // namespace

int run_bench(const BenchOptions& o) {
  if (o.list) {
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
  Workload w = find_workload(o.case_name, o.workloads);
  if (!o.activation.empty()) w.activation = activation_name(parse_activation(o.activation));
  // fp8: the FP8 expert MLP, whose activations (x, y and the gradients) are bf16.
  const BenchDType parsed_dtype = parse_bench_dtype(o.dtype, "bench", true);
  const bool fp8 = parsed_dtype.fp8;
  const DType dtype = parsed_dtype.dtype;
  MOE_CHECK(!o.vs_bf16 || fp8, ErrorCode::kInvalidArgument, "bench: --vs-bf16 compares --dtype fp8 with bf16");
  MOE_CHECK(!(o.vs_bf16 && o.vs_unfused), ErrorCode::kInvalidArgument,
            "bench: --vs-bf16 and --vs-unfused each time one other path; pick one");
  MOE_CHECK(!(o.vs_unfused && o.fusion == "none"), ErrorCode::kInvalidArgument,
            "bench: --vs-unfused times the unfused path beside the fused one, but --fusion none fuses nothing: "
            "both would run the same path; pick --fusion forward or all");
  MOE_CHECK(!(fp8 && o.recompute), ErrorCode::kInvalidArgument,
            "bench: --recompute: the FP8 MLP keeps its pre-activation in FP8 and has no recompute mode");
  // The path timed against the measured one, run by run alternating (--vs-unfused, --vs-bf16).
  const bool vs_other = o.vs_unfused || o.vs_bf16;
  const char* other_name = o.vs_bf16 ? "bf16" : "unfused";
  const GluLayout layout = GluLayout::parse(o.glu_layout);
  const MlpFusion fusion = parse_fusion(o.fusion);
  const double flops = w.mlp_flops();
  const bool checked = o.check && flops <= kOracleFlopLimit;

  std::string device_note;
  Device device = bench_device(o.device, "bench", device_note);

  std::optional<MlpProblem> problem;
  auto make_problem = [&] {
    problem.emplace(w, layout, dtype, device, o.seed, fp8);
    problem->set_fusion(fusion);
    problem->set_recompute(o.recompute);
  };
  if (device.is_cuda()) {
    try {
      make_problem();
      problem->forward();
    } catch (const Error& e) {
      // auto never fails over silently: the fallback is printed and recorded.
      if (o.device != "auto" || e.code() != ErrorCode::kNotImplemented) throw;
      device_note = to_string(device) + " has no expert-MLP kernel in this build yet: the CPU backend runs";
      device = Device::cpu();
      problem.reset();
    }
  }
  if (device.is_cpu()) {
    // What the CPU backend would ignore is an error, as an option of the other kind is.
    const std::string where = "this run is on the CPU (" + (o.device == "cpu" ? "--device cpu" : device_note) + ")";
    MOE_CHECK(!o.vs_unfused, ErrorCode::kInvalidArgument,
              "bench: --vs-unfused times the unfused path beside the fused one, but ", where,
              " and the CPU backend fuses nothing: both paths would be the same; use a GPU (--device cuda) or "
              "leave out --vs-unfused");
    MOE_CHECK(!o.l2_flush_given || o.l2_flush_mb == 0, ErrorCode::kInvalidArgument,
              "bench: --l2-flush-mb flushes the GPU's L2 cache before each timed run, but ", where,
              ", where it would be ignored; use a GPU (--device cuda) or leave out --l2-flush-mb");
  }
  const int iters = o.iters > 0 ? o.iters : (device.is_cpu() ? 5 : 50);
  const int runs = (o.warmup + iters) * (vs_other ? 2 : 1);
  std::optional<CpuEstimate> estimate;
  if (device.is_cpu()) {
    estimate = estimate_cpu_run(w, dtype, runs, checked);
    estimate->bytes = double(MlpProblem::bytes_needed(w, dtype, fp8));
    MOE_CHECK(o.force || estimate->seconds <= kAskBeforeSeconds, ErrorCode::kInvalidArgument, "bench: ",
              w.name, " on the CPU backend would take about ", format_duration(estimate->seconds), " (",
              runs, " runs of ", flop_count(flops), " at the ", std::lround(estimate->gflops),
              " GFLOP/s measured here) and hold about ", memory_size(estimate->bytes), " of memory. ",
              force_hint({"a GPU (--device cuda)", w.name == "tiny" ? "" : "a smaller case (--case tiny)",
                          o.vs_bf16 ? "the FP8 path alone (no --vs-bf16)" : "", fewer_runs_hint(o.warmup, iters)}));
    make_problem();
  }

  if (!o.json) {
    std::printf(
        "moe-engine bench mlp: case %s (G=%lld, H=%lld, F=%lld, tokens=%lld, capacity=%lld, %s%s), "
        "%s\n",
        w.name.c_str(), (long long)w.experts, (long long)w.hidden, (long long)w.ffn,
        (long long)w.routed_tokens(), (long long)w.capacity, describe(problem->spec().glu).c_str(),
        w.bias ? ", biases" : "", fp8 ? "fp8 (block-scaled E4M3 GEMMs, bf16 activations)" : dtype_name(dtype));
    std::printf("device: %s (%s)%s%s\n", to_string(device).c_str(), device_name(device).c_str(),
                device_note.empty() ? "" : "; ", device_note.c_str());
    if (estimate)
      std::printf("estimate: about %s for %d runs at %.0f GFLOP/s%s; %s of memory\n",
                  format_duration(estimate->seconds).c_str(), runs, estimate->gflops,
                  checked ? " and the fp64 oracle check" : "", memory_size(estimate->bytes).c_str());
    std::fflush(stdout);
  }
  ProgressLine progress(!o.json);
  const Stream stream = nullptr;
  const auto wait = [&] {
    if (device.is_cuda()) synchronize(stream);
  };
  // Progress: on the CPU every run is synchronous; on CUDA the runs are enqueued back to back and
  // only the waits show.
  int done = 0;
  const auto ran = [&](const char* phase) {
    ++done;
    if (device.is_cpu()) progress.update(phase, done, runs, "runs", estimate ? estimate->seconds : 0);
  };
  const auto warmup_start = std::chrono::steady_clock::now();
  for (int i = 0; i < o.warmup; ++i) {
    problem->forward(stream);
    problem->backward(stream);
    ran("warm-up");
  }
  wait();
  if (device.is_cuda() && o.warmup > 0 && !o.json) {
    // The GPU's estimate comes from its warm-up (a CPU run's came before it started).
    const double per_run =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - warmup_start).count() / o.warmup;
    std::printf("estimate: about %s for %d timed runs (from the warm-up)\n",
                format_duration(per_run * iters * (vs_other ? 2 : 1)).c_str(), iters * (vs_other ? 2 : 1));
    std::fflush(stdout);
  }
  // With --vs-unfused / --vs-bf16 the other path is warmed up too, then each timed run of the
  // measured path is followed by one of the other (same inputs, same clocks on average).
  const auto use_other = [&](bool other) {
    if (o.vs_unfused) problem->set_fusion(other ? MlpFusion::kNone : fusion);
    if (o.vs_bf16) problem->use_fp8(!other);
  };
  if (vs_other) {
    use_other(true);
    for (int i = 0; i < o.warmup; ++i) {
      problem->forward(stream);
      problem->backward(stream);
      ran("warm-up");
    }
    wait();
    use_other(false);
  }
  // Timed as the anchor's do_bench times the PyTorch-eager MLP: runs are recorded back to back
  // with events and no host synchronization between them (so host-side launch work stays out of
  // the intervals), each after zeroing `flush` (do_bench's L2 clear, untimed); medians reported.
  const Tensor flush = device.is_cuda() && o.l2_flush_mb > 0
                           ? Tensor::empty({int64_t(o.l2_flush_mb * 1e6)}, DType::kUInt8, device)
                           : Tensor();
  struct Run {
    std::unique_ptr<StreamTimer> forward, backward;
  };
  std::vector<Run> fused_runs, unfused_runs;
  auto record = [&](std::vector<Run>& runs) {
    Run r{std::make_unique<StreamTimer>(device, stream), std::make_unique<StreamTimer>(device, stream)};
    if (flush.defined()) fill_bytes(flush, 0, stream);
    r.forward->start();
    problem->forward(stream);
    r.forward->stop();
    r.backward->start();
    problem->backward(stream);
    r.backward->stop();
    runs.push_back(std::move(r));
    ran("timing");
  };
  if (device.is_cuda()) progress.update("timing (enqueued back to back)", 0, iters, "runs");
  std::string fused_steps;  // what the measured path ran fused (the other path runs after it)
  for (int i = 0; i < iters; ++i) {
    record(fused_runs);
    fused_steps = problem->fusion_ran();
    if (vs_other) {
      use_other(true);
      record(unfused_runs);
      use_other(false);
    }
  }
  std::vector<double> fwd, bwd, total, ufwd, ubwd, utotal;
  auto collect = [](std::vector<Run>& runs, std::vector<double>& vf, std::vector<double>& vb,
                    std::vector<double>& vt) {
    for (Run& r : runs) {
      vf.push_back(r.forward->elapsed_ms());
      vb.push_back(r.backward->elapsed_ms());
      vt.push_back(vf.back() + vb.back());
    }
  };
  collect(fused_runs, fwd, bwd, total);
  collect(unfused_runs, ufwd, ubwd, utotal);
  const Stats f = stats_of(fwd), b = stats_of(bwd), t = stats_of(total);
  const double tflops = flops / (t.median * 1e-3) / 1e12;

  std::optional<OracleCheck> check;
  std::string check_note;
  if (!o.check)
    check_note = "skipped (--no-check)";
  else if (!checked)
    check_note = "skipped: the case is too large for the fp64 oracle (use --case tiny)";
  if (checked) {
    if (progress.enabled()) {
      progress.clear();
      std::fprintf(stderr, "checking against the fp64 oracle...");
      std::fflush(stderr);
    }
    if (vs_other) {  // the last run was the other path's: run the measured one again
      problem->forward(stream);
      problem->backward(stream);
      wait();
    }
    check = problem->check_against_oracle();
    if (progress.enabled()) std::fprintf(stderr, "\r\033[K");
  }
  progress.clear();

  if (o.json) {
    nlohmann::json j;
    j["command"] = o.command_line;
    j["version"] = build_info().version;
    j["device"] = to_string(device);
    j["device_name"] = device_name(device);
    if (!device_note.empty()) j["device_note"] = device_note;
    j["kind"] = o.kind;
    j["dtype"] = fp8 ? "fp8" : dtype_name(dtype);
    if (fp8) j["activation_dtype"] = dtype_name(dtype);
    j["glu"] = describe(problem->spec().glu);
    j["fusion"] = fused_steps;  // what the measured path ran (the CPU backend never fuses)
    j["fusion_requested"] = fusion_name(fusion);
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
    j["timing"] = device.is_cuda() ? "CUDA events, runs back to back without host waits, " +
                                         std::to_string(int(o.l2_flush_mb)) + " MB zeroed before each"
                                   : "host clock";
    j["flops"] = flops;
    j["time_ms"] = {{"forward", {{"median", f.median}, {"min", f.min}}},
                    {"backward", {{"median", b.median}, {"min", b.min}}},
                    {"total", {{"median", t.median}, {"min", t.min}}}};
    j["tflops"] = tflops;
    j["saved_bytes_per_token"] = problem->saved_bytes_per_token();
    if (vs_other) {
      const Stats uf = stats_of(ufwd), ub = stats_of(ubwd), ut = stats_of(utotal);
      j[std::string(other_name) + "_time_ms"] = {{"forward", {{"median", uf.median}, {"min", uf.min}}},
                                                 {"backward", {{"median", ub.median}, {"min", ub.min}}},
                                                 {"total", {{"median", ut.median}, {"min", ut.min}}}};
      if (o.vs_bf16) j["time_ratio_fp8_vs_bf16"] = t.median / ut.median;
      else j["speedup_vs_unfused"] = ut.median / t.median;
    }
    if (fp8) {
      problem->use_fp8(false);
      j["bf16_saved_bytes_per_token"] = problem->saved_bytes_per_token();
      problem->use_fp8(true);
      j["saved_bytes_ratio_fp8_vs_bf16"] =
          double(problem->saved_bytes_per_token()) / double(j["bf16_saved_bytes_per_token"].get<int64_t>());
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
      j["check"] = {{"skipped", check_note}};
    std::cout << j.dump(2) << "\n";
  } else {
    const std::string& ran = fused_steps;
    std::printf("fused steps: %s%s\n", ran.c_str(),
                ran == fusion_name(fusion) ? ""
                : device.is_cpu()          ? " (the CPU backend runs the steps unfused)"
                                           : (" (requested " + std::string(fusion_name(fusion)) +
                                              "; the fused kernels do not take this problem)").c_str());
    std::printf("%-10s %12s %12s %12s\n", "phase", "median ms", "min ms", "TFLOP/s");
    std::printf("%-10s %12.3f %12.3f %12.4f\n", "forward", f.median, f.min,
                flops / 3 / (f.median * 1e9));
    std::printf("%-10s %12.3f %12.3f %12.4f\n", "backward", b.median, b.min,
                flops * 2 / 3 / (b.median * 1e9));
    std::printf("%-10s %12.3f %12.3f %12.4f\n", "total", t.median, t.min, tflops);
    if (vs_other) {
      const Stats uf = stats_of(ufwd), ub = stats_of(ubwd), ut = stats_of(utotal);
      // Where the fused kernels did not take the problem (a GPU), both paths were the unfused one.
      const bool same = o.vs_unfused && fused_steps == "none";
      std::printf("%-10s %12.3f %12.3f %12.4f   %s: fwd %.3f bwd %.3f; %s %.3fx%s\n", other_name, ut.median, ut.min,
                  flops / (ut.median * 1e9), other_name, uf.median, ub.median,
                  same ? "nothing ran fused, so both paths were the same: their ratio" : o.vs_bf16 ? "fp8 is" : "fused is",
                  ut.median / t.median, same ? " is run-to-run noise" : " faster");
    }
    std::printf("saved for backward: %lld bytes per token\n", (long long)problem->saved_bytes_per_token());
    std::printf("(median of %d runs after %d warm-up%s)\n", iters, o.warmup,
                device.is_cuda() ? "; events, no host waits between runs, L2 flushed before each" : "");
    if (check) {
      std::printf("check against the fp64 oracle: max %s %.3g (tolerance %.3g): %s\n",
                  check->metric == "rel_error" ? "rel. error" : check->metric.c_str(), check->max_rel_error,
                  check->tolerance, check->passed ? "PASS" : "FAIL");
      std::printf("  ");
      for (const auto& [name, err] : check->rel_error) std::printf(" %s %.2e", name.c_str(), err);
      std::printf("\n");
    } else {
      std::printf("check against the fp64 oracle: %s\n", check_note.c_str());
    }
  }
  return (!check || check->passed) ? 0 : kExitCheckFailed;
}

}  // namespace moe::tools
