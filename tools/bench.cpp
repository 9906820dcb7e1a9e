// moe-engine bench mlp: the expert MLP forward + backward on one case, timed, and checked against
// the float64 oracle when the case is small enough for it.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <vector>

#include "commands.hpp"
#include "mlp_problem.hpp"

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
  const Workload w = find_workload(o.case_name, o.workloads);
  const DType dtype = dtype_from_name(o.dtype);
  MOE_CHECK(dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32,
            ErrorCode::kDType, "bench: --dtype must be bfloat16, float16 or float32, got ",
            o.dtype);
  const GluLayout layout = GluLayout::parse(o.glu_layout);
  const MlpFusion fusion = parse_fusion(o.fusion);

  std::string device_note;
  Device device = Device::cpu();
  if (o.device == "auto") {
    const GpuInventory inv = query_gpus();
    if (!inv.gpus.empty())
      device = Device::cuda(0);
    else
      device_note = "no GPU visible (" + inv.note + "): the CPU backend runs";
  } else {
    device = parse_device(o.device);
  }

  std::optional<MlpProblem> problem;
  try {
    problem.emplace(w, layout, dtype, device, o.seed);
    problem->set_fusion(fusion);
    problem->set_recompute(o.recompute);
    problem->forward();
  } catch (const Error& e) {
    // auto never fails over silently: the fallback is printed and recorded.
    if (o.device != "auto" || device.is_cpu() || e.code() != ErrorCode::kNotImplemented) throw;
    device_note =
        to_string(device) + " has no expert-MLP kernel in this build yet: the CPU backend runs";
    device = Device::cpu();
    problem.emplace(w, layout, dtype, device, o.seed);
    problem->set_fusion(fusion);
    problem->set_recompute(o.recompute);
  }
  if (device.is_cpu() && w.mlp_flops() > 1e12)
    std::fprintf(
        stderr,
        "note: %s is %.1f TFLOP per forward+backward; the CPU backend needs minutes per run\n",
        w.name.c_str(), w.mlp_flops() / 1e12);
  const Stream stream = nullptr;
  const auto wait = [&] {
    if (device.is_cuda()) synchronize(stream);
  };
  const int iters = o.iters > 0 ? o.iters : (device.is_cpu() ? 5 : 50);
  for (int i = 0; i < o.warmup; ++i) {
    problem->forward(stream);
    problem->backward(stream);
  }
  wait();
  // With --vs-unfused the unfused path is warmed up too, then each timed run of the fused path is
  // followed by one of the unfused path (same inputs, same clocks on average).
  if (o.vs_unfused) {
    problem->set_fusion(MlpFusion::kNone);
    for (int i = 0; i < o.warmup; ++i) {
      problem->forward(stream);
      problem->backward(stream);
    }
    wait();
    problem->set_fusion(fusion);
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
  };
  for (int i = 0; i < iters; ++i) {
    record(fused_runs);
    if (o.vs_unfused) {
      problem->set_fusion(MlpFusion::kNone);
      record(unfused_runs);
      problem->set_fusion(fusion);
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
  const double flops = w.mlp_flops();
  const double tflops = flops / (t.median * 1e-3) / 1e12;

  std::optional<OracleCheck> check;
  std::string check_note;
  if (!o.check)
    check_note = "skipped (--no-check)";
  else if (flops > kOracleFlopLimit)
    check_note = "skipped: the case is too large for the fp64 oracle (use --case tiny)";
  else
    check = problem->check_against_oracle();

  if (o.json) {
    nlohmann::json j;
    j["command"] = o.command_line;
    j["version"] = build_info().version;
    j["device"] = to_string(device);
    j["device_name"] = device_name(device);
    if (!device_note.empty()) j["device_note"] = device_note;
    j["kind"] = o.kind;
    j["dtype"] = dtype_name(dtype);
    j["glu"] = describe(problem->spec().glu);
    j["fusion"] = fusion_name(fusion);
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
    if (o.vs_unfused) {
      const Stats uf = stats_of(ufwd), ub = stats_of(ubwd), ut = stats_of(utotal);
      j["unfused_time_ms"] = {{"forward", {{"median", uf.median}, {"min", uf.min}}},
                              {"backward", {{"median", ub.median}, {"min", ub.min}}},
                              {"total", {{"median", ut.median}, {"min", ut.min}}}};
      j["speedup_vs_unfused"] = ut.median / t.median;
    }
    j["roofline_fraction"] = nullptr;  // measured against the H200 ceilings on CUDA only
    if (check)
      j["check"] = {{"oracle", "float64"},
                    {"rel_error", check->rel_error},
                    {"max_rel_error", check->max_rel_error},
                    {"tolerance", check->tolerance},
                    {"passed", check->passed}};
    else
      j["check"] = {{"skipped", check_note}};
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf(
        "moe-engine bench mlp: case %s (G=%lld, H=%lld, F=%lld, tokens=%lld, capacity=%lld, %s%s), "
        "%s\n",
        w.name.c_str(), (long long)w.experts, (long long)w.hidden, (long long)w.ffn,
        (long long)w.routed_tokens(), (long long)w.capacity, describe(problem->spec().glu).c_str(),
        w.bias ? ", biases" : "", dtype_name(dtype));
    std::printf("device: %s (%s)%s%s\n", to_string(device).c_str(), device_name(device).c_str(),
                device_note.empty() ? "" : "; ", device_note.c_str());
    std::printf("%-10s %12s %12s %12s\n", "phase", "median ms", "min ms", "TFLOP/s");
    std::printf("%-10s %12.3f %12.3f %12.4f\n", "forward", f.median, f.min,
                flops / 3 / (f.median * 1e9));
    std::printf("%-10s %12.3f %12.3f %12.4f\n", "backward", b.median, b.min,
                flops * 2 / 3 / (b.median * 1e9));
    std::printf("%-10s %12.3f %12.3f %12.4f\n", "total", t.median, t.min, tflops);
    if (o.vs_unfused) {
      const Stats uf = stats_of(ufwd), ub = stats_of(ubwd), ut = stats_of(utotal);
      std::printf("%-10s %12.3f %12.3f %12.4f   unfused: fwd %.3f bwd %.3f; fused is %.3fx faster\n",
                  "unfused", ut.median, ut.min, flops / (ut.median * 1e9), uf.median, ub.median,
                  ut.median / t.median);
    }
    std::printf("saved for backward: %lld bytes per token\n", (long long)problem->saved_bytes_per_token());
    std::printf("(median of %d runs after %d warm-up%s)\n", iters, o.warmup,
                device.is_cuda() ? "; events, no host waits between runs, L2 flushed before each" : "");
    if (check) {
      std::printf("check against the fp64 oracle: max rel. error %.3g (tolerance %.3g): %s\n",
                  check->max_rel_error, check->tolerance, check->passed ? "PASS" : "FAIL");
      std::printf("  ");
      for (const auto& [name, err] : check->rel_error) std::printf(" %s %.2e", name.c_str(), err);
      std::printf("\n");
    } else {
      std::printf("check against the fp64 oracle: %s\n", check_note.c_str());
    }
  }
  return (!check || check->passed) ? 0 : 2;
}

}  // namespace moe::tools
