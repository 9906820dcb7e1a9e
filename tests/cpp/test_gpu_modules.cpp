// GroupedLinear and GroupedMLP modules on CUDA (label "gpu"): the same results as the CPU modules,
// the gradient contract with main_grad (immediate and delayed, bit-identical on the GPU), hooks,
// state_dict across devices and layouts. Skips, saying why, without a GPU.
#include <gtest/gtest.h>

#include "gpu_support.hpp"
#include "moe_engine/modules.hpp"

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

MlpDeviceRun run_mlp(Device device, ExpertLayout layout, bool delay, bool recompute, const Tensor& x_host,
                     const Tensor& dy_host, const Tensor& probs_host) {
  GroupedMLPOptions o;
  o.layout = layout;
  o.device = device;
  o.seed = 5;
  o.bias = true;
  o.glu.activation = GluActivation::kClampedQGeGLU;
  o.glu.limit = 1.5f;
  o.glu.layout = GluLayout::pairs();
  o.recompute_fc1 = recompute;
  o.accumulate_into_main_grad = true;
  o.delay_wgrad_compute = delay;
  GroupedMLP m(kG, kH, kF, o);
  MlpDeviceRun r;
  r.main_grad1 = Tensor::zeros({kG, 2 * kF, kH}, DType::kFloat32, device);
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

TEST_P(GpuGroupedMlpModule, MatchesTheCpuModuleAndDelayedEqualsImmediate) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  Rng rng;
  const Tensor x = random_tensor({kT, kH}, DType::kBFloat16, rng);
  const Tensor dy = random_tensor({kT, kH}, DType::kBFloat16, rng);
  const Tensor probs = uniform_tensor({kT}, DType::kFloat32, rng, 0.05, 1.0);
  const MlpDeviceRun cpu = run_mlp(Device::cpu(), GetParam(), false, false, x, dy, probs);
  const MlpDeviceRun now = run_mlp(Device::cuda(0), GetParam(), false, false, x, dy, probs);
  const MlpDeviceRun later = run_mlp(Device::cuda(0), GetParam(), true, true, x, dy, probs);
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

}  // namespace
}  // namespace moe::test
