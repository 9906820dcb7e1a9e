// moe-engine check: self-checks of every backend present, each against the float64 oracle (or,
// for the device offsets kernel, against the CPU).
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <vector>

#include "commands.hpp"
#include "mlp_problem.hpp"
#include "random_fill.hpp"

namespace moe::tools {
namespace {

struct Outcome {
  enum Status { kPass, kFail, kSkip } status = kPass;
  double error = 0;    // max relative error (when the check measures one)
  std::string detail;  // what failed, or why it was skipped
};

struct CheckItem {
  std::string name;
  std::string device;
  Outcome outcome;
};

Outcome judge(double error, double tolerance, std::string detail = {}) {
  return {error <= tolerance ? Outcome::kPass : Outcome::kFail, error, std::move(detail)};
}

// A CPU routing with empty and 1-row experts and rows past the end.
struct CpuRouting {
  std::vector<int64_t> splits;
  int64_t capacity;
  Tensor splits_t, offsets_t;
  GroupLayout layout;
  CpuRouting(RandomFill& rng, int64_t G) {
    for (int64_t g = 0; g < G; ++g)
      splits.push_back(g % 3 == 0 ? 0 : g % 3 == 1 ? 1 : rng.integer(2, 70));
    capacity = std::accumulate(splits.begin(), splits.end(), int64_t(0)) + 9;
    splits_t = Tensor::empty({G}, DType::kInt64);
    std::memcpy(splits_t.data(), splits.data(), splits.size() * sizeof(int64_t));
    offsets_t = Tensor::empty({G + 1}, DType::kInt64);
    layout = GroupLayout::compute(splits_t, capacity, offsets_t);
  }
  int64_t rows() const { return capacity - 9; }
};

Outcome check_conversions() {
  int bad = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const float bf = float(BFloat16::from_bits(uint16_t(b))),
                hf = float(Float16::from_bits(uint16_t(b)));
    if (bf == bf && BFloat16(bf).bits != b) ++bad;
    if (hf == hf && Float16(hf).bits != b) ++bad;
  }
  return {bad ? Outcome::kFail : Outcome::kPass, 0,
          bad ? std::to_string(bad) + " of 131072 patterns do not round-trip" : ""};
}

Outcome check_grouped_linear(uint64_t seed) {
  RandomFill rng(seed);
  CpuRouting r(rng, 11);
  const int64_t G = 11, N = 40, K = 56, T = r.capacity, rows = r.rows();
  const DType dt = DType::kBFloat16;
  Tensor x = rng.normal({T, K}, dt), w = rng.normal({G, N, K}, dt, 0.15),
         b = rng.normal({G, N}, dt);
  Tensor p = rng.uniform({T}, DType::kFloat32, 0, 1), dy = rng.normal({T, N}, dt);
  Tensor y = Tensor::empty({T, N}, DType::kFloat32), dx = Tensor::empty({T, K}, DType::kFloat32);
  Tensor dw = Tensor::empty({G, N, K}, DType::kFloat32),
         db = Tensor::empty({G, N}, DType::kFloat32);
  Tensor dp = Tensor::empty({T}, DType::kFloat32);
  const GroupedParam W = GroupedParam::packed(w), B = GroupedParam::packed(b);
  grouped_linear_forward(x, W, r.layout, y, {B, p});
  grouped_linear_dgrad(dy, W, r.layout, dx);
  grouped_linear_wgrad(dy, x, r.layout, GroupedParam::packed(dw), GradMode::kWrite);
  grouped_linear_dbias(dy, r.layout, GroupedParam::packed(db), GradMode::kWrite, p);
  grouped_linear_dscales(dy, B, r.layout, dp);
  const auto xm = oracle::head(oracle::to_matrix(x), rows),
             dym = oracle::head(oracle::to_matrix(dy), rows);
  const oracle::Vector pv = oracle::head(oracle::to_vector(p), rows);
  const auto wm = oracle::to_matrices(W);
  const double e = std::max(
      {oracle::rel_error(oracle::to_matrix(y),
                         oracle::linear_forward(xm, wm, r.splits, oracle::to_matrix(b), pv)),
       oracle::rel_error(oracle::to_matrix(dx), oracle::linear_dgrad(dym, wm, r.splits)),
       oracle::rel_error(oracle::to_matrices(GroupedParam::packed(dw)),
                         oracle::linear_wgrad(dym, xm, r.splits)),
       oracle::rel_error(oracle::to_matrix(db), oracle::linear_dbias(dym, r.splits, pv)),
       oracle::rel_error(oracle::to_vector(dp),
                         oracle::linear_dscales(dym, oracle::to_matrix(b), r.splits))});
  return judge(e, 1e-5, "float32 outputs of bfloat16 inputs");
}

Outcome check_glu(uint64_t seed) {
  RandomFill rng(seed);
  CpuRouting r(rng, 5);
  const int64_t F = 64, T = r.capacity, rows = r.rows();
  double worst = 0;
  std::vector<GluSpec> specs;  // each GLU in three layouts, each non-gated activation
  for (Activation act : {Activation::kSwiGLU, Activation::kClampedQGeGLU})
    for (const GluLayout& layout : {GluLayout::halves(), GluLayout::pairs(), GluLayout::blocks(32)})
      specs.push_back({act, 7.0f, 1.702f, 1.0f, layout});
  for (Activation act : {Activation::kSReLU, Activation::kGeluTanh}) specs.push_back({act});
  for (const GluSpec& spec : specs) {
    const int64_t W = fc1_width(spec, F);
    Tensor h = rng.normal({T, W}, DType::kFloat32, 6.0), d = rng.normal({T, F}, DType::kFloat32);
    Tensor p = rng.uniform({T}, DType::kFloat32, 0, 1);
    Tensor out = Tensor::empty({T, F}, DType::kFloat32), dh = Tensor::empty({T, W}, DType::kFloat32);
    Tensor dp = Tensor::empty({T}, DType::kFloat32);
    glu_forward(h, p, r.layout, out, spec);
    glu_backward(h, p, d, r.layout, {dh, dp, {}}, spec);
    const auto hm = oracle::head(oracle::to_matrix(h), rows), dm = oracle::head(oracle::to_matrix(d), rows);
    const oracle::Vector pv = oracle::head(oracle::to_vector(p), rows);
    const auto g = oracle::glu_backward(hm, pv, dm, spec);
    worst = std::max({worst, oracle::rel_error(oracle::to_matrix(out), oracle::glu_forward(hm, pv, spec)),
                      oracle::rel_error(oracle::to_matrix(dh), g.dh), oracle::rel_error(oracle::to_vector(dp), g.dprobs)});
  }
  return judge(worst, 1e-5, "float32, swiglu and clamped_qgeglu x halves, pairs, blocks:32; srelu, gelu_tanh");
}

Outcome check_mlp(Device device, uint64_t seed) {
  try {
    MlpProblem p(tiny_workload(), GluLayout::halves(), DType::kBFloat16, device, seed);
    p.forward();
    p.backward();
    if (device.is_cuda()) synchronize(nullptr);
    const OracleCheck c = p.check_against_oracle();
    return judge(c.max_rel_error, c.tolerance, "tiny case, bfloat16");
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kNotImplemented) throw;
    return {Outcome::kSkip, 0, "no kernel for this device yet"};
  }
}

// The CUDA grouped GEMMs (forward with scaled bias, dgrad, wgrad) against the CPU backend.
Outcome check_gpu_grouped_linear(Device device, uint64_t seed) {
  RandomFill rng(seed);
  CpuRouting r(rng, 9);
  const int64_t G = 9, N = 136, K = 200, T = r.capacity, rows = r.rows();
  const DType dt = DType::kBFloat16;
  Tensor x = rng.normal({T, K}, dt), w = rng.normal({G, N, K}, dt, 0.1), b = rng.normal({G, N}, dt);
  Tensor p = rng.uniform({T}, DType::kFloat32, 0, 1), dy = rng.normal({T, N}, dt);
  Tensor offsets = Tensor::empty({G + 1}, DType::kInt64, device);
  DeviceErrorFlag flag(device);
  const GroupLayout groups = GroupLayout::compute(r.splits_t.to(device), T, offsets, &flag);
  auto run = [&](Device d, const GroupLayout& layout) {
    auto on = [&](const Tensor& t) { return t.to(d); };
    Tensor y = Tensor::zeros({T, N}, dt, d), dx = Tensor::zeros({T, K}, dt, d);
    Tensor dw = Tensor::zeros({G, N, K}, DType::kFloat32, d);
    const Tensor xd = on(x), wd = on(w), dyd = on(dy);
    grouped_linear_forward(xd, GroupedParam::packed(wd), layout, y,
                           {GroupedParam::packed(on(b)), on(p)});
    grouped_linear_dgrad(dyd, GroupedParam::packed(wd), layout, dx);
    grouped_linear_wgrad(dyd, xd, layout, GroupedParam::packed(dw), GradMode::kWrite);
    return std::vector<Tensor>{y.to(Device::cpu()), dx.to(Device::cpu()), dw.to(Device::cpu())};
  };
  const auto gpu = run(device, groups), cpu = run(Device::cpu(), r.layout);
  flag.check();
  double worst = 0;
  for (int i = 0; i < 2; ++i)
    worst =
        std::max(worst, oracle::rel_error(oracle::to_matrix(gpu[size_t(i)]),
                                          oracle::head(oracle::to_matrix(cpu[size_t(i)]), rows)));
  worst = std::max(worst, oracle::rel_error(oracle::to_matrices(GroupedParam::packed(gpu[2])),
                                            oracle::to_matrices(GroupedParam::packed(cpu[2]))));
  return judge(worst, oracle::op_tolerance(dt),
               "bfloat16 forward (scale_bias), dgrad, wgrad vs the CPU backend");
}

Outcome check_device_offsets(Device device, uint64_t seed) {
  RandomFill rng(seed);
  const int64_t G = 300;
  std::vector<int64_t> splits(G);
  for (auto& s : splits) s = rng.integer(0, 40);
  const int64_t cap = std::accumulate(splits.begin(), splits.end(), int64_t(0)) + 3;
  Tensor host = Tensor::empty({G}, DType::kInt64);
  std::memcpy(host.data(), splits.data(), splits.size() * sizeof(int64_t));
  Tensor offsets = Tensor::empty({G + 1}, DType::kInt64, device);
  DeviceErrorFlag flag(device);
  GroupLayout::compute(host.to(device), cap, offsets, &flag);
  const Tensor got = offsets.to(Device::cpu());
  int64_t sum = 0;
  for (int64_t g = 0; g <= G; ++g) {
    if (got.data_as<int64_t>()[g] != sum)
      return {Outcome::kFail, 0, "offset " + std::to_string(g) + " differs from the CPU"};
    if (g < G) sum += splits[size_t(g)];
  }
  flag.check();
  host.data_as<int64_t>()[17] = -4;  // a bad routing must be reported
  GroupLayout::compute(host.to(device), cap, offsets, &flag);
  const DeviceErrorRecord rec = flag.read_and_clear();
  if (rec.bits != kNegativeSplit || rec.group != 17)
    return {Outcome::kFail, 0, "negative split not reported"};
  return {Outcome::kPass, 0, "G = 300, offsets equal the CPU's; a negative split is reported"};
}

}  // namespace

int run_check(const CheckOptions& o) {
  std::vector<CheckItem> items;
  auto run = [&](const std::string& name, Device device, const std::function<Outcome()>& fn) {
    Outcome out;
    try {
      out = fn();
    } catch (const Error& e) {
      out = {Outcome::kFail, 0, e.what()};
    }
    items.push_back({name, to_string(device), out});
  };
  run("bf16/fp16 conversions round-trip", Device::cpu(), check_conversions);
  run("grouped linear fwd/dgrad/wgrad/dbias/dscales vs fp64 oracle", Device::cpu(),
      [&] { return check_grouped_linear(o.seed); });
  run("activations forward/backward vs fp64 oracle", Device::cpu(), [&] { return check_glu(o.seed); });
  run("expert MLP forward+backward vs fp64 oracle", Device::cpu(),
      [&] { return check_mlp(Device::cpu(), o.seed); });
  const GpuInventory inv = query_gpus();
  for (const GpuInfo& g : inv.gpus) {
    const Device d = Device::cuda(g.index);
    run("device offsets/validation kernel", d, [&] { return check_device_offsets(d, o.seed); });
    run("grouped linear fwd/dgrad/wgrad vs the CPU backend", d,
        [&] { return check_gpu_grouped_linear(d, o.seed); });
    run("expert MLP forward+backward vs fp64 oracle", d, [&] { return check_mlp(d, o.seed); });
  }

  bool ok = true;
  for (const CheckItem& it : items) ok = ok && it.outcome.status != Outcome::kFail;
  static const char* kStatus[] = {"PASS", "FAIL", "SKIP"};
  if (o.json) {
    nlohmann::json j;
    j["passed"] = ok;
    if (inv.gpus.empty()) j["gpus_note"] = inv.note;
    for (const CheckItem& it : items)
      j["checks"].push_back({{"name", it.name},
                             {"device", it.device},
                             {"status", kStatus[it.outcome.status]},
                             {"max_rel_error", it.outcome.error},
                             {"detail", it.outcome.detail}});
    std::cout << j.dump(2) << "\n";
  } else {
    for (const CheckItem& it : items) {
      std::printf("%s  %-7s %-62s", kStatus[it.outcome.status], it.device.c_str(), it.name.c_str());
      if (it.outcome.error > 0) std::printf(" max rel. error %.2e", it.outcome.error);
      if (!it.outcome.detail.empty()) std::printf("  (%s)", it.outcome.detail.c_str());
      std::printf("\n");
    }
    if (inv.gpus.empty()) std::printf("no GPU checks: %s\n", inv.note.c_str());
    std::printf("%s\n", ok ? "all checks passed" : "SOME CHECKS FAILED");
  }
  return ok ? 0 : kExitCheckFailed;
}

}  // namespace moe::tools
