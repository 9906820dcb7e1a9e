// ActivationOffload on the CPU backend (the bookkeeping, with synchronous copies): bit-identical
// to no offload over several steps, what goes and what stays (per-module opt-out, min_bytes, the
// last layer), host buffers reused across steps, and clear errors for every misuse; the schedule
// (moe::OffloadSchedule) against the table it shares with the Python tests.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "offload_stack.hpp"

namespace moe::test {
namespace {

constexpr int64_t kT = 50;

struct Inputs {
  std::vector<Routing> routings;
  std::vector<GroupLayout> layouts;
  Tensor x, probs, dy;
  Inputs(const StackShape& s, Rng& rng)
      : x(random_tensor({kT, s.hidden}, DType::kBFloat16, rng)),
        probs(uniform_tensor({kT}, DType::kFloat32, rng, 0.05, 1.0)),
        dy(random_tensor({kT, s.hidden}, DType::kBFloat16, rng)) {
    routings.reserve(size_t(s.layers));
    for (int i = 0; i < s.layers; ++i) {  // empty and 1-row experts, rows past the end
      routings.emplace_back(i % 2 ? std::vector<int64_t>{20, 0, 1, 25} : std::vector<int64_t>{3, 17, 0, 28}, kT);
      layouts.push_back(routings.back().layout);
    }
  }
};

void expect_same(const StepResult& a, const StepResult& b) {
  EXPECT_TRUE(bitwise_equal(a.y, b.y));
  EXPECT_TRUE(bitwise_equal(a.dx, b.dx));
  ASSERT_EQ(a.dprobs.size(), b.dprobs.size());
  for (size_t i = 0; i < a.dprobs.size(); ++i) EXPECT_TRUE(bitwise_equal(a.dprobs[i], b.dprobs[i])) << i;
}

void expect_same(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "main_grad " << i;
}

class OffloadCpu : public ::testing::TestWithParam<bool> {};  // delayed weight gradients or not

TEST_P(OffloadCpu, BitIdenticalToNoOffloadOverSteps) {
  StackShape shape;
  shape.delay_wgrad = GetParam();
  Rng rng;
  const Inputs in(shape, rng);
  OffloadStack plain(shape, Device::cpu()), offloaded(shape, Device::cpu());
  ActivationOffload offload(Device::cpu(), shape.layers, -1, {.min_bytes = 0});
  EXPECT_EQ(offload.offload_layers(), shape.layers - 1);
  size_t host_after_first = 0;
  for (int step = 0; step < 3; ++step) {
    const StepResult a = plain.step(in.x, in.layouts, in.probs, in.dy, nullptr, nullptr);
    const StepResult b = offloaded.step(in.x, in.layouts, in.probs, in.dy, &offload, nullptr);
    expect_same(a, b);
    // Everything of layers 0..L-2 was away after the forward; the last layer kept its tensors.
    for (int i = 0; i < shape.layers; ++i) EXPECT_EQ(b.mlp_offloaded[size_t(i)], i < shape.layers - 1) << i;
    EXPECT_LT(b.saved_bytes, a.saved_bytes);
    EXPECT_GT(offload.offloaded_bytes(), 0);
    // The last offloaded layer is still held when backward begins: kept, not copied back (the
    // layers are alike, so it is one (L - 1)-th of the bytes).
    EXPECT_EQ(offload.reloaded_bytes() * (shape.layers - 1), offload.offloaded_bytes() * (shape.layers - 2));
    if (step == 0) host_after_first = offload.pinned_bytes();
    EXPECT_EQ(offload.pinned_bytes(), host_after_first) << "host buffers are reused, not grown";
  }
  expect_same(plain.main_grads_on_host(nullptr), offloaded.main_grads_on_host(nullptr));
}

INSTANTIATE_TEST_SUITE_P(Wgrad, OffloadCpu, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Delayed" : "Immediate"; });

TEST(OffloadCpuChoice, OptOutAndMinBytesAreHonoured) {
  StackShape shape;
  shape.opt_out_layer = 1;  // inside the offloaded layers
  Rng rng;
  const Inputs in(shape, rng);
  OffloadStack plain(shape, Device::cpu()), offloaded(shape, Device::cpu());
  ActivationOffload offload(Device::cpu(), shape.layers, 2, {.min_bytes = 0});
  const StepResult a = plain.step(in.x, in.layouts, in.probs, in.dy, nullptr, nullptr);
  const StepResult b = offloaded.step(in.x, in.layouts, in.probs, in.dy, &offload, nullptr);
  expect_same(a, b);
  EXPECT_EQ(b.mlp_offloaded, (std::vector<bool>{true, false, false, false}));

  // A threshold above every saved tensor: nothing goes, and the results are the same.
  OffloadStack none(shape, Device::cpu());
  ActivationOffload big(Device::cpu(), shape.layers, -1, {.min_bytes = int64_t(1) << 40});
  const StepResult c = none.step(in.x, in.layouts, in.probs, in.dy, &big, nullptr);
  expect_same(a, c);
  EXPECT_EQ(big.offloaded_bytes(), 0);
  EXPECT_EQ(c.mlp_offloaded, (std::vector<bool>(size_t(shape.layers), false)));
}

// One GroupedMLP, a layer at a time, for the misuse cases.
struct One {
  StackShape shape;
  Rng rng;
  Inputs in{shape, rng};
  GroupedMLP mlp{shape.groups, shape.hidden, shape.ffn, GroupedMLPOptions{}};
  MlpContext forward() { return mlp.forward(in.x, in.layouts[0], in.probs).ctx; }
};

template <class F>
void expect_invalid(F&& f, const std::string& words) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one saying '" << words << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(OffloadCpuErrors, MisuseIsAClearError) {
  One o;
  ActivationOffload offload(Device::cpu(), 2, -1, {.min_bytes = 0});
  MlpContext early = o.forward();
  expect_invalid([&] { offload.offload(early, nullptr); }, "call begin_layer first");
  expect_invalid([&] { offload.begin_layer(1, nullptr); }, "in order");
  expect_invalid([&] { offload.begin_layer(2, nullptr); }, "not in [0, 2)");
  expect_invalid([] { ActivationOffload(Device::cpu(), 0); }, "num_layers >= 1");
  expect_invalid([] { ActivationOffload(Device::cpu(), 2, 3); }, "offload_layers");

  offload.begin_layer(0, nullptr);
  MlpContext ctx = o.forward();
  offload.offload(ctx, nullptr);
  EXPECT_TRUE(ctx.offloaded());
  EXPECT_FALSE(ctx.saves_input());
  expect_invalid([&] { offload.offload(ctx, nullptr); }, "offloaded already");
  expect_invalid([&] { o.mlp.backward(ctx, o.in.dy); }, "restore it first");
  ActivationOffload other(Device::cpu(), 2);
  expect_invalid([&] { other.restore(ctx, nullptr); }, "did not go through this ActivationOffload");
  MlpContext never = o.forward();
  expect_invalid([&] { offload.restore(never, nullptr); }, "did not go through");

  offload.restore(ctx, nullptr);
  EXPECT_FALSE(ctx.offloaded());
  EXPECT_TRUE(ctx.saves_input());
  expect_invalid([&] { offload.restore(ctx, nullptr); }, "restored already");
  expect_invalid([&] { offload.begin_layer(1, nullptr); }, "in order");  // backward has begun
  o.mlp.backward(ctx, o.in.dy);

  // A context of the last step cannot be restored into the next one.
  offload.begin_layer(0, nullptr);
  MlpContext old_ctx = o.forward();
  offload.offload(old_ctx, nullptr);
  offload.begin_layer(0, nullptr);
  expect_invalid([&] { offload.restore(old_ctx, nullptr); }, "earlier step");
}

// tests/data/offload_schedule.json: the decisions both ActivationOffload classes follow.
nlohmann::json offload_schedule_table() {
  const std::string path = std::string(MOE_ENGINE_TEST_DATA_DIR) + "/offload_schedule.json";
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  return nlohmann::json::parse(in);
}

std::optional<int> offload_layers_of(const nlohmann::json& j) {
  return j.is_null() ? std::nullopt : std::optional<int>(j.get<int>());
}

TEST(OffloadSchedule, EveryCaseOfTheTable) {
  const nlohmann::json table = offload_schedule_table();
  ASSERT_FALSE(table.at("stacks").empty());
  for (const nlohmann::json& c : table.at("stacks")) {
    const int n = c.at("num_layers").get<int>();
    const OffloadSchedule s(n, offload_layers_of(c.at("offload_layers")), c.at("min_bytes").get<int64_t>());
    SCOPED_TRACE("num_layers " + std::to_string(n));
    EXPECT_EQ(s.num_layers(), n);
    EXPECT_EQ(s.offload_layers(), c.at("resolved_offload_layers").get<int>());
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(OffloadSchedule::released_at_forward(i), c.at("released_at_forward").at(size_t(i)).get<int>()) << i;
      EXPECT_EQ(OffloadSchedule::release_after_kept_reload(i), c.at("release_after_kept_reload").at(size_t(i)).get<bool>())
          << i;
    }
    for (const nlohmann::json& o : c.at("offloads"))
      EXPECT_EQ(s.offloads(o.at(0).get<int>(), o.at(1).get<int64_t>(), o.at(2).get<bool>()), o.at(3).get<bool>()) << o;
    for (const nlohmann::json& b : c.at("backward")) {
      const OffloadSchedule::BackwardStart got = s.at_backward(b.at("layer").get<int>(), b.at("first").get<bool>());
      EXPECT_EQ(got.release, b.at("release").get<std::vector<int>>()) << b;
      EXPECT_EQ(got.reload, b.at("reload").get<std::vector<int>>()) << b;
    }
  }
  for (const nlohmann::json& e : table.at("errors"))
    expect_invalid([&] { OffloadSchedule(e.at("num_layers").get<int>(), offload_layers_of(e.at("offload_layers")),
                                         e.at("min_bytes").get<int64_t>()); },
                   e.at("message").get<std::string>());
  expect_invalid([] { OffloadSchedule(2).at_backward(2, true); }, "layer 2 is not in [0, 2)");
}

}  // namespace
}  // namespace moe::test
