// GroupedLinear module on CUDA (label "gpu"): the same results as the CPU module, the gradient
// contract with main_grad (immediate and delayed, bit-identical on the GPU), hooks, state_dict
// across devices and layouts. Skips, saying why, without a GPU.
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
