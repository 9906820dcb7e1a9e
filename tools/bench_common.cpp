#include "bench_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "mlp_problem.hpp"
#include "workloads.hpp"

namespace moe::tools {

BenchDType parse_bench_dtype(const std::string& text, const std::string& who, bool fp8_accepted,
                             const std::string& fp8_note) {
  if (fp8_accepted && (text == "fp8" || text == "float8_e4m3")) return {DType::kBFloat16, true};
  for (const char* name : {"bfloat16", "bf16", "float16", "fp16", "float32", "fp32"})
    if (text == name) return {dtype_from_name(text), false};
  const bool fp8 = text == "fp8" || text == "float8_e4m3";
  throw_error(ErrorCode::kDType, who, ": --dtype must be ",
              fp8_accepted ? "bfloat16, float16, float32 or fp8" : "bfloat16, float16 or float32", ", got '", text,
              "'", !fp8_accepted && fp8 ? fp8_note : "");
}

double measure_cpu_gflops(DType dtype) {
  const Workload tiny = tiny_workload();
  MlpProblem calibration(tiny, GluLayout::halves(), dtype, Device::cpu(), 1);
  calibration.forward();
  calibration.backward();
  std::vector<double> seconds;
  for (int i = 0; i < 3; ++i) {
    StreamTimer timer(Device::cpu(), nullptr);
    timer.start();
    calibration.forward();
    calibration.backward();
    timer.stop();
    seconds.push_back(timer.elapsed_ms() * 1e-3);
  }
  std::sort(seconds.begin(), seconds.end());
  return tiny.mlp_flops() / seconds[1] * 1e-9;
}

std::string memory_size(double bytes) {
  char text[32];
  if (bytes >= double(1 << 30))
    std::snprintf(text, sizeof text, "%.1f GiB", bytes / double(1 << 30));
  else
    std::snprintf(text, sizeof text, "%.0f MiB", std::ceil(bytes / double(1 << 20)));
  return text;
}

std::string flop_count(double flops) {
  char text[32];
  std::snprintf(text, sizeof text, flops >= 1e11 ? "%.1f TFLOP" : "%.2f GFLOP", flops >= 1e11 ? flops * 1e-12 : flops * 1e-9);
  return text;
}

std::string force_hint(const std::vector<std::string>& alternatives) {
  std::vector<std::string> left;
  for (const std::string& a : alternatives)
    if (!a.empty()) left.push_back(a);
  std::string out = "Pass --force to run it anyway";
  for (size_t i = 0; i < left.size(); ++i)
    out += (i == 0 ? ", or use " : i + 1 == left.size() ? " or " : ", ") + left[i];
  return out;
}

std::string fewer_runs_hint(int warmup, int iters) {
  if (warmup > 0 && iters > 1) return "fewer runs (--warmup 0 --iters 1)";
  if (warmup > 0) return "fewer runs (--warmup 0)";
  if (iters > 1) return "fewer runs (--iters 1)";
  return {};
}

}  // namespace moe::tools
