// GroupedLinear and GroupedMLP modules on CUDA (label "gpu"): the same results as the CPU modules,
// the gradient contract with main_grad (immediate and delayed, bit-identical on the GPU), hooks,
// state_dict across devices and layouts; the same with options.fp8 (FP8 GEMMs over the cached FP8
// weights), FP8 weight cache invalidation and activation offload of the FP8 tensors. Skips, saying
// why, without a GPU.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "gpu_support.hpp"
#include "moe_engine/modules.hpp"
#include "moe_engine/offload.hpp"

namespace moe::test {
namespace {

constexpr int64_t kG = 4, kIn = 64, kOut = 136, kT = 210;

struct DeviceRun {
  Tensor y, dx, main_grad;
  GradKind kind = GradKind::kNone;
  int hooks = 0;
  std::optional<bool> flag;
};

// Two steps (forward + backward, then backward_dw) of a module on `device`.
DeviceRun run(Device device, ExpertLayout layout, bool delay, const Tensor& x_host, const Tensor& dy_host) {
  GroupedLinearOptions o;
  o.layout = layout;
  o.device = device;
  o.seed = 9;
  o.accumulate_into_main_grad = true;
  o.delay_wgrad_compute = delay;
  GroupedLinear m(kG, kIn, kOut, o);
  DeviceRun r;
  r.main_grad = Tensor::zeros({kG, kOut, kIn}, DType::kFloat32, device);
  m.weight().set_main_grad(GroupedParam::packed(r.main_grad));
  m.weight().grad_added_to_main_grad = false;
  m.register_wgrad_hook([&] { ++r.hooks; });
  const Tensor splits = splits_tensor_for({70, 0, 1, 129}).to(device);
  const Tensor offsets = Tensor::empty({kG + 1}, DType::kInt64, device);
  DeviceErrorFlag flag(device);
  const GroupLayout groups = GroupLayout::compute(splits, kT, offsets, device.is_cuda() ? &flag : nullptr);
  const Tensor x = x_host.to(device), dy = dy_host.to(device);
  for (int step = 0; step < 2; ++step) {
    LinearForwardResult f = m.forward(x, groups);
    LinearBackwardResult b = m.backward(f.ctx, dy);
    r.y = f.y;
    r.dx = b.dx;
    r.kind = b.weight.kind;
  }
  m.backward_dw();
  r.flag = m.weight().grad_added_to_main_grad;
  if (device.is_cuda()) {
    flag.check(nullptr);
    r.y = to_host(r.y), r.dx = to_host(r.dx), r.main_grad = to_host(r.main_grad);
  }
  return r;
}

class GpuGroupedLinearModule : public ::testing::TestWithParam<ExpertLayout> {};

TEST_P(GpuGroupedLinearModule, MatchesTheCpuModuleAndDelayedEqualsImmediate) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  Rng rng;
  const Tensor x = random_tensor({kT, kIn}, DType::kBFloat16, rng);
  const Tensor dy = random_tensor({kT, kOut}, DType::kBFloat16, rng);
  const DeviceRun cpu = run(Device::cpu(), GetParam(), false, x, dy);
  const DeviceRun now = run(Device::cuda(0), GetParam(), false, x, dy);
  const DeviceRun later = run(Device::cuda(0), GetParam(), true, x, dy);
  const double tol = tolerance(DType::kBFloat16);
  auto rel = [](const TensorView& a, const TensorView& b) { return oracle::rel_error(oracle::to_matrix(a), oracle::to_matrix(b)); };
  EXPECT_LT(rel(now.y, cpu.y), tol);
  EXPECT_LT(rel(now.dx, cpu.dx), tol);
  EXPECT_LT(rel(now.main_grad.view().reshape({kG * kOut, kIn}), cpu.main_grad.view().reshape({kG * kOut, kIn})), tol);
  EXPECT_TRUE(bitwise_equal(later.main_grad, now.main_grad)) << "delayed != immediate on the GPU";
  EXPECT_TRUE(bitwise_equal(later.y, now.y));
  EXPECT_EQ(now.kind, GradKind::kDummy);
  EXPECT_EQ(later.kind, GradKind::kDummy);
  EXPECT_EQ(now.hooks, 0);
  EXPECT_EQ(later.hooks, 1);
  EXPECT_EQ(later.flag, std::optional<bool>(true));
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuGroupedLinearModule,
                         ::testing::Values(ExpertLayout::kPacked, ExpertLayout::kPerExpert),
                         [](const auto& info) {
                           return info.param == ExpertLayout::kPacked ? "packed" : "per_expert";
                         });

// GroupedMLP: two steps with main_grad accumulation for both weights, biases and probs.
struct MlpDeviceRun {
  Tensor y, dx, dprobs, main_grad1, main_grad2;
  GradKind kind1 = GradKind::kNone, kind2 = GradKind::kNone;
  int hooks = 0;
  std::optional<bool> flag1, flag2;
};

constexpr int64_t kH = 136, kF = 64;

GluSpec clamped_pairs() {
  GluSpec glu;
  glu.activation = Activation::kClampedQGeGLU;
  glu.limit = 1.5f;
  glu.layout = GluLayout::pairs();
  return glu;
}

MlpDeviceRun run_mlp(Device device, ExpertLayout layout, bool delay, bool recompute, const Tensor& x_host,
                     const Tensor& dy_host, const Tensor& probs_host, const GluSpec& glu = clamped_pairs()) {
  GroupedMLPOptions o;
  o.layout = layout;
  o.device = device;
  o.seed = 5;
  o.bias = true;
  o.glu = glu;
  o.recompute_fc1 = recompute;
  o.accumulate_into_main_grad = true;
  o.delay_wgrad_compute = delay;
  GroupedMLP m(kG, kH, kF, o);
  MlpDeviceRun r;
  r.main_grad1 = Tensor::zeros({kG, fc1_width(glu, kF), kH}, DType::kFloat32, device);
  r.main_grad2 = Tensor::zeros({kG, kH, kF}, DType::kFloat32, device);
  m.fc1_weight().set_main_grad(GroupedParam::packed(r.main_grad1));
  m.fc2_weight().set_main_grad(GroupedParam::packed(r.main_grad2));
  m.fc1_weight().grad_added_to_main_grad = m.fc2_weight().grad_added_to_main_grad = false;
  m.register_wgrad_hook([&] { ++r.hooks; });
  const Tensor splits = splits_tensor_for({70, 0, 1, 129}).to(device);
  const Tensor offsets = Tensor::empty({kG + 1}, DType::kInt64, device);
  DeviceErrorFlag flag(device);
  const GroupLayout groups = GroupLayout::compute(splits, kT, offsets, device.is_cuda() ? &flag : nullptr);
  const Tensor x = x_host.to(device), dy = dy_host.to(device), probs = probs_host.to(device);
  for (int step = 0; step < 2; ++step) {
    MlpForwardResult f = m.forward(x, groups, probs);
    MlpBackwardResult b = m.backward(f.ctx, dy);
    r.y = f.y;
    r.dx = b.dx;
    r.dprobs = b.dprobs;
    r.kind1 = b.fc1_weight.kind;
    r.kind2 = b.fc2_weight.kind;
  }
  m.backward_dw();
  r.flag1 = m.fc1_weight().grad_added_to_main_grad;
  r.flag2 = m.fc2_weight().grad_added_to_main_grad;
  if (device.is_cuda()) {
    flag.check(nullptr);
    for (Tensor* t : {&r.y, &r.dx, &r.dprobs, &r.main_grad1, &r.main_grad2}) *t = to_host(*t);
  }
  return r;
}

class GpuGroupedMlpModule : public ::testing::TestWithParam<ExpertLayout> {};

// For the GLU of the module tests and the non-gated activations (FC1 of F rows).
TEST_P(GpuGroupedMlpModule, MatchesTheCpuModuleAndDelayedEqualsImmediate) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  for (const GluSpec& glu : {clamped_pairs(), spec_of(Activation::kSReLU), spec_of(Activation::kGeluTanh)}) {
  SCOPED_TRACE(describe(glu));
  Rng rng;
  const Tensor x = random_tensor({kT, kH}, DType::kBFloat16, rng);
  const Tensor dy = random_tensor({kT, kH}, DType::kBFloat16, rng);
  const Tensor probs = uniform_tensor({kT}, DType::kFloat32, rng, 0.05, 1.0);
  const MlpDeviceRun cpu = run_mlp(Device::cpu(), GetParam(), false, false, x, dy, probs, glu);
  const MlpDeviceRun now = run_mlp(Device::cuda(0), GetParam(), false, false, x, dy, probs, glu);
  const MlpDeviceRun later = run_mlp(Device::cuda(0), GetParam(), true, true, x, dy, probs, glu);
  const double tol = oracle::mlp_tolerance(DType::kBFloat16);
  auto rel = [](const TensorView& a, const TensorView& b) { return oracle::rel_error(oracle::to_matrix(a), oracle::to_matrix(b)); };
  auto flat = [](const Tensor& t) { return t.view().reshape({t.numel() / t.size(t.dim() - 1), t.size(t.dim() - 1)}); };
  EXPECT_LT(rel(now.y, cpu.y), tol);
  EXPECT_LT(rel(now.dx, cpu.dx), tol);
  EXPECT_LT(oracle::rel_error(oracle::to_vector(now.dprobs), oracle::to_vector(cpu.dprobs)), tol);
  EXPECT_LT(rel(flat(now.main_grad1), flat(cpu.main_grad1)), tol);
  EXPECT_LT(rel(flat(now.main_grad2), flat(cpu.main_grad2)), tol);
  // Delayed (and recomputing the pre-activation) vs immediate (saving it): bit-identical.
  EXPECT_TRUE(bitwise_equal(later.main_grad1, now.main_grad1)) << "delayed != immediate on the GPU";
  EXPECT_TRUE(bitwise_equal(later.main_grad2, now.main_grad2)) << "delayed != immediate on the GPU";
  EXPECT_TRUE(bitwise_equal(later.y, now.y));
  EXPECT_TRUE(bitwise_equal(later.dx, now.dx));
  EXPECT_TRUE(bitwise_equal(later.dprobs, now.dprobs));
  EXPECT_EQ(now.kind1, GradKind::kDummy);
  EXPECT_EQ(later.kind2, GradKind::kDummy);
  EXPECT_EQ(now.hooks, 0);
  EXPECT_EQ(later.hooks, 1);
  EXPECT_EQ(later.flag1, std::optional<bool>(true));
  EXPECT_EQ(later.flag2, std::optional<bool>(true));
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuGroupedMlpModule,
                         ::testing::Values(ExpertLayout::kPacked, ExpertLayout::kPerExpert),
                         [](const auto& info) {
                           return info.param == ExpertLayout::kPacked ? "packed" : "per_expert";
                         });

// Per-expert parameters run the same Hopper kernels (per-expert TMA maps, the fused GLU
// epilogues included) as packed ones: both modules give the same bits.
TEST(GpuModuleLayouts, PackedAndPerExpertAreBitIdentical) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  Rng rng;
  const Tensor x = random_tensor({kT, kH}, DType::kBFloat16, rng), dy = random_tensor({kT, kH}, DType::kBFloat16, rng);
  const Tensor probs = uniform_tensor({kT}, DType::kFloat32, rng, 0.05, 1.0);
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute_fc1" : "saved pre-activation");
    const MlpDeviceRun packed = run_mlp(Device::cuda(0), ExpertLayout::kPacked, false, recompute, x, dy, probs);
    const MlpDeviceRun experts = run_mlp(Device::cuda(0), ExpertLayout::kPerExpert, false, recompute, x, dy, probs);
    EXPECT_TRUE(bitwise_equal(experts.y, packed.y));
    EXPECT_TRUE(bitwise_equal(experts.dx, packed.dx));
    EXPECT_TRUE(bitwise_equal(experts.dprobs, packed.dprobs));
    EXPECT_TRUE(bitwise_equal(experts.main_grad1, packed.main_grad1));
    EXPECT_TRUE(bitwise_equal(experts.main_grad2, packed.main_grad2));
  }
  const Tensor lx = random_tensor({kT, kIn}, DType::kBFloat16, rng), ldy = random_tensor({kT, kOut}, DType::kBFloat16, rng);
  const DeviceRun packed = run(Device::cuda(0), ExpertLayout::kPacked, false, lx, ldy);
  const DeviceRun experts = run(Device::cuda(0), ExpertLayout::kPerExpert, false, lx, ldy);
  EXPECT_TRUE(bitwise_equal(experts.y, packed.y));
  EXPECT_TRUE(bitwise_equal(experts.dx, packed.dx));
  EXPECT_TRUE(bitwise_equal(experts.main_grad, packed.main_grad));
}

TEST(GpuGroupedLinearModuleState, StateDictCrossesDevicesAndLayouts) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  GroupedLinearOptions o;
  o.bias = true;
  o.seed = 5;
  GroupedLinear cpu(kG, kIn, kOut, o);
  o.device = Device::cuda(0);
  o.layout = ExpertLayout::kPerExpert;
  o.seed = 6;
  GroupedLinear gpu(kG, kIn, kOut, o);
  gpu.load_state_dict(cpu.state_dict("fc."), "fc.");
  for (int64_t g = 0; g < kG; ++g) {
    EXPECT_TRUE(bitwise_equal(to_host(gpu.weight().value().expert(g)), cpu.weight().value().expert(g)));
    EXPECT_TRUE(bitwise_equal(to_host(gpu.bias().value().expert(g)), cpu.bias().value().expert(g)));
  }
  // And back: a CUDA module's state (per expert, device tensors) into a packed CPU module.
  GroupedLinearOptions back_options;
  back_options.bias = true;
  GroupedLinear back(kG, kIn, kOut, back_options);
  std::map<std::string, Tensor> host_state;
  for (const auto& [k, t] : gpu.state_dict()) host_state[k] = to_host(t);
  back.load_state_dict(host_state);
  EXPECT_TRUE(bitwise_equal(back.weight().value(), cpu.weight().value()));
}

// ---- FP8 (options.fp8) ----

// FP8 needs feature counts that are multiples of 16 (kOut = 136 is not).
constexpr int64_t kFp8Out = 144, kFp8H = 144, kFp8F = 64;

// GPU and CPU FP8 GEMMs sum each 128-block in different orders, so a few quantized values land one
// E4M3 step apart: their results agree far closer than either agrees with the unquantized math
// (DeepGEMM's similarity difference; the FP8 MLP op's GPU test measures within 5e-4).
constexpr double kFp8GpuVsCpuBound = 1e-3;

double similarity(const Tensor& a, const Tensor& b) {
  const int64_t cols = a.size(a.dim() - 1);
  return oracle::similarity_diff(oracle::to_matrix(a.view().reshape({a.numel() / cols, cols})),
                                 oracle::to_matrix(b.view().reshape({b.numel() / cols, cols})));
}

struct Fp8DeviceRun {
  Tensor y, dx, dprobs, main_grad1, main_grad2;  // GroupedLinear: main_grad1 only, dprobs = dscales
  GradKind kind = GradKind::kNone;
  int hooks = 0;
  std::optional<bool> flag;
  uint64_t quantizations = 0;
  bool x_rows = false;  // GroupedMLP: forward kept x's FP8 rows (expert_mlp_fp8_keeps_x_rows), not its columns
};

GroupLayout routing_on(Device device, Tensor& splits, Tensor& offsets, DeviceErrorFlag& flag) {
  splits = splits_tensor_for({70, 0, 1, 129}).to(device);
  offsets = Tensor::empty({kG + 1}, DType::kInt64, device);
  return GroupLayout::compute(splits, kT, offsets, device.is_cuda() ? &flag : nullptr);
}

// Two steps (forward + backward, then backward_dw) of an FP8 GroupedLinear with a probs-scaled
// bias, the weight gradient into main_grad (with Megatron's flag).
Fp8DeviceRun run_fp8_linear(Device device, ExpertLayout layout, bool delay, const Tensor& x_host, const Tensor& dy_host,
                            const Tensor& scales_host) {
  GroupedLinearOptions o;
  o.layout = layout;
  o.device = device;
  o.seed = 9;
  o.bias = o.scale_bias = true;
  o.accumulate_into_main_grad = true;
  o.delay_wgrad_compute = delay;
  o.fp8 = Fp8ModuleRecipe{};
  GroupedLinear m(kG, kIn, kFp8Out, o);
  Fp8DeviceRun r;
  r.main_grad1 = Tensor::zeros({kG, kFp8Out, kIn}, DType::kFloat32, device);
  m.weight().set_main_grad(GroupedParam::packed(r.main_grad1));
  m.weight().grad_added_to_main_grad = false;
  m.register_wgrad_hook([&] { ++r.hooks; });
  Tensor splits, offsets;
  DeviceErrorFlag flag(device);
  const GroupLayout groups = routing_on(device, splits, offsets, flag);
  const Tensor x = x_host.to(device), dy = dy_host.to(device), scales = scales_host.to(device);
  for (int step = 0; step < 2; ++step) {
    LinearForwardResult f = m.forward(x, groups, scales);
    LinearBackwardResult b = m.backward(f.ctx, dy);
    r.y = f.y, r.dx = b.dx, r.dprobs = b.dscales, r.kind = b.weight.kind;
  }
  m.backward_dw();
  r.flag = m.weight().grad_added_to_main_grad;
  r.quantizations = m.fp8_weight_quantizations();
  if (device.is_cuda()) {
    flag.check(nullptr);
    for (Tensor* t : {&r.y, &r.dx, &r.dprobs, &r.main_grad1}) *t = to_host(*t);
  }
  return r;
}

GroupedMLPOptions fp8_mlp_options(Device device, ExpertLayout layout) {
  GroupedMLPOptions o;
  o.layout = layout;
  o.device = device;
  o.seed = 5;
  o.bias = true;
  o.glu.activation = Activation::kClampedQGeGLU;  // default clamp, as the FP8 MLP op's GPU test
  o.glu.layout = GluLayout::pairs();
  o.fp8 = Fp8ModuleRecipe{};
  return o;
}

// `recipe`: all six GEMMs in FP8 (the FP8 MLP op), or some left out (the two layers' form).
Fp8DeviceRun run_fp8_mlp(Device device, ExpertLayout layout, bool delay, const Tensor& x_host, const Tensor& dy_host,
                         const Tensor& probs_host, const Fp8ModuleRecipe& recipe = {}) {
  GroupedMLPOptions o = fp8_mlp_options(device, layout);
  o.fp8 = recipe;
  o.accumulate_into_main_grad = true;
  o.delay_wgrad_compute = delay;
  GroupedMLP m(kG, kFp8H, kFp8F, o);
  Fp8DeviceRun r;
  r.main_grad1 = Tensor::zeros({kG, 2 * kFp8F, kFp8H}, DType::kFloat32, device);
  r.main_grad2 = Tensor::zeros({kG, kFp8H, kFp8F}, DType::kFloat32, device);
  m.fc1_weight().set_main_grad(GroupedParam::packed(r.main_grad1));
  m.fc2_weight().set_main_grad(GroupedParam::packed(r.main_grad2));
  m.fc1_weight().grad_added_to_main_grad = m.fc2_weight().grad_added_to_main_grad = false;
  m.register_wgrad_hook([&] { ++r.hooks; });
  Tensor splits, offsets;
  DeviceErrorFlag flag(device);
  const GroupLayout groups = routing_on(device, splits, offsets, flag);
  const Tensor x = x_host.to(device), dy = dy_host.to(device), probs = probs_host.to(device);
  for (int step = 0; step < 2; ++step) {
    MlpForwardResult f = m.forward(x, groups, probs);
    r.x_rows = f.ctx.fp8_saved().x_rows.data.defined() && !f.ctx.fp8_saved().x.data.defined();
    MlpBackwardResult b = m.backward(f.ctx, dy);
    r.y = f.y, r.dx = b.dx, r.dprobs = b.dprobs, r.kind = b.fc1_weight.kind;
  }
  m.backward_dw();
  r.flag = m.fc2_weight().grad_added_to_main_grad;
  r.quantizations = m.fp8_weight_quantizations();
  if (device.is_cuda()) {
    flag.check(nullptr);
    for (Tensor* t : {&r.y, &r.dx, &r.dprobs, &r.main_grad1, &r.main_grad2}) *t = to_host(*t);
  }
  return r;
}

void expect_close_to_cpu(const Fp8DeviceRun& gpu, const Fp8DeviceRun& cpu) {
  for (auto [g, c, name] : {std::tuple{&gpu.y, &cpu.y, "y"}, {&gpu.dx, &cpu.dx, "dx"},
                            {&gpu.main_grad1, &cpu.main_grad1, "main_grad1"},
                            {&gpu.main_grad2, &cpu.main_grad2, "main_grad2"}})
    if (c->defined()) EXPECT_LE(similarity(*g, *c), kFp8GpuVsCpuBound) << name << " vs the CPU module";
  EXPECT_LE(oracle::similarity_diff(oracle::to_vector(gpu.dprobs), oracle::to_vector(cpu.dprobs)), kFp8GpuVsCpuBound);
}

void expect_bit_identical(const Fp8DeviceRun& a, const Fp8DeviceRun& b) {
  for (auto [x, y, name] : {std::tuple{&a.y, &b.y, "y"}, {&a.dx, &b.dx, "dx"}, {&a.dprobs, &b.dprobs, "dprobs"},
                            {&a.main_grad1, &b.main_grad1, "main_grad1"}, {&a.main_grad2, &b.main_grad2, "main_grad2"}})
    if (x->defined()) EXPECT_TRUE(bitwise_equal(*x, *y)) << name;
}

class GpuFp8Modules : public ::testing::TestWithParam<ExpertLayout> {};

// Both modules: close to the CPU module (the quantizers are bit-identical, the GEMMs sum in another
// order), delayed = immediate bit for bit, the contract's dummy, hook and flag, and the weights
// quantized once over two steps (forward and backward of both share the copies).
TEST_P(GpuFp8Modules, MatchTheCpuModulesAndDelayedEqualsImmediate) {
  MOE_SKIP_WITHOUT_HOPPER();
  Rng rng;
  const Tensor scales = uniform_tensor({kT}, DType::kFloat32, rng, 0.05, 1.0);
  {
    SCOPED_TRACE("GroupedLinear");
    const Tensor x = random_tensor({kT, kIn}, DType::kBFloat16, rng);
    const Tensor dy = random_tensor({kT, kFp8Out}, DType::kBFloat16, rng);
    const Fp8DeviceRun cpu = run_fp8_linear(Device::cpu(), GetParam(), false, x, dy, scales);
    const Fp8DeviceRun now = run_fp8_linear(Device::cuda(0), GetParam(), false, x, dy, scales);
    const Fp8DeviceRun later = run_fp8_linear(Device::cuda(0), GetParam(), true, x, dy, scales);
    expect_close_to_cpu(now, cpu);
    expect_bit_identical(later, now);
    EXPECT_EQ(now.kind, GradKind::kDummy);
    EXPECT_EQ(later.hooks, 1);
    EXPECT_EQ(later.flag, std::optional<bool>(true));
    EXPECT_EQ(now.quantizations, 1u);
  }
  {
    SCOPED_TRACE("GroupedMLP");
    const Tensor x = random_tensor({kT, kFp8H}, DType::kBFloat16, rng);
    const Tensor dy = random_tensor({kT, kFp8H}, DType::kBFloat16, rng);
    const Fp8DeviceRun cpu = run_fp8_mlp(Device::cpu(), GetParam(), false, x, dy, scales);
    const Fp8DeviceRun now = run_fp8_mlp(Device::cuda(0), GetParam(), false, x, dy, scales);
    const Fp8DeviceRun later = run_fp8_mlp(Device::cuda(0), GetParam(), true, x, dy, scales);
    // 4 experts of 210 tokens: x's columns (768) would be more than twice its rows, so every run
    // keeps the rows and backward (delayed too) makes the columns from them.
    ASSERT_TRUE(expert_mlp_fp8_keeps_x_rows(kT, kG));
    EXPECT_TRUE(cpu.x_rows && now.x_rows && later.x_rows);
    expect_close_to_cpu(now, cpu);
    expect_bit_identical(later, now);
    EXPECT_EQ(now.kind, GradKind::kDummy);
    EXPECT_EQ(later.hooks, 1);
    EXPECT_EQ(later.flag, std::optional<bool>(true));
    EXPECT_EQ(now.quantizations, 2u);
  }
}

// GroupedMLP with a recipe leaving some GEMMs unquantized (FC1 and FC2 as GroupedLinear's layers
// around the activation op): close to the CPU module, delayed = immediate bit for bit.
TEST_P(GpuFp8Modules, MlpWithOverriddenGemmsMatchesTheCpuModule) {
  MOE_SKIP_WITHOUT_HOPPER();
  Rng rng;
  const Tensor probs = uniform_tensor({kT}, DType::kFloat32, rng, 0.05, 1.0);
  const Tensor x = random_tensor({kT, kFp8H}, DType::kBFloat16, rng);
  const Tensor dy = random_tensor({kT, kFp8H}, DType::kBFloat16, rng);
  for (const bool fp8_wgrad : {false, true}) {
    Fp8ModuleRecipe recipe;  // FP8 forward and dgrad with unquantized wgrads, or FP8 wgrads alone
    recipe.forward = recipe.dgrad = !fp8_wgrad;
    recipe.wgrad = fp8_wgrad;
    SCOPED_TRACE(fp8_wgrad ? "FP8 wgrads only" : "FP8 forward and dgrad");
    const Fp8DeviceRun cpu = run_fp8_mlp(Device::cpu(), GetParam(), false, x, dy, probs, recipe);
    const Fp8DeviceRun now = run_fp8_mlp(Device::cuda(0), GetParam(), false, x, dy, probs, recipe);
    const Fp8DeviceRun later = run_fp8_mlp(Device::cuda(0), GetParam(), true, x, dy, probs, recipe);
    expect_close_to_cpu(now, cpu);
    expect_bit_identical(later, now);
    EXPECT_EQ(now.kind, GradKind::kDummy);
    EXPECT_EQ(later.hooks, 1);
    EXPECT_EQ(now.quantizations, fp8_wgrad ? 0u : 2u);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuFp8Modules, ::testing::Values(ExpertLayout::kPacked, ExpertLayout::kPerExpert),
                         [](const auto& info) {
                           return info.param == ExpertLayout::kPacked ? "packed" : "per_expert";
                         });

// Per-expert parameters quantize into the same packed FP8 copies, so forward and dgrad are the
// packed GEMMs; the weight gradients of the plain row go to fresh per-expert tensors (the FP8
// wgrad with per-expert outputs). Both layouts give the same bits.
TEST(GpuFp8ModuleLayouts, PackedAndPerExpertAreBitIdentical) {
  MOE_SKIP_WITHOUT_HOPPER();
  Rng rng;
  const Tensor x = to_gpu(random_tensor({kT, kFp8H}, DType::kBFloat16, rng));
  const Tensor dy = to_gpu(random_tensor({kT, kFp8H}, DType::kBFloat16, rng));
  const Tensor probs = to_gpu(uniform_tensor({kT}, DType::kFloat32, rng, 0.05, 1.0));
  const Tensor linear_dy = to_gpu(random_tensor({kT, kFp8Out}, DType::kBFloat16, rng));
  Tensor splits, offsets;
  DeviceErrorFlag flag(Device::cuda(0));
  const GroupLayout groups = routing_on(Device::cuda(0), splits, offsets, flag);
  std::vector<Tensor> results[2];
  for (ExpertLayout layout : {ExpertLayout::kPacked, ExpertLayout::kPerExpert}) {
    std::vector<Tensor>& out = results[layout == ExpertLayout::kPerExpert];
    GroupedMLP mlp(kG, kFp8H, kFp8F, fp8_mlp_options(Device::cuda(0), layout));
    MlpForwardResult f = mlp.forward(x, groups, probs);
    MlpBackwardResult b = mlp.backward(f.ctx, dy);
    GroupedLinearOptions lo;
    lo.layout = layout;
    lo.device = Device::cuda(0);
    lo.bias = true;
    lo.seed = 3;
    lo.fp8 = Fp8ModuleRecipe{};
    GroupedLinear lin(kG, kFp8H, kFp8Out, lo);
    LinearForwardResult lf = lin.forward(x, groups);
    LinearBackwardResult lb = lin.backward(lf.ctx, linear_dy);
    out = {f.y, b.dx, b.dprobs, lf.y, lb.dx};
    for (const ParamGradResult* g : {&b.fc1_weight, &b.fc2_weight, &b.fc1_bias, &lb.weight})
      for (int64_t e = 0; e < kG; ++e) out.push_back(to_host(g->grad.view().expert(e)));
    for (Tensor& t : out) t = t.device().is_cuda() ? to_host(t) : t;
  }
  flag.check(nullptr);
  ASSERT_EQ(results[0].size(), results[1].size());
  for (size_t i = 0; i < results[0].size(); ++i) EXPECT_TRUE(bitwise_equal(results[0][i], results[1][i])) << i;
}

// The cached FP8 weights serve until invalidated, also on the GPU.
TEST(GpuFp8ModuleCache, InvalidateRequantizesTheWeight) {
  MOE_SKIP_WITHOUT_HOPPER();
  Rng rng;
  const Tensor x = to_gpu(random_tensor({kT, kIn}, DType::kBFloat16, rng));
  Tensor splits, offsets;
  DeviceErrorFlag flag(Device::cuda(0));
  const GroupLayout groups = routing_on(Device::cuda(0), splits, offsets, flag);
  GroupedLinearOptions o;
  o.device = Device::cuda(0);
  o.fp8 = Fp8ModuleRecipe{};
  GroupedLinear m(kG, kIn, kFp8Out, o);
  const Tensor before = to_host(m.forward(x, groups, {}, false).y);
  fill_uniform(m.weight().storage().packed(), 17, -0.3f, 0.3f);
  EXPECT_TRUE(bitwise_equal(to_host(m.forward(x, groups, {}, false).y), before)) << "the cached copy serves";
  m.invalidate_fp8_weights();
  const Tensor after = to_host(m.forward(x, groups, {}, false).y);
  EXPECT_FALSE(bitwise_equal(after, before));
  EXPECT_EQ(m.fp8_weight_quantizations(), 2u);
  // The CPU module with the same weights agrees with the refreshed GPU one.
  o.device = Device::cpu();
  GroupedLinear cpu(kG, kIn, kFp8Out, o);
  std::map<std::string, Tensor> state;
  for (const auto& [k, t] : m.state_dict()) state[k] = to_host(t);
  cpu.load_state_dict(state);
  Tensor cpu_splits, cpu_offsets;
  const GroupLayout cpu_groups = routing_on(Device::cpu(), cpu_splits, cpu_offsets, flag);
  EXPECT_LE(similarity(after, cpu.forward(to_host(x), cpu_groups, {}, false).y), kFp8GpuVsCpuBound);
  flag.check(nullptr);
}

struct OwnedStream {
  cudaStream_t s = nullptr;
  OwnedStream() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
  ~OwnedStream() { cudaStreamDestroy(s); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
};

// A captured FP8 forward quantizes the weights in every replay: a replay after the master weights
// changed gives what an eager forward gives after invalidate_fp8_weights().
TEST(GpuFp8ModuleGraph, ReplayQuantizesTheWeightsAsTheyAreThen) {
  MOE_SKIP_WITHOUT_HOPPER();
  OwnedStream stream;
  Rng rng;
  const Tensor x = to_gpu(random_tensor({kT, kIn}, DType::kBFloat16, rng));
  Tensor splits, offsets;
  DeviceErrorFlag flag(Device::cuda(0));
  const GroupLayout groups = routing_on(Device::cuda(0), splits, offsets, flag);
  synchronize(nullptr);
  GroupedLinearOptions o;
  o.device = Device::cuda(0);
  o.fp8 = Fp8ModuleRecipe{};
  GroupedLinear m(kG, kIn, kFp8Out, o);
  const ExecContext exec{stream.s, {}};
  const Tensor y = Tensor::empty({kT, kFp8Out}, DType::kBFloat16, Device::cuda(0));  // outlives the graph
  auto step = [&] {
    LinearForwardResult f = m.forward(x, groups, {}, false, exec);
    copy_tensor(y, f.y, stream.s);
  };
  step();  // eager first
  synchronize(stream.s);
  const Tensor before = to_host(y);
  CapturedGraph graph(stream.s, step);
  fill_uniform(m.weight().storage().packed(), 23, -0.3f, 0.3f, stream.s);  // an optimizer step
  graph.launch();
  const Tensor replayed = to_host(y);
  EXPECT_FALSE(bitwise_equal(replayed, before)) << "the replay read the cached copy";
  m.invalidate_fp8_weights();
  step();
  synchronize(stream.s);
  EXPECT_TRUE(bitwise_equal(replayed, to_host(y)));
  flag.check(nullptr);
}

// Three FP8 MLP layers on a non-blocking stream with ActivationOffload: the FP8 tensors (E4M3 data,
// float32 scales, int64 offsets) go to pinned memory and back; the results equal no offload bit for bit.
TEST(GpuFp8ModuleOffload, BitIdenticalToNoOffload) {
  MOE_SKIP_WITHOUT_HOPPER();
  constexpr int kLayers = 3;
  OwnedStream stream;
  Rng rng;
  const Tensor x = to_gpu(random_tensor({kT, kFp8H}, DType::kBFloat16, rng));
  const Tensor dy = to_gpu(random_tensor({kT, kFp8H}, DType::kBFloat16, rng));
  const Tensor probs = to_gpu(uniform_tensor({kT}, DType::kFloat32, rng, 0.05, 1.0));
  Tensor splits, offsets;
  DeviceErrorFlag flag(Device::cuda(0));
  const GroupLayout groups = routing_on(Device::cuda(0), splits, offsets, flag);
  auto run = [&](ActivationOffload* offload) {
    std::vector<std::unique_ptr<GroupedMLP>> mlps;
    std::vector<Tensor> out;
    for (int i = 0; i < kLayers; ++i) {
      GroupedMLPOptions o = fp8_mlp_options(Device::cuda(0), ExpertLayout::kPacked);
      o.seed = 50 + uint64_t(i);
      mlps.push_back(std::make_unique<GroupedMLP>(kG, kFp8H, kFp8F, o));
    }
    const ExecContext exec{stream.s, {}};
    std::vector<MlpContext> ctx(kLayers);
    Tensor h = x;
    for (int i = 0; i < kLayers; ++i) {
      if (offload) offload->begin_layer(i, stream.s);
      MlpForwardResult f = mlps[size_t(i)]->forward(h, groups, probs, true, exec);
      if (offload) offload->offload(f.ctx, stream.s);
      ctx[size_t(i)] = std::move(f.ctx);
      h = f.y;
    }
    out.push_back(h);
    Tensor d = dy;
    for (int i = kLayers - 1; i >= 0; --i) {
      if (offload) offload->restore(ctx[size_t(i)], stream.s);
      MlpBackwardResult b = mlps[size_t(i)]->backward(ctx[size_t(i)], d, exec);
      out.push_back(b.dprobs);
      out.push_back(b.fc1_weight.grad.packed());
      out.push_back(b.fc2_weight.grad.packed());
      d = b.dx;
    }
    out.push_back(d);
    synchronize(stream.s);
    for (Tensor& t : out) t = to_host(t);
    return out;
  };
  ActivationOffload offload(Device::cuda(0), kLayers, -1, {.min_bytes = 0});
  const std::vector<Tensor> plain = run(nullptr), offloaded = run(&offload);
  EXPECT_GT(offload.offloaded_bytes(), 0);
  ASSERT_EQ(plain.size(), offloaded.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(bitwise_equal(plain[i], offloaded[i])) << i;
  flag.check(nullptr);
}

}  // namespace
}  // namespace moe::test
