// moe-engine bench gemm: the six grouped GEMMs of every case (FC1 and FC2 x forward, dgrad,
// wgrad) on a GPU, timed with CUDA events, with the roofline fraction and, given the JSON that the
// anchor script (torch_anchor.py) wrote in the same run, the speedup over torch._grouped_mm.
// --dtype fp8: the FP8 block-scaled GEMMs (operands quantized once, untimed) with the same GEMM in
// bf16 timed beside each, and the quantizers' own times; given the JSON of the FP8 anchor script
// (bench/drivers/fp8-anchor.py) from the same run, the speedups over torch._scaled_grouped_mm and
// over a per-expert loop of cuBLAS block-scaled GEMMs, the fraction of the same-run dense FP8 GEMM,
// and an end-to-end time (quantization + GEMM).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <iostream>
#include <nlohmann/json.hpp>
#include <vector>

#include "commands.hpp"
#include "moe_engine/moe_engine.hpp"
#include "bench_common.hpp"
#include "json_io.hpp"
#include "progress.hpp"
#include "routing.hpp"
#include "workloads.hpp"

namespace moe::tools {
namespace {

// Ceilings when no anchor is given: the H200 figures of the anchor script's reference run.
constexpr double kDefaultBf16Tflops = 787.0;
constexpr double kDefaultFp8Tflops = 1287.0;  // dense FP8 (tensorwise) on the H200, torch 2.11
constexpr double kHbmTBps = 4.27;  // device-to-device copy, read + write

struct Timing {
  double median_ms = 0, min_ms = 0;
};

// Times `op` as the anchor's triton.testing.do_bench times torch._grouped_mm, so that both sides
// of a ratio are measured alike: warm up (a quarter of `min_ms`, which also estimates one run),
// then record max(`iters`, min_ms / estimate) runs with CUDA events and no host synchronization
// between them, each after zeroing `flush` (do_bench's 256 MB "cache clear"; untimed) when given;
// the median is reported. A host wait before every run would put its host-side launch work into
// each run's interval, which do_bench hides for torch: short GEMMs would read up to 5% slow (the
// flush itself moves the suite by 0.25%; docs/performance-log.md).
template <class F>
Timing time_op(Device device, Stream stream, int warmup, int iters, double min_ms, const Tensor& flush,
               F&& op) {
  StreamTimer warm(device, stream);
  double spent = 0;
  int runs = 0;
  for (; runs < warmup || spent < min_ms / 4; ++runs) {
    warm.start();
    op();
    warm.stop();
    spent += warm.elapsed_ms();
  }
  const double estimate_ms = std::max(spent / runs, 1e-3);
  const int count = std::max(iters, int(std::ceil(min_ms / estimate_ms)));
  std::vector<std::unique_ptr<StreamTimer>> timers;
  for (int i = 0; i < count; ++i) timers.push_back(std::make_unique<StreamTimer>(device, stream));
  for (auto& timer : timers) {
    if (flush.defined()) fill_bytes(flush, 0, stream);
    timer->start();
    op();
    timer->stop();
  }
  std::vector<double> ms;
  for (auto& timer : timers) ms.push_back(timer->elapsed_ms());
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front()};
}

// Under sustained load an H200 runs at its power cap (~700 W): clocks start at boost and settle
// over about a second, with a dip as the power controller catches up. Timing from a cold start
// would favour whichever GEMMs come first, so a dense GEMM (G = 1, 8192^3) runs for `ms` first.
void settle(Device device, Stream stream, double ms) {
  if (ms <= 0) return;
  constexpr int64_t kSize = 8192;
  Tensor x = Tensor::empty({kSize, kSize}, DType::kBFloat16, device);
  Tensor w = Tensor::empty({1, kSize, kSize}, DType::kBFloat16, device);
  Tensor y = Tensor::empty({kSize, kSize}, DType::kBFloat16, device);
  fill_uniform(x, 11, -1.f, 1.f, stream);
  fill_uniform(w, 12, -0.02f, 0.02f, stream);
  DeviceRouting routing({kSize}, kSize, device, stream);
  const GroupLayout& groups = routing.layout();
  const GroupedParam W = GroupedParam::packed(w);
  StreamTimer timer(device, stream);
  for (double spent = 0; spent < ms;) {
    timer.start();
    for (int i = 0; i < 10; ++i) grouped_linear_forward(x, W, groups, y, {}, {stream, {}});
    timer.stop();
    spent += timer.elapsed_ms();
  }
  routing.check(stream);
}

struct Entry {
  std::string case_name, fc, gemm;
  double ms = 0, min_ms = 0, flops = 0, bytes = 0, tflops = 0, roofline_fraction = 0;
  double torch_ms = 0, speedup_vs_torch = 0, loop_ms = 0, speedup_vs_loop = 0;
  double bf16_ms = 0, time_ratio_vs_bf16 = 0;  // fp8: the same GEMM in bf16, same run
  // fp8 with the FP8 anchor: torch._scaled_grouped_mm (rowwise), the per-expert loop (loop_ms
  // above), the dense FP8 GEMM of the same size; what the anchor could not measure, and why
  double sgmm_ms = 0, speedup_vs_sgmm = 0, dense_fp8_ms = 0, dense_fraction = 0;
  // the dense GEMM of the same size with the recipe's block scales (1x128 x 128x128; wgrad 1x128 x
  // 1x128): the ceiling of block-scaled FP8 on this GPU, where the anchor measured it
  double dense_blockwise_ms = 0, dense_blockwise_fraction = 0;
  nlohmann::json anchor_errors = nlohmann::json::object();
  double e2e_ms = 0, e2e_ratio_vs_bf16 = 0;  // fp8: quantization + GEMM (see kE2eIncludes)
  bool in_geomean = false;
};

// The FP8 anchor's file (bench/drivers/fp8-anchor.py): its "format" and, per case, FC and GEMM,
// its paths ({fc}_{path}_{gemm}_ms).
constexpr const char* kFp8AnchorFormat = "moe-engine fp8 anchor";
const char* const kFp8AnchorPaths[] = {"scaled_grouped_mm", "loop", "dense_fp8"};

// The cases whose GEMMs are compute-bound (large per-expert GEMMs): the FP8 targets' subset.
bool compute_bound_case(const std::string& name) {
  for (const char* prefix : {"mixtral", "deepseek", "gpt-oss"})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

constexpr const char* kE2eIncludes =
    "e2e_ms = the FP8 GEMM + the quantization that produces its activation operands, each quantizer pass "
    "counted once per layer: fwd + quant_x (x rowwise and columnwise, one pass), dgrad + quant_dy (dy rowwise "
    "and columnwise, one pass), wgrad alone (its columnwise x and dy come from those two passes); quant_w "
    "(both weight copies, once per optimizer step) is not included, reported as its own entry";

// The anchor's JSON must hold what the comparison reads, checked before the long run starts.
void check_anchor(const nlohmann::json& anchor, const std::string& path) {
  auto fail = [&](const std::string& what) {
    throw_error(ErrorCode::kIo, "bench gemm: the anchor file '", path, "' ", what,
                " (expected the output of the anchor script, torch_anchor.py)");
  };
  if (!anchor.is_object() || !anchor.contains("cases") || !anchor["cases"].is_array())
    fail("has no \"cases\" array");
  if (anchor.contains("format") && anchor["format"].is_string() &&
      anchor["format"].get<std::string>().rfind(kFp8AnchorFormat, 0) == 0)
    fail("is the FP8 anchor's output (fp8-anchor.py): it goes with --dtype fp8");
  if (anchor.contains("dense_8192_tflops") && !anchor["dense_8192_tflops"].is_number())
    fail("has a dense_8192_tflops that is not a number");
  for (const nlohmann::json& c : anchor["cases"]) {
    if (!c.is_object() || !c.contains("case") || !c["case"].is_string()) fail("has a case without a \"case\" name");
    for (const char* fc : {"fc1", "fc2"})
      for (const char* key : {"_grouped_mm_fwd_ms", "_grouped_mm_dgrad_ms", "_grouped_mm_wgrad_ms", "_loop_fwd_ms"})
        if (!c.contains(fc + std::string(key)) || !c[fc + std::string(key)].is_number())
          fail("has no number " + std::string(fc) + key + " for case " + c["case"].get<std::string>());
  }
}

// The FP8 anchor's JSON: every measurement is a time in ms or {"error": "why it could not run"}.
void check_fp8_anchor(const nlohmann::json& anchor, const std::string& path) {
  auto fail = [&](const std::string& what) {
    throw_error(ErrorCode::kIo, "bench gemm --dtype fp8: the anchor file '", path, "' ", what,
                " (expected the output of bench/drivers/fp8-anchor.py)");
  };
  if (!anchor.is_object()) fail("is not a JSON object");
  if (!anchor.contains("format") || !anchor["format"].is_string() ||
      anchor["format"].get<std::string>().rfind(kFp8AnchorFormat, 0) != 0) {
    const bool bf16 = anchor.contains("cases") && anchor["cases"].is_array() && !anchor["cases"].empty() &&
                      anchor["cases"][0].is_object() && anchor["cases"][0].contains("fc1_grouped_mm_fwd_ms");
    fail(std::string("has no \"format\": \"") + kFp8AnchorFormat + " ...\"" +
         (bf16 ? " (it looks like torch_anchor.py's bf16 anchor, which goes without --dtype fp8)" : ""));
  }
  if (!anchor.contains("cases") || !anchor["cases"].is_array()) fail("has no \"cases\" array");
  if (anchor.contains("partial") && anchor["partial"] == true)
    fail("is what an interrupted run left (\"partial\": true): its last cases are missing");
  auto measurement = [](const nlohmann::json& v) {
    return (v.is_number() && v.get<double>() > 0) ||
           (v.is_object() && v.contains("error") && v["error"].is_string());
  };
  for (const char* key : {"dense_8192_tflops", "dense_fp8_8192_tflops"})
    if (anchor.contains(key) && !measurement(anchor[key]))
      fail(std::string("has a ") + key + " that is neither a positive number nor {\"error\": \"...\"} (got " +
           anchor[key].dump() + ")");
  for (const nlohmann::json& c : anchor["cases"]) {
    if (!c.is_object() || !c.contains("case") || !c["case"].is_string()) fail("has a case without a \"case\" name");
    for (const char* fc : {"fc1", "fc2"})
      for (const char* path_name : kFp8AnchorPaths)
        for (const char* gemm : {"fwd", "dgrad", "wgrad"}) {
          const std::string key = std::string(fc) + "_" + path_name + "_" + gemm + "_ms";
          if (!c.contains(key))
            fail("has no " + key + " for case " + c["case"].get<std::string>() +
                 " (expected a time in ms or {\"error\": \"...\"}; a partial file from an interrupted run?)");
          if (!measurement(c[key]))
            fail("has " + key + " for case " + c["case"].get<std::string>() +
                 " that is neither a positive number nor {\"error\": \"...\"} (got " + c[key].dump() + ")");
        }
  }
}

// An FP8 anchor measurement: its time, or 0 with its error in `errors` (also for a case it lacks).
// An optional path that the file does not have (an anchor from before it existed) is 0, no error.
double fp8_anchor_ms(const nlohmann::json* ref, const std::string& key, nlohmann::json& errors,
                     bool optional = false) {
  if (!ref || (optional && !ref->contains(key + "_ms"))) return 0;
  const nlohmann::json& v = ref->at(key + "_ms");
  if (v.is_number()) return v.get<double>();
  errors[key] = v.at("error");
  return 0;
}

const nlohmann::json* anchor_case(const nlohmann::json& anchor, const std::string& name) {
  for (const auto& c : anchor.at("cases"))
    if (c.at("case") == name) return &c;
  return nullptr;
}

// The cases whose names contain --case ("all": every case).
std::vector<Workload> select_cases(const BenchOptions& o) {
  const std::vector<Workload> all = load_workloads(find_workloads_file(o.workloads));
  std::vector<Workload> cases;
  for (const Workload& w : all)
    if (o.case_name == "all" || w.name.find(o.case_name) != std::string::npos) cases.push_back(w);
  MOE_CHECK(!cases.empty(), ErrorCode::kInvalidArgument, "bench gemm: no case matches '",
            o.case_name, "'");
  return cases;
}

void check_gemm_filter(const BenchOptions& o) {
  if (o.gemm_filter.empty()) return;
  bool known = false;
  for (const char* fc : {"fc1", "fc2"})
    for (const char* gemm : {"fwd", "dgrad", "wgrad", "wgrad_acc"})
      known |= o.gemm_filter == std::string(fc) + "/" + gemm;
  MOE_CHECK(known, ErrorCode::kInvalidArgument, "bench gemm: --gemm ", o.gemm_filter,
            ": expected fc1 or fc2, a slash, and fwd, dgrad, wgrad or wgrad_acc (e.g. fc2/wgrad)");
}

// The anchor's JSON, checked (null without --anchor).
nlohmann::json read_anchor(const BenchOptions& o, bool fp8) {
  nlohmann::json anchor;
  if (!o.anchor.empty()) {
    anchor = read_json_file(o.anchor, "the anchor results");
    if (fp8)
      check_fp8_anchor(anchor, o.anchor);
    else
      check_anchor(anchor, o.anchor);
  }
  return anchor;
}

struct GpuChoice {
  Device device;
  std::string name;
};

// bench gemm times the CUDA kernels: --device auto is the first GPU, and the CPU is an error.
GpuChoice choose_gpu(const BenchOptions& o) {
  const GpuInventory inventory = query_gpus();
  MOE_CHECK(!inventory.gpus.empty(), ErrorCode::kNotImplemented,
            "bench gemm times the CUDA kernels and needs a GPU: ", inventory.note);
  const Device device = o.device == "auto" ? Device::cuda(0) : parse_device(o.device);
  MOE_CHECK(device.is_cuda(), ErrorCode::kInvalidArgument,
            "bench gemm times the CUDA kernels: use a CUDA device");
  MOE_CHECK(size_t(device.index) < inventory.gpus.size(), ErrorCode::kDevice, "bench gemm: --device ", o.device,
            ": this process sees ", inventory.gpus.size(), " GPU(s)");
  return {device, inventory.gpus[size_t(device.index)].name};
}

struct Ceilings {
  double bf16_tflops = 0, fp8_tflops = 0;
  double peak_tflops = 0;  // the roofline's: the timed dtype's
};

// The ceilings: the anchor's dense GEMMs of the same run where it has them (the FP8 anchor may
// hold {"error": ...} instead of a number).
Ceilings ceilings_of(const nlohmann::json& anchor, bool fp8) {
  auto anchor_tflops = [&](const char* key, double fallback) {
    return anchor.contains(key) && anchor[key].is_number() ? anchor[key].get<double>() : fallback;
  };
  Ceilings c;
  c.bf16_tflops = anchor_tflops("dense_8192_tflops", kDefaultBf16Tflops);
  c.fp8_tflops = anchor_tflops("dense_fp8_8192_tflops", kDefaultFp8Tflops);
  c.peak_tflops = fp8 ? c.fp8_tflops : c.bf16_tflops;
  return c;
}

// What every timed GEMM of the run shares.
struct GemmRun {
  const BenchOptions& o;
  bool fp8 = false;
  bool fp8_anchor = false;  // fp8 with the FP8 anchor's file: its paths are compared
  DType dt = DType::kBFloat16;
  Device device;
  Stream stream = nullptr;
  int warmup = 0, iters = 0;
  const Tensor& flush;
  Ceilings ceilings;
  ProgressLine& progress;
  long total = 0;  // GEMMs (and quantizers) to time
  double estimate_s = 0;
};

// One GEMM of an FC layer, or (fp8) a quantizer, as a row of the table.
struct Gemm {
  const char* name;
  double bytes;
  std::function<void()> run;
  const char* anchor_key;  // torch._grouped_mm counterpart
  bool in_geomean;
  std::function<void()> bf16;  // fp8: the same GEMM in bf16
};

// An FC layer of a case: weights G x [N, K] on T rows of capacity, `routed` of them routed.
struct FcShape {
  int64_t G = 0, T = 0, N = 0, K = 0, routed = 0;
};

FcShape fc_shape(const Workload& w, bool fc1) {
  const int64_t G = w.experts, T = w.capacity, routed = w.routed_tokens();
  const int64_t N = fc1 ? w.fc1_rows() : w.hidden, K = fc1 ? w.hidden : w.ffn;
  return {G, T, N, K, routed};
}

// An FC layer's operands on the GPU: x, the weights and dy filled at random; the outputs.
struct FcTensors {
  Tensor x, wt, y, dy, dx, dw, main_grad;
  GroupedParam W;
  ExecContext ctx;
};

FcTensors make_fc_tensors(const FcShape& s, DType dt, Device device, Stream stream, uint64_t seed) {
  const auto [G, T, N, K, routed] = s;
  FcTensors t;
  t.x = Tensor::empty({T, K}, dt, device);
  t.wt = Tensor::empty({G, N, K}, dt, device);
  t.y = Tensor::empty({T, N}, dt, device);
  t.dy = Tensor::empty({T, N}, dt, device);
  t.dx = Tensor::empty({T, K}, dt, device);
  t.dw = Tensor::empty({G, N, K}, dt, device);
  t.main_grad = Tensor::zeros({G, N, K}, DType::kFloat32, device);
  const float a = float(std::sqrt(3.0 / double(K)));
  fill_uniform(t.x, seed, -1.f, 1.f, stream);
  fill_uniform(t.wt, seed + 1, -a, a, stream);
  fill_uniform(t.dy, seed + 2, -1.f, 1.f, stream);
  t.W = GroupedParam::packed(t.wt);
  t.ctx = ExecContext{stream, {}};
  return t;
}

// The four GEMMs of an FC layer in its dtype (`e` bytes an element); wgrad_acc accumulates into
// the fp32 main_grad.
std::vector<Gemm> gemms_of(FcTensors& t, const GroupLayout& groups, const FcShape& s, double e) {
  const auto [G, T, N, K, routed] = s;
  const double weights = double(G) * double(N) * double(K);
  return {
      {"fwd", e * (routed * K + weights + routed * N),
       [&] { grouped_linear_forward(t.x, t.W, groups, t.y, {}, t.ctx); }, "grouped_mm_fwd", true, nullptr},
      {"dgrad", e * (routed * N + weights + routed * K),
       [&] { grouped_linear_dgrad(t.dy, t.W, groups, t.dx, t.ctx); }, "grouped_mm_dgrad", true, nullptr},
      {"wgrad", e * (routed * N + routed * K + weights),
       [&] {
         grouped_linear_wgrad(t.dy, t.x, groups, GroupedParam::packed(t.dw), GradMode::kWrite, t.ctx);
       },
       "grouped_mm_wgrad", true, nullptr},
      {"wgrad_acc", e * (routed * N + routed * K) + 8.0 * weights,
       [&] {
         grouped_linear_wgrad(t.dy, t.x, groups, GroupedParam::packed(t.main_grad),
                              GradMode::kAccumulate, t.ctx);
       },
       "grouped_mm_wgrad", false, nullptr},
  };
}

// An FC layer's operands in FP8 (undefined without fp8).
struct Fp8Operands {
  Tensor xq, xs, xcq, xcs, dyq, dys, dycq, dycs, col_x, col_dy, wq, ws, wqt, wst;
  Fp8Rows x_rows, dy_rows;
  Fp8Columns x_cols, dy_cols;
  Fp8Weight w_q;
};

Fp8Operands make_fp8_operands(const FcShape& s, bool fp8, Device device) {
  const auto [G, T, N, K, routed] = s;
  const int64_t C = fp8_columns_capacity(T, G), S = fp8_scales_pitch(T);
  auto blocks = [](int64_t n) { return (n + 127) / 128; };
  auto f8 = [&](Shape shape) { return fp8 ? Tensor::empty(shape, DType::kFloat8E4M3, device) : Tensor(); };
  auto f32 = [&](Shape shape) { return fp8 ? Tensor::empty(shape, DType::kFloat32, device) : Tensor(); };
  auto i64 = [&](Shape shape) { return fp8 ? Tensor::empty(shape, DType::kInt64, device) : Tensor(); };
  Fp8Operands q;
  q.xq = f8({T, K});
  q.xs = f32({blocks(K), S});
  q.xcq = f8({K, C});
  q.xcs = f32({C / 128, K});
  q.dyq = f8({T, N});
  q.dys = f32({blocks(N), S});
  q.dycq = f8({N, C});
  q.dycs = f32({C / 128, N});
  q.col_x = i64({G + 1});
  q.col_dy = i64({G + 1});
  q.wq = f8({G, N, K});
  q.ws = f32({G, blocks(N), blocks(K)});
  q.wqt = f8({G, K, N});
  q.wst = f32({G, blocks(K), blocks(N)});
  q.x_rows = {q.xq, q.xs};
  q.dy_rows = {q.dyq, q.dys};
  q.x_cols = {q.xcq, q.xcs, q.col_x};
  q.dy_cols = {q.dycq, q.dycs, q.col_dy};
  q.w_q = {q.wq, q.ws, q.wqt, q.wst};
  return q;
}

// FP8: the operands quantized once, then the FP8 GEMMs, each with its bf16 twin of `gemms` timed
// beside it, and the quantizers as entries of their own.
std::vector<Gemm> fp8_gemms_of(FcTensors& t, Fp8Operands& q, const GroupLayout& groups, const FcShape& s, double e,
                               const std::vector<Gemm>& gemms) {
  const auto [G, T, N, K, routed] = s;
  const double weights = double(G) * double(N) * double(K);
  const double q_in = 2.0 * double(routed), q_out = double(routed) + 4.0 * double(routed) / 128;
  auto quantize_x = [&] { quantize_fp8(t.x, groups, q.x_rows, q.x_cols, {}, t.ctx); };
  auto quantize_dy = [&] { quantize_fp8(t.dy, groups, q.dy_rows, q.dy_cols, {}, t.ctx); };
  auto quantize_w = [&] { quantize_fp8_weight(t.W, q.w_q, {}, t.ctx); };
  quantize_x();
  quantize_dy();
  quantize_w();
  const double e8 = 1.0;
  return {
      {"fwd", e8 * (routed * K + weights) + e * routed * N,
       [&] { grouped_linear_forward(q.x_rows, q.w_q, groups, t.y, {}, t.ctx); }, nullptr, true, gemms[0].run},
      {"dgrad", e8 * (routed * N + weights) + e * routed * K,
       [&] { grouped_linear_dgrad(q.dy_rows, q.w_q, groups, t.dx, t.ctx); }, nullptr, true, gemms[1].run},
      {"wgrad", e8 * (routed * N + routed * K) + e * weights,
       [&] { grouped_linear_wgrad(q.dy_cols, q.x_cols, groups, GroupedParam::packed(t.dw), GradMode::kWrite, t.ctx); },
       nullptr, true, gemms[2].run},
      {"wgrad_acc", e8 * (routed * N + routed * K) + 8.0 * weights,
       [&] {
         grouped_linear_wgrad(q.dy_cols, q.x_cols, groups, GroupedParam::packed(t.main_grad), GradMode::kAccumulate,
                              t.ctx);
       },
       nullptr, false, gemms[3].run},
      // Quantizers: bf16 read, rows + columns (+ scales) written; weights: both copies.
      {"quant_x", K * (q_in + 2 * q_out), quantize_x, nullptr, false, nullptr},
      {"quant_dy", N * (q_in + 2 * q_out), quantize_dy, nullptr, false, nullptr},
      {"quant_w", weights * (2.0 + 2.0), quantize_w, nullptr, false, nullptr},
  };
}

// Times `g` (and its bf16 twin) and compares it with the anchor's case `ref` where given.
Entry time_gemm(const GemmRun& run, const Workload& w, const std::string& fc, const Gemm& g, double flops,
                const nlohmann::json* ref) {
  const bool quantizer = std::string(g.name).rfind("quant", 0) == 0;
  const Timing t = time_op(run.device, run.stream, run.warmup, run.iters, run.o.min_time_ms, run.flush, g.run);
  Entry en;
  en.case_name = w.name;
  en.fc = fc;
  en.gemm = g.name;
  en.ms = t.median_ms;
  en.min_ms = t.min_ms;
  en.flops = quantizer ? 0 : flops;
  en.bytes = g.bytes;
  en.tflops = en.flops / (t.median_ms * 1e9);
  const double floor_ms = std::max(en.flops / (run.ceilings.peak_tflops * 1e9), g.bytes / (kHbmTBps * 1e9));
  en.roofline_fraction = floor_ms / t.median_ms;
  en.in_geomean = g.in_geomean;
  if (g.bf16) {
    en.bf16_ms = time_op(run.device, run.stream, run.warmup, run.iters, run.o.min_time_ms, run.flush, g.bf16).median_ms;
    en.time_ratio_vs_bf16 = en.ms / en.bf16_ms;
  }
  if (ref && g.anchor_key) {
    en.torch_ms = ref->at(fc + "_" + g.anchor_key + "_ms").get<double>();
    en.speedup_vs_torch = en.torch_ms / en.ms;
    if (std::string(g.name) == "fwd" && !run.fp8) {
      en.loop_ms = ref->at(fc + "_loop_fwd_ms").get<double>();
      en.speedup_vs_loop = en.loop_ms / en.ms;
    }
  }
  if (run.fp8_anchor && g.in_geomean) {  // fwd, dgrad, wgrad: the FP8 anchor's paths
    if (!ref) en.anchor_errors["case"] = "the anchor file has no case " + w.name;
    const std::string key = "_" + std::string(g.name);
    en.sgmm_ms = fp8_anchor_ms(ref, fc + "_scaled_grouped_mm" + key, en.anchor_errors);
    en.loop_ms = fp8_anchor_ms(ref, fc + "_loop" + key, en.anchor_errors);
    en.dense_fp8_ms = fp8_anchor_ms(ref, fc + "_dense_fp8" + key, en.anchor_errors);
    if (en.sgmm_ms > 0) en.speedup_vs_sgmm = en.sgmm_ms / en.ms;
    if (en.loop_ms > 0) en.speedup_vs_loop = en.loop_ms / en.ms;
    en.dense_blockwise_ms = fp8_anchor_ms(ref, fc + "_dense_fp8_blockwise" + key, en.anchor_errors, true);
    if (en.dense_fp8_ms > 0) en.dense_fraction = en.dense_fp8_ms / en.ms;  // our TFLOP/s over its
    if (en.dense_blockwise_ms > 0) en.dense_blockwise_fraction = en.dense_blockwise_ms / en.ms;
  }
  return en;
}

void print_entry(const GemmRun& run, const Entry& en) {
  const bool fp8 = run.fp8;
  std::printf("%-36s %-4s %-10s %9.4f %8.1f %9.3f %9.4f %8.3f", en.case_name.c_str(), en.fc.c_str(), en.gemm.c_str(),
              en.ms, en.tflops, en.roofline_fraction, fp8 ? en.sgmm_ms : en.torch_ms,
              fp8 ? en.speedup_vs_sgmm : en.speedup_vs_torch);
  if (en.bf16_ms > 0) std::printf("   bf16 %.4f ms: fp8/bf16 %.3f", en.bf16_ms, en.time_ratio_vs_bf16);
  if (run.fp8_anchor && en.in_geomean)
    std::printf("  vs loop %.3f  of dense %.3f%s", en.speedup_vs_loop, en.dense_fraction,
                en.anchor_errors.empty() ? "" : "  (anchor errors: see the JSON)");
  std::printf("\n");
  std::fflush(stdout);
}

// FP8, end to end (kE2eIncludes): each GEMM of one FC layer (the entries from `fc_first` on) with
// the quantizer pass that makes its operands. Returns the table's line of them (empty if none).
std::string add_e2e_times(std::vector<Entry>& entries, size_t fc_first) {
  std::map<std::string, double> quant_ms;
  for (size_t i = fc_first; i < entries.size(); ++i)
    if (entries[i].gemm.rfind("quant", 0) == 0) quant_ms[entries[i].gemm] = entries[i].ms;
  const std::map<std::string, std::string> quantizer = {{"fwd", "quant_x"}, {"dgrad", "quant_dy"}, {"wgrad", ""}};
  std::string line;
  for (size_t i = fc_first; i < entries.size(); ++i) {
    Entry& en = entries[i];
    const auto q = quantizer.find(en.gemm);
    if (q == quantizer.end() || en.bf16_ms <= 0) continue;
    if (!q->second.empty() && !quant_ms.count(q->second)) continue;  // --gemm: the quantizer did not run
    en.e2e_ms = en.ms + (q->second.empty() ? 0.0 : quant_ms[q->second]);
    en.e2e_ratio_vs_bf16 = en.e2e_ms / en.bf16_ms;
    char part[96];
    std::snprintf(part, sizeof part, "  %s %.4f ms (%.3f)", en.gemm.c_str(), en.e2e_ms, en.e2e_ratio_vs_bf16);
    line += part;
  }
  return line;
}

// Times the GEMMs of one FC layer of case `w` (the anchor's case `ref`), one table row and entry
// each.
void time_fc_layer(const GemmRun& run, const Workload& w, bool fc1, DeviceRouting& routing, const nlohmann::json* ref,
                   std::vector<Entry>& entries) {
  const FcShape s = fc_shape(w, fc1);
  const std::string fc = fc1 ? "fc1" : "fc2";
  const GroupLayout& groups = routing.layout();
  FcTensors t = make_fc_tensors(s, run.dt, run.device, run.stream, run.o.seed);
  const double flops = 2.0 * double(s.routed) * double(s.N) * double(s.K);
  const double e = double(dtype_size(run.dt));
  const std::vector<Gemm> gemms = gemms_of(t, groups, s, e);
  Fp8Operands q = make_fp8_operands(s, run.fp8, run.device);
  std::vector<Gemm> run_list = gemms;
  if (run.fp8) run_list = fp8_gemms_of(t, q, groups, s, e, gemms);
  const size_t fc_first = entries.size();
  for (const Gemm& g : run_list) {
    if (!run.o.gemm_filter.empty() && run.o.gemm_filter != fc + "/" + g.name) continue;
    const Entry en = time_gemm(run, w, fc, g, flops, ref);
    run.progress.clear();
    print_entry(run, en);
    entries.push_back(en);
    run.progress.update("GEMMs", long(entries.size()), run.total, "timed", run.estimate_s);
  }
  if (run.fp8) {
    const std::string line = add_e2e_times(entries, fc_first);
    if (!line.empty()) {
      run.progress.clear();
      std::printf("%-36s %-4s e2e, quantization + GEMM (/ bf16):%s\n", w.name.c_str(), fc.c_str(), line.c_str());
    }
  }
  routing.check(run.stream);
}

// Geomean, min and max of the entries' figures (null in the JSON where no entry has one).
struct Stat {
  double log_sum = 0, min = 1e300, max = 0;
  int n = 0;
  void add(double v) {
    log_sum += std::log(v);
    min = std::min(min, v);
    max = std::max(max, v);
    ++n;
  }
  double mean() const { return n ? std::exp(log_sum / n) : 0.0; }
  nlohmann::json geomean() const { return n ? nlohmann::json(mean()) : nlohmann::json(nullptr); }
  nlohmann::json lowest() const { return n ? nlohmann::json(min) : nlohmann::json(nullptr); }
  nlohmann::json highest() const { return n ? nlohmann::json(max) : nlohmann::json(nullptr); }
};

// The figures over the GEMMs of the geomean (fc1/fc2 x fwd/dgrad/wgrad) that have them.
struct Summary {
  Stat vs_torch, vs_bf16;
  // FP8 only; cb: over the compute-bound cases (the FP8 targets' subset).
  Stat vs_sgmm, vs_loop, tflops_cb, tflops_wgrad_cb, dense_cb, blockwise_cb, blockwise_wgrad_cb, e2e, e2e_cb;
};

Summary summarize(const std::vector<Entry>& entries, bool fp8) {
  Summary s;
  for (const Entry& en : entries) {
    if (!en.in_geomean) continue;
    if (en.speedup_vs_torch > 0) s.vs_torch.add(en.speedup_vs_torch);
    if (en.time_ratio_vs_bf16 > 0) s.vs_bf16.add(en.time_ratio_vs_bf16);
  }
  for (const Entry& en : entries) {
    if (!fp8 || !en.in_geomean) continue;
    const bool cb = compute_bound_case(en.case_name), fwd_dgrad = en.gemm == "fwd" || en.gemm == "dgrad";
    if (en.speedup_vs_sgmm > 0) s.vs_sgmm.add(en.speedup_vs_sgmm);
    if (en.speedup_vs_loop > 0) s.vs_loop.add(en.speedup_vs_loop);
    if (cb && fwd_dgrad) s.tflops_cb.add(en.tflops);
    if (cb && en.gemm == "wgrad") s.tflops_wgrad_cb.add(en.tflops);
    if (cb && fwd_dgrad && en.dense_fraction > 0) s.dense_cb.add(en.dense_fraction);
    if (cb && en.dense_blockwise_fraction > 0)
      (fwd_dgrad ? s.blockwise_cb : s.blockwise_wgrad_cb).add(en.dense_blockwise_fraction);
    if (en.e2e_ratio_vs_bf16 > 0) s.e2e.add(en.e2e_ratio_vs_bf16);
    if (cb && en.e2e_ratio_vs_bf16 > 0) s.e2e_cb.add(en.e2e_ratio_vs_bf16);
  }
  return s;
}

// A figure of the summary, or why there is none (no such GEMM among the cases run).
std::string figure_or_none(int n, double value, const char* format) {
  if (n == 0) return std::string("none in this run");
  char text[32];
  std::snprintf(text, sizeof text, format, value);
  return std::string(text);
}

void print_summary(const Summary& s) {
  if (s.vs_bf16.n)
    std::printf("geomean FP8 / bf16 time over %d GEMMs: %.3f (max %.3f)\n", s.vs_bf16.n, s.vs_bf16.mean(),
                s.vs_bf16.max);
  if (s.vs_torch.n)
    std::printf("geomean speedup vs torch._grouped_mm over %d GEMMs: %.3f (min %.3f)\n", s.vs_torch.n,
                s.vs_torch.mean(), s.vs_torch.min);
  if (s.tflops_cb.n)
    std::printf("compute-bound cases (mixtral, deepseek, gpt-oss): min FP8 TFLOP/s forward/dgrad %.1f, wgrad %s\n",
                s.tflops_cb.min, figure_or_none(s.tflops_wgrad_cb.n, s.tflops_wgrad_cb.min, "%.1f").c_str());
  if (s.vs_sgmm.n)
    std::printf("geomean speedup vs torch._scaled_grouped_mm (rowwise) over %d GEMMs: %.3f (min %.3f)\n", s.vs_sgmm.n,
                s.vs_sgmm.mean(), s.vs_sgmm.min);
  if (s.vs_loop.n)
    std::printf("geomean speedup vs the per-expert block-scaled cuBLAS loop over %d GEMMs: %.3f (min %.3f)\n",
                s.vs_loop.n, s.vs_loop.mean(), s.vs_loop.min);
  if (s.dense_cb.n)
    std::printf("compute-bound forward/dgrad: min fraction of the same-run dense FP8 GEMM %.3f\n", s.dense_cb.min);
  if (s.blockwise_cb.n)
    std::printf(
        "compute-bound: min fraction of the same-run dense block-scaled FP8 GEMM %.3f (forward/dgrad), "
        "%s (wgrad)\n",
        s.blockwise_cb.min, figure_or_none(s.blockwise_wgrad_cb.n, s.blockwise_wgrad_cb.min, "%.3f").c_str());
  if (s.e2e.n)
    std::printf("end to end (quantization + GEMM) / bf16: geomean %.3f, max on compute-bound cases %s\n", s.e2e.mean(),
                figure_or_none(s.e2e_cb.n, s.e2e_cb.max, "%.3f").c_str());
}

nlohmann::json entry_json(const Entry& en, bool fp8) {
  nlohmann::json e = {{"case", en.case_name},
                      {"fc", en.fc},
                      {"gemm", en.gemm},
                      {"ms", en.ms},
                      {"min_ms", en.min_ms},
                      {"tflops", en.tflops},
                      {"roofline_fraction", en.roofline_fraction},
                      {"flops", en.flops},
                      {"bytes", en.bytes},
                      {"in_geomean", en.in_geomean}};
  if (en.torch_ms > 0) {
    e["torch_grouped_mm_ms"] = en.torch_ms;
    e["speedup_vs_torch"] = en.speedup_vs_torch;
  }
  if (en.bf16_ms > 0) {
    e["bf16_ms"] = en.bf16_ms;
    e["time_ratio_fp8_vs_bf16"] = en.time_ratio_vs_bf16;
  }
  if (en.loop_ms > 0 && !fp8) {
    e["cublas_loop_ms"] = en.loop_ms;
    e["speedup_vs_cublas_loop"] = en.speedup_vs_loop;
  }
  if (en.sgmm_ms > 0) {
    e["torch_scaled_grouped_mm_ms"] = en.sgmm_ms;
    e["speedup_vs_torch_scaled_grouped_mm"] = en.speedup_vs_sgmm;
  }
  if (en.loop_ms > 0 && fp8) {
    e["per_expert_loop_ms"] = en.loop_ms;
    e["speedup_vs_per_expert_loop"] = en.speedup_vs_loop;
  }
  if (en.dense_fp8_ms > 0) {
    e["dense_fp8_ms"] = en.dense_fp8_ms;
    e["dense_fp8_tflops"] = en.flops / (en.dense_fp8_ms * 1e9);
    e["fraction_of_dense_fp8"] = en.dense_fraction;
  }
  if (en.dense_blockwise_ms > 0) {
    e["dense_fp8_blockwise_ms"] = en.dense_blockwise_ms;
    e["dense_fp8_blockwise_tflops"] = en.flops / (en.dense_blockwise_ms * 1e9);
    e["fraction_of_dense_fp8_blockwise"] = en.dense_blockwise_fraction;
  }
  if (en.e2e_ms > 0) {
    e["e2e_ms"] = en.e2e_ms;
    e["time_ratio_e2e_vs_bf16"] = en.e2e_ratio_vs_bf16;
  }
  if (!en.anchor_errors.empty()) e["anchor_errors"] = en.anchor_errors;
  return e;
}

// --json-out: the run's settings, ceilings and summary, and every entry.
void write_json_report(const GemmRun& run, const std::string& gpu_name, const nlohmann::json& anchor, const Summary& s,
                       const std::vector<Entry>& entries) {
  const BenchOptions& o = run.o;
  const bool fp8 = run.fp8;
  nlohmann::json j;
  j["device"] = gpu_name;
  j["command"] = o.command_line;
  j["dtype"] = fp8 ? "fp8" : dtype_name(run.dt);
  if (s.vs_bf16.n) {
    j["geomean_time_ratio_fp8_vs_bf16"] = s.vs_bf16.mean();
    j["max_time_ratio_fp8_vs_bf16"] = s.vs_bf16.max;
  }
  if (fp8) {
    // null where this run has no such figure (no anchor given, or none of its entries measured)
    j["min_fp8_tflops_compute_bound"] = s.tflops_cb.lowest();
    j["min_fp8_tflops_wgrad_compute_bound"] = s.tflops_wgrad_cb.lowest();
    j["min_fraction_of_dense_fp8_compute_bound"] = s.dense_cb.lowest();
    j["min_fraction_of_dense_fp8_blockwise_compute_bound"] = s.blockwise_cb.lowest();
    j["min_fraction_of_dense_fp8_blockwise_wgrad_compute_bound"] = s.blockwise_wgrad_cb.lowest();
    j["geomean_speedup_vs_torch_scaled_grouped_mm"] = s.vs_sgmm.geomean();
    j["min_speedup_vs_torch_scaled_grouped_mm"] = s.vs_sgmm.lowest();
    j["geomean_speedup_vs_per_expert_loop"] = s.vs_loop.geomean();
    j["min_speedup_vs_per_expert_loop"] = s.vs_loop.lowest();
    j["geomean_time_ratio_e2e_vs_bf16"] = s.e2e.geomean();
    j["max_time_ratio_e2e_vs_bf16_compute_bound"] = s.e2e_cb.highest();
    j["compute_bound_cases"] = "names starting with mixtral, deepseek or gpt-oss; TFLOP/s and dense fractions "
                               "over their forward and dgrad GEMMs (wgrad: its own key)";
    j["e2e_includes"] = kE2eIncludes;
  }
  j["iters"] = run.iters;
  j["timing"] = "as triton.testing.do_bench (the anchor's): median over >= min_time_ms of runs, " +
                (o.l2_flush_mb > 0 ? std::to_string(int(o.l2_flush_mb)) + " MB zeroed before each"
                                   : std::string("no flush between runs"));
  auto source = [&](const char* key) {
    if (anchor.is_null()) return std::string("default (no anchor given)");
    if (anchor.contains(key) && anchor[key].is_number()) return "anchor " + std::string(key) + ", same run";
    return "default (the anchor has no " + std::string(key) + ")";
  };
  j["ceilings"] = {{"bf16_tflops", run.ceilings.bf16_tflops},
                   {"roofline_tflops", run.ceilings.peak_tflops},
                   {"hbm_TBps", kHbmTBps},
                   {"bf16_source", source("dense_8192_tflops")}};
  if (fp8) {
    j["ceilings"]["fp8_tflops"] = run.ceilings.fp8_tflops;
    j["ceilings"]["fp8_source"] = source("dense_fp8_8192_tflops");
  }
  auto text = [&](const char* key) {
    return anchor.contains(key) && anchor[key].is_string() ? anchor[key].get<std::string>() : std::string();
  };
  if (!anchor.is_null()) j["anchor"] = {{"file", o.anchor}, {"torch", text("torch")}};
  if (run.fp8_anchor) {
    j["anchor"]["device"] = text("device");
    j["anchor"]["timing"] = text("timing");
    if (anchor.contains("paths")) j["anchor"]["paths"] = anchor["paths"];
    if (anchor.contains("fast_accum")) j["anchor"]["fast_accum"] = anchor["fast_accum"];
  }
  j["geomean_speedup_vs_torch"] = s.vs_torch.geomean();
  j["min_speedup_vs_torch"] = s.vs_torch.lowest();
  j["geomean_over"] =
      "fc1/fc2 x fwd/dgrad/wgrad (wgrad: write mode, bf16 output, as torch); wgrad_acc reported "
      "beside";
  for (const Entry& en : entries) j["entries"].push_back(entry_json(en, fp8));
  write_json_file(o.json_out, j, "--json-out");
}

}  // namespace

int run_bench_gemm(const BenchOptions& o) {
  const std::vector<Workload> cases = select_cases(o);
  check_gemm_filter(o);
  // Checked before any GPU work, as the files are.
  const BenchDType parsed_dtype = parse_bench_dtype(o.dtype, "bench gemm", true);
  const bool fp8 = parsed_dtype.fp8;
  // Files first: a bad path fails now, not after the run.
  const nlohmann::json anchor = read_anchor(o, fp8);
  if (!o.json_out.empty()) check_json_output_path(o.json_out, "--json-out");
  const GpuChoice gpu = choose_gpu(o);
  const Device device = gpu.device;

  const Stream stream = nullptr;
  settle(device, stream, o.settle_ms);
  const Tensor flush = o.l2_flush_mb > 0
                           ? Tensor::empty({int64_t(o.l2_flush_mb * 1e6)}, DType::kUInt8, device)
                           : Tensor();
  // Each GEMM warms up for a quarter of min_time_ms, then runs at least min_time_ms; buffers and
  // the first launches add about 50 ms.
  // 2 layers x 4 GEMMs, or the one (fp8: each beside its bf16 twin, and 3 quantizers per layer)
  const long total = long(cases.size()) * (o.gemm_filter.empty() ? (fp8 ? 22 : 8) : (fp8 ? 2 : 1));
  const double estimate_s = o.settle_ms * 1e-3 + double(total) * (1.25 * o.min_time_ms + 50) * 1e-3;
  std::printf("bench gemm: %ld GEMMs of %zu case(s) on %s (%s), each timed for >= %g ms: about %s\n", total,
              cases.size(), to_string(device).c_str(), gpu.name.c_str(), o.min_time_ms,
              format_duration(estimate_s).c_str());
  // fp8: the torch columns are torch._scaled_grouped_mm's (rowwise FP8)
  std::printf("%-36s %-4s %-10s %9s %8s %9s %9s %8s\n", "case", "fc", "gemm", "ms", "TFLOP/s",
              "roofline", fp8 ? "sgmm ms" : "torch ms", "speedup");
  std::fflush(stdout);
  ProgressLine progress(!o.json);
  progress.update("GEMMs", 0, total, "timed", estimate_s);
  const GemmRun run{.o = o,
                    .fp8 = fp8,
                    .fp8_anchor = fp8 && !anchor.is_null(),
                    // FP8: the bf16 tensors are quantized; the bf16 GEMMs run beside the FP8 ones.
                    .dt = parsed_dtype.dtype,
                    .device = device,
                    .stream = stream,
                    .warmup = std::max(o.warmup, 2),
                    .iters = o.iters > 0 ? o.iters : 20,
                    .flush = flush,
                    .ceilings = ceilings_of(anchor, fp8),
                    .progress = progress,
                    .total = total,
                    .estimate_s = estimate_s};
  std::vector<Entry> entries;
  for (const Workload& w : cases) {
    DeviceRouting routing(w.tokens_per_expert, w.capacity, device, stream);
    const nlohmann::json* ref = anchor.is_null() ? nullptr : anchor_case(anchor, w.name);
    for (const bool fc1 : {true, false}) time_fc_layer(run, w, fc1, routing, ref, entries);
  }
  progress.clear();
  const Summary summary = summarize(entries, fp8);
  print_summary(summary);
  if (!o.json_out.empty()) write_json_report(run, gpu.name, anchor, summary, entries);
  return 0;
}

}  // namespace moe::tools
