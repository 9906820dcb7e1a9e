// Pieces the bench kinds share: --dtype, and what a CPU run will cost (the estimate, and its --force
// gate's message).
#pragma once

#include <string>
#include <vector>

#include "moe_engine/moe_engine.hpp"

namespace moe::tools {

// --dtype of a benchmark: bfloat16, float16 or float32 (or bf16, fp16, fp32), and fp8 (or
// float8_e4m3) where the command has an FP8 path: then `fp8` is set and `dtype` is bfloat16, the
// dtype of the FP8 path's activations. Anything else is an error of `who` ("bench layer") that
// lists only what it accepts.
struct BenchDType {
  DType dtype = DType::kBFloat16;
  bool fp8 = false;
};
BenchDType parse_bench_dtype(const std::string& text, const std::string& who, bool fp8_accepted,
                             const std::string& fp8_note = "");

// A CPU run estimated longer than this needs --force.
constexpr double kAskBeforeSeconds = 180;
// The suite's shapes ran at 0.75-1.0x the tiny MLP's rate on the CPU backend: estimates are
// rounded up by a third, so that they err long rather than short.
constexpr double kLargeShapeMargin = 4.0 / 3.0;

// The CPU backend's rate, in GFLOP/s, of the expert MLP forward + backward in `dtype`, measured
// here on the tiny case (a few runs, well under a second).
double measure_cpu_gflops(DType dtype);

// "512 MiB", "4.2 GiB"; "0.45 GFLOP", "17.3 TFLOP".
std::string memory_size(double bytes);
std::string flop_count(double flops);

// The end of the --force gate's message: "Pass --force to run it anyway, or use A, B or C", with
// the alternatives that still apply (empty ones are left out).
std::string force_hint(const std::vector<std::string>& alternatives);
// "fewer runs (--warmup 0 --iters 1)", naming only the options that would lower the run count;
// empty when there is one timed run and no warm-up already.
std::string fewer_runs_hint(int warmup, int iters);

}  // namespace moe::tools
