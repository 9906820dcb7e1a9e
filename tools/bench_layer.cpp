// moe-engine bench layer: the whole MoE layer (moe::MoELayer) forward + backward over the suite's
// model shapes, with a breakdown into its four stages (router, permute, experts, unpermute), each
// timed on its own with the layer's shapes.
//
// Routing is balanced by construction, as the suite's balanced cases: token t picks experts
// (t k + j) mod E, j < k. The router weight is one-hot (W[e, e] = 1) and x[t] holds 1 - j / 100 at
// column (t k + j) mod E and uniform noise of +-0.01 elsewhere, so the logits are x[t, 0..E) and
// the top-k are those experts; with T k a multiple of E every expert gets T k / E assignments. The
// experts' values are what GroupedMLP initializes; x's other columns are the noise.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "bench_device.hpp"
#include "commands.hpp"
#include "moe_engine/moe_engine.hpp"
#include "progress.hpp"
#include "workloads.hpp"

namespace moe::tools {
namespace {

// One model's layer: E experts of H -> F -> H, k of them per token, T tokens before the top-k.
struct LayerShape {
  std::string name;  // the model
  int64_t experts = 0, hidden = 0, ffn = 0, topk = 0, tokens = 0;
  std::string activation;
  bool bias = false;
  bool sigmoid = false;  // DeepSeek-V3's router: sigmoid scores, expert bias, scaling 2.5

  int64_t assignments() const { return tokens * topk; }
  // FLOPs of forward + backward: the experts' 3 passes x 2 x T k (W H + H F), and the router's
  // three products 2 T E H (logits, dx, dweight).
  double flops() const {
    const int64_t w = fc1_width(GluSpec{parse_activation(activation)}, ffn);
    return 6.0 * double(assignments()) * double(w * hidden + hidden * ffn) + 6.0 * double(tokens * experts * hidden);
  }
};

// Odd sizes that run anywhere in a moment.
LayerShape tiny_layer() { return {"tiny", 6, 64, 48, 2, 51, "swiglu", false, false}; }

// One shape per model of bench/workloads.json (its balanced case): the experts' tokens are T k, and
// k is the note's "top-N". The file is checked as bench mlp checks it (load_workloads).
std::vector<LayerShape> suite_layers(const std::string& workloads) {
  const std::string path = find_workloads_file(workloads);
  std::vector<LayerShape> out;
  const std::regex topk_pattern("top-([0-9]+)");
  for (const Workload& w : load_workloads(path)) {
    if (w.routing != "balanced") continue;
    const std::string where = "bench layer: case '" + w.name + "' of the workloads file '" + path + "'";
    std::smatch m;
    MOE_CHECK(std::regex_search(w.note, m, topk_pattern), ErrorCode::kIo, where, ": its note '", w.note,
              "' names no top-k ('top-N')");
    MOE_CHECK(!w.model.empty(), ErrorCode::kIo, where, ": it names no model (\"model\")");
    LayerShape s;
    s.name = w.model;
    s.experts = w.experts;
    s.hidden = w.hidden;
    s.ffn = w.ffn;
    s.topk = m[1].length() > 9 ? -1 : std::stoll(m[1].str());
    MOE_CHECK(s.topk >= 1 && s.topk <= s.experts && w.capacity / s.topk >= 1, ErrorCode::kIo, where,
              ": its note's top-", m[1].str(), " needs 1 <= k <= experts = ", s.experts, " and k <= tokens = ",
              w.capacity);
    s.tokens = w.capacity / s.topk;
    s.activation = w.activation;
    s.bias = w.bias;
    s.sigmoid = s.name.find("deepseek") != std::string::npos;
    out.push_back(s);
  }
  return out;
}

// The host memory a CPU run of one shape holds at most, rounded up: the parameters, their float32
// main_grads, and the activations of the layer's two live forward contexts (the timed one and the
// check's), the experts stage's, backward's gradients and the stages' own buffers.
double layer_bytes(const LayerShape& s, DType dtype) {
  const double e = double(dtype_size(dtype)), E = double(s.experts), H = double(s.hidden), F = double(s.ffn),
               W = double(fc1_width(GluSpec{parse_activation(s.activation)}, s.ffn)), T = double(s.tokens),
               R = double(permuted_rows(s.tokens, s.topk, s.experts));
  const double params = E * H + E * (W * H + H * F) + (s.bias ? E * (W + H) : 0.0);
  const double per_row = 3 * (2 * H + W + F) + (2 * H + W + F) + 3 * H;  // contexts, backward, stages
  return params * (e + 4) + e * (R * per_row + 6 * T * H) + 4 * 8 * T * double(s.topk + s.experts);
}

struct Stats {
  double median = 0, min = 0;
};

Stats stats_of(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return {n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]), v.front()};
}

// Forward and backward times of one stage (or the layer), run by run.
struct Timing {
  std::vector<double> forward, backward, total;
  void add(double f, double b) {
    forward.push_back(f);
    backward.push_back(b);
    total.push_back(f + b);
  }
  nlohmann::json json() const {
    auto j = [](const std::vector<double>& v) {
      const Stats s = stats_of(v);
      return nlohmann::json{{"median", s.median}, {"min", s.min}};
    };
    return {{"forward", j(forward)}, {"backward", j(backward)}, {"total", j(total)}};
  }
};

// Runs `forward` then `backward` `runs` times, recorded back to back (CUDA events, no host waits
// between runs), and adds the times of the last `timed` runs.
template <class Fwd, class Bwd>
void time_runs(Device device, Stream stream, int warmup, int iters, Timing& t, Fwd&& forward, Bwd&& backward) {
  for (int i = 0; i < warmup; ++i) {
    forward();
    backward();
  }
  std::vector<std::unique_ptr<StreamTimer>> f, b;
  for (int i = 0; i < iters; ++i) {
    f.push_back(std::make_unique<StreamTimer>(device, stream));
    b.push_back(std::make_unique<StreamTimer>(device, stream));
    f.back()->start();
    forward();
    f.back()->stop();
    b.back()->start();
    backward();
    b.back()->stop();
  }
  for (int i = 0; i < iters; ++i) t.add(f[size_t(i)]->elapsed_ms(), b[size_t(i)]->elapsed_ms());
}

// x [T, H] with the balanced routing's columns (see the top of the file), built on the host.
Tensor balanced_input(const LayerShape& s, DType dtype, uint64_t seed) {
  Tensor x = Tensor::empty({s.tokens, s.hidden}, dtype);
  fill_uniform(x, seed, -0.01f, 0.01f);
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t j = 0; j < s.topk; ++j) {
      const int64_t i = t * s.hidden + (t * s.topk + j) % s.experts;
      const float v = 1.0f - 0.01f * float(j);
      switch (dtype) {
        case DType::kFloat32: x.data_as<float>()[i] = v; break;
        case DType::kBFloat16: x.data_as<BFloat16>()[i] = BFloat16(v); break;
        default: x.data_as<Float16>()[i] = Float16(v); break;
      }
    }
  return x;
}

Tensor one_hot_router_weight(const LayerShape& s, DType dtype) {
  Tensor w = Tensor::zeros({s.experts, s.hidden}, dtype);
  for (int64_t e = 0; e < s.experts; ++e) {
    const int64_t i = e * s.hidden + e;
    switch (dtype) {
      case DType::kFloat32: w.data_as<float>()[i] = 1.f; break;
      case DType::kBFloat16: w.data_as<BFloat16>()[i] = BFloat16(1.f); break;
      default: w.data_as<Float16>()[i] = Float16(1.f); break;
    }
  }
  return w;
}

struct ShapeResult {
  LayerShape shape;
  Timing layer, router, permute, experts, unpermute;
  int64_t min_split = 0, max_split = 0;
  int64_t saved_bytes = 0;
};

std::vector<int64_t> host_int64s(const Tensor& t) {
  const Tensor h = t.to(Device::cpu());
  return std::vector<int64_t>(h.data_as<int64_t>(), h.data_as<int64_t>() + h.numel());
}

ShapeResult run_shape(const LayerShape& s, DType dtype, Device device, const BenchOptions& o, int iters) {
  MOE_CHECK(s.hidden >= s.experts, ErrorCode::kInvalidArgument, "bench layer: ", s.name,
            ": the balanced routing's one-hot router weight needs hidden >= experts, got ", s.hidden, " < ",
            s.experts);
  const Stream stream = nullptr;
  const ExecContext exec{stream, {}};
  MoELayerOptions opt;
  opt.router.score = s.sigmoid ? RouterScore::kSigmoid : RouterScore::kSoftmax;
  opt.router.topk = s.topk;
  opt.router.norm_topk_prob = s.topk > 1;
  opt.router.scaling_factor = s.sigmoid ? 2.5f : 1.f;
  opt.router.aux_loss_coeff = 1e-3f;
  opt.router.z_loss_coeff = 1e-3f;
  opt.expert_bias = s.sigmoid;
  opt.experts.dtype = dtype;
  opt.experts.device = device;
  opt.experts.glu.activation = parse_activation(s.activation);
  opt.experts.bias = s.bias;
  opt.experts.seed = o.seed;
  // Megatron's training mode: every weight gradient accumulates into a float32 main_grad (no
  // gradient tensor is allocated per step).
  opt.experts.accumulate_into_main_grad = true;
  MoELayer layer(s.experts, s.hidden, s.ffn, opt);
  const int64_t E = s.experts, H = s.hidden, F = s.ffn, W = fc1_width(opt.experts.glu, F), T = s.tokens,
                k = s.topk;
  const Tensor router_mg = Tensor::zeros({1, E, H}, DType::kFloat32, device);
  const Tensor fc1_mg = Tensor::zeros({E, W, H}, DType::kFloat32, device);
  const Tensor fc2_mg = Tensor::zeros({E, H, F}, DType::kFloat32, device);
  layer.router_weight().set_main_grad(GroupedParam::packed(router_mg));
  layer.experts().fc1_weight().set_main_grad(GroupedParam::packed(fc1_mg));
  layer.experts().fc2_weight().set_main_grad(GroupedParam::packed(fc2_mg));
  copy_tensor(layer.state_dict().at("router.weight"), one_hot_router_weight(s, dtype));
  const Tensor x = balanced_input(s, dtype, o.seed * 16).to(device);
  const Tensor dy = Tensor::empty({T, H}, dtype, device);
  fill_uniform(dy, o.seed * 16 + 1, -1.f, 1.f);
  const Tensor d_loss = Tensor::empty({}, DType::kFloat32, device);
  fill_uniform(d_loss, 0, 1.f, 1.f);
  synchronize(stream);

  ShapeResult r;
  r.shape = s;
  // The whole layer.
  std::optional<MoELayerForwardResult> fwd;
  time_runs(device, stream, o.warmup, iters, r.layer, [&] { fwd.emplace(layer.forward(x, true, exec)); },
            [&] { layer.backward(fwd->ctx, dy, d_loss, exec); });
  MoELayerForwardResult check = layer.forward(x, true, exec);
  r.saved_bytes = check.ctx.saved_bytes();
  const std::vector<int64_t> splits = host_int64s(check.splits);
  r.min_split = *std::min_element(splits.begin(), splits.end());
  r.max_split = *std::max_element(splits.begin(), splits.end());
  layer.check_errors(stream);

  // The stages on their own, with the layer's shapes, parameters and buffers of their own.
  const RouterSpec& spec = opt.router;
  auto empty = [&](Shape shape, DType dt) { return Tensor::empty(shape, dt, device); };
  const TensorView weight = layer.state_dict().at("router.weight");
  const Tensor bias = s.sigmoid ? layer.expert_bias() : Tensor();
  const Tensor logits = empty({T, E}, DType::kFloat32), indices = empty({T, k}, DType::kInt32),
               probs = empty({T, k}, DType::kFloat32), counts = empty({E}, DType::kInt64),
               aux = empty({}, DType::kFloat32), aux_counts = empty({E}, DType::kInt64),
               z = empty({}, DType::kFloat32), total = empty({}, DType::kFloat32);
  const Tensor d_probs = empty({T, k}, DType::kFloat32), dx = empty({T, H}, dtype);
  fill_uniform(d_probs, 3, -1.f, 1.f);
  const Tensor fws = empty({int64_t(std::max<size_t>(1, router_forward_workspace_size(T, E)))}, DType::kUInt8);
  const Tensor bws = empty({int64_t(std::max<size_t>(1, router_backward_workspace_size(T, E, H, dtype)))}, DType::kUInt8);
  const Tensor pws = empty({int64_t(std::max<size_t>(1, permute_plan_workspace_size(T, k, E)))}, DType::kUInt8);
  const ExecContext fexec{stream, {fws.data(), fws.nbytes(), device}}, bexec{stream, {bws.data(), bws.nbytes(), device}},
      pexec{stream, {pws.data(), pws.nbytes(), device}};
  const RouterOutputs outs{logits, indices, probs, counts, aux, aux_counts, z, {}, total};
  RouterGrads rgrads{dx, router_mg.view().select(0), GradMode::kAccumulate, true};
  time_runs(device, stream, o.warmup, iters, r.router,
            [&] { router_forward(x, weight, bias, outs, spec, fexec); },
            [&] {
              router_backward({d_probs, d_loss, d_loss}, x, weight, logits, indices, aux_counts, rgrads, spec, bexec);
            });

  const int64_t R = permuted_rows(T, k, E, opt.capacity_factor);
  DeviceErrorFlag errors(device);
  const Tensor row_of = empty({T, k}, DType::kInt32), psplits = empty({E}, DType::kInt64),
               offsets = empty({E + 1}, DType::kInt64);
  const Tensor x_sorted = empty({R, H}, dtype), probs_sorted = empty({R}, DType::kFloat32),
               dx_sorted = empty({R, H}, dtype), dprobs_sorted = empty({R}, DType::kFloat32);
  fill_uniform(dx_sorted, 4, -1.f, 1.f);
  fill_uniform(dprobs_sorted, 5, -1.f, 1.f);
  GroupLayout groups;
  time_runs(device, stream, o.warmup, iters, r.permute,
            [&] {
              groups = permute_plan(indices, {row_of, psplits, offsets, {}}, opt.capacity_factor, &errors, pexec);
              permute(x, probs, row_of, groups, x_sorted, probs_sorted, exec);
            },
            [&] { permute_backward(dx_sorted, dprobs_sorted, row_of, groups, dx, d_probs, exec); });

  const Tensor dy_sorted = empty({R, H}, dtype);
  fill_uniform(dy_sorted, 6, -1.f, 1.f);
  std::optional<MlpForwardResult> mlp;
  time_runs(device, stream, o.warmup, iters, r.experts,
            [&] { mlp.emplace(layer.experts().forward(x_sorted, groups, probs_sorted, true, exec)); },
            [&] { layer.experts().backward(mlp->ctx, dy_sorted, exec); });

  const Tensor y = empty({T, H}, dtype);
  time_runs(device, stream, o.warmup, iters, r.unpermute,
            [&] { unpermute(mlp->y, {}, row_of, groups, y, exec); },
            [&] { unpermute_backward(dy, {}, {}, row_of, groups, dy_sorted, {}, exec); });
  synchronize(stream);
  errors.check(stream);
  return r;
}

}  // namespace

int run_bench_layer(const BenchOptions& o) {
  const DType dtype =
      parse_bench_dtype(o.dtype, "bench layer", false,
                        " (the layer has no FP8 benchmark; bench mlp --dtype fp8 times the FP8 expert MLP)")
          .dtype;
  std::string device_note;
  const Device device = bench_device(o.device, "bench layer", device_note);
  // The CPU backend runs the tiny layer unless a case is named (the suite's take it minutes each).
  std::string which = o.case_name;
  if (which.empty()) which = device.is_cpu() ? "tiny" : "all";
  std::vector<LayerShape> shapes;
  if (which == "tiny") {
    shapes.push_back(tiny_layer());
    if (!o.workloads.empty()) suite_layers(o.workloads);  // checked, not used: a bad file is an error
  } else {
    for (const LayerShape& s : suite_layers(o.workloads))
      if (which == "all" || s.name.find(which) != std::string::npos) shapes.push_back(s);
    MOE_CHECK(!shapes.empty(), ErrorCode::kInvalidArgument, "bench layer: --case ", which,
              ": no model of the suite matches (bench --list shows the cases; 'tiny' and 'all' work too)");
  }
  const int iters = o.iters > 0 ? o.iters : (device.is_cpu() ? 3 : 20);
  // The CPU backend's cost, known before anything runs (as bench mlp's; the tiny layer takes a
  // moment and is not estimated): each shape runs the layer, then its stages on their own (together
  // about the layer again), warm-up and timed runs each, and one more forward. The rate is the
  // expert MLP's on the tiny case (bench mlp's); shapes of 1k-2k hidden ran at 0.6-1x of it on the
  // CPU backend (the router, permute and main_grad accumulation), so the time is rounded up 2.5x:
  // it errs long.
  constexpr double kLayerMargin = 2.5;
  double estimate_s = 0, flops = 0, bytes = 0, gflops = 0;
  const int runs = 2 * (o.warmup + iters) + 1;
  const bool estimated = device.is_cpu() && which != "tiny";
  if (estimated) {
    gflops = measure_cpu_gflops(dtype);
    for (const LayerShape& s : shapes) {
      flops += runs * s.flops();
      bytes = std::max(bytes, layer_bytes(s, dtype));
    }
    estimate_s = kLayerMargin * flops / (gflops * 1e9);
    MOE_CHECK(o.force || estimate_s <= kAskBeforeSeconds, ErrorCode::kInvalidArgument, "bench layer: ",
              shapes.size() == 1 ? shapes.front().name : std::to_string(shapes.size()) + " models",
              " on the CPU backend would take about ", format_duration(estimate_s), " (", runs,
              " runs of the layer and its stages", shapes.size() == 1 ? "" : " per model", ", ", flop_count(flops),
              " in all, at the ", std::lround(gflops), " GFLOP/s measured here) and hold about ", memory_size(bytes),
              " of memory. ",
              force_hint({"a GPU (--device cuda)", "the tiny layer (--case tiny)",
                          shapes.size() > 1 ? "one model (--case MODEL)" : "", fewer_runs_hint(o.warmup, iters)}));
  }
  if (!o.json) {
    std::printf("moe-engine bench layer: %zu shape(s), %s, %s (%s)%s%s\n", shapes.size(), dtype_name(dtype),
                to_string(device).c_str(), device.is_cpu() ? "host clock" : "CUDA events",
                device_note.empty() ? "" : "; ", device_note.c_str());
    if (estimated)
      std::printf("estimate: about %s for %d runs per shape at %.0f GFLOP/s; %s of memory\n",
                  format_duration(estimate_s).c_str(), runs, gflops, memory_size(bytes).c_str());
    std::printf("routing: balanced by construction (token t -> experts (t k + j) mod E)\n");
    std::printf("%-28s %5s %5s %5s %3s %6s | %9s %9s %9s | %8s %8s %8s %8s | %7s\n", "model", "E", "H", "F", "k", "T",
                "fwd ms", "bwd ms", "total ms", "router", "permute", "experts", "unperm.", "TFLOP/s");
    std::fflush(stdout);
  }
  nlohmann::json entries = nlohmann::json::array();
  for (const LayerShape& s : shapes) {
    const ShapeResult r = run_shape(s, dtype, device, o, iters);
    const double total = stats_of(r.layer.total).median;
    const double tflops = s.flops() / (total * 1e-3) / 1e12;
    if (o.json) {
      entries.push_back({{"model", s.name},
                         {"experts", s.experts},
                         {"hidden", s.hidden},
                         {"ffn", s.ffn},
                         {"topk", s.topk},
                         {"tokens", s.tokens},
                         {"assignments", s.assignments()},
                         {"activation", s.activation},
                         {"bias", s.bias},
                         {"router", s.sigmoid ? "sigmoid, expert bias, scaling 2.5" : "softmax"},
                         {"assignments_per_expert", {{"min", r.min_split}, {"max", r.max_split}}},
                         {"flops", s.flops()},
                         {"tflops", tflops},
                         {"saved_bytes_per_token", r.saved_bytes / std::max<int64_t>(1, s.tokens)},
                         {"time_ms",
                          {{"layer", r.layer.json()},
                           {"stages",
                            {{"router", r.router.json()},
                             {"permute", r.permute.json()},
                             {"experts", r.experts.json()},
                             {"unpermute", r.unpermute.json()}}}}}});
    } else {
      std::printf("%-28s %5lld %5lld %5lld %3lld %6lld | %9.3f %9.3f %9.3f | %8.3f %8.3f %8.3f %8.3f | %7.2f\n",
                  s.name.c_str(), (long long)s.experts, (long long)s.hidden, (long long)s.ffn, (long long)s.topk,
                  (long long)s.tokens, stats_of(r.layer.forward).median, stats_of(r.layer.backward).median, total,
                  stats_of(r.router.total).median, stats_of(r.permute.total).median,
                  stats_of(r.experts.total).median, stats_of(r.unpermute.total).median, tflops);
      std::printf("%-28s assignments per expert %lld..%lld, saved for backward %lld bytes per token\n", "",
                  (long long)r.min_split, (long long)r.max_split,
                  (long long)(r.saved_bytes / std::max<int64_t>(1, s.tokens)));
      std::fflush(stdout);
    }
  }
  if (o.json) {
    nlohmann::json j;
    j["command"] = o.command_line;
    j["version"] = build_info().version;
    j["kind"] = "layer";
    j["device"] = to_string(device);
    if (!device_note.empty()) j["device_note"] = device_note;
    j["dtype"] = dtype_name(dtype);
    j["warmup"] = o.warmup;
    j["iters"] = iters;
    j["timing"] = device.is_cuda() ? "CUDA events, runs back to back without host waits, medians" : "host clock, medians";
    j["routing"] = "balanced: token t -> experts (t k + j) mod E (one-hot router weight)";
    j["stages"] = "each stage's forward + backward timed on its own: router (router_forward, router_backward), "
                  "permute (permute_plan + permute, permute_backward), experts (GroupedMLP forward, backward), "
                  "unpermute (unpermute, unpermute_backward)";
    j["shapes"] = entries;
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("(median of %d runs after %d warm-up; stages: forward + backward of each on its own)\n", iters,
                o.warmup);
  }
  return 0;
}

}  // namespace moe::tools
