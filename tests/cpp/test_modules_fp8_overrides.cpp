// GroupedMLP with an FP8 recipe that leaves some GEMMs unquantized (CPU backend): the two layers run
// as GroupedLinear runs them around the activation op, so every output and gradient is the bits of
// those ops called directly (each GEMM in FP8 or not, as the recipe says); what forward keeps and its
// bytes; activation offload of what it keeps; float64 probs. The gradient contract's rows and
// delayed = immediate run over such recipes in test_modules_fp8.cpp.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fp8_module_support.hpp"
#include "moe_engine/modules.hpp"
#include "moe_engine/offload.hpp"

namespace moe::test {
namespace {

constexpr int64_t kG = 5, kH = 144, kF = 80, kT = 50;
const std::vector<int64_t> kSplits{7, 0, 1, 13, 9};  // empty and 1-row experts, rows past the end

GroupedMLPOptions options_with(Fp8ModuleRecipe fp8, DType dt = DType::kBFloat16,
                               ExpertLayout layout = ExpertLayout::kPacked) {
  GroupedMLPOptions o;
  o.dtype = dt;
  o.layout = layout;
  o.bias = true;
  o.glu.activation = Activation::kClampedQGeGLU;
  o.glu.limit = 1.5f;
  o.glu.layout = GluLayout::pairs();
  o.seed = 11;
  o.fp8 = fp8;
  return o;
}

// The recipes that name some GEMMs but not all three (forward, dgrad, wgrad: bits 0, 1, 2).
std::vector<int> partial_masks() { return {1, 2, 3, 4, 5, 6}; }
Fp8ModuleRecipe recipe_of(int mask) { return gemms(mask & 1, mask & 2, mask & 4); }
std::string mask_name(int mask) {
  return std::string("fwd") + (mask & 1 ? "8" : "16") + "_dgrad" + (mask & 2 ? "8" : "16") + "_wgrad" +
         (mask & 4 ? "8" : "16");
}

// What forward keeps: x and act (the FC2 input), or their FP8 columns where the wgrads run in FP8;
// the pre-activation [T, W] in the module's dtype; the probs.
int64_t saved_bytes(const Fp8ModuleRecipe& r, int64_t T, int64_t G, int64_t H, int64_t F, int64_t W, int64_t size) {
  const int64_t x = r.wgrad ? columns_bytes(T, G, H) : T * H * size;
  const int64_t act = r.wgrad ? columns_bytes(T, G, F) : T * F * size;
  return x + act + T * W * size + 4 * T;
}

class Fp8MlpOverrides : public ::testing::TestWithParam<int> {};

TEST_P(Fp8MlpOverrides, EqualsTheLayersOpsBothLayoutsAndDtypes) {
  const int mask = GetParam();
  const Fp8ModuleRecipe r = recipe_of(mask);
  Rng rng;
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    SCOPED_TRACE(dtype_name(dt));
    const Batch b(rng, kSplits, kT, kH, kH, dt);
    GroupedMLP packed(kG, kH, kF, options_with(r, dt));
    GroupedMLP per(kG, kH, kF, options_with(r, dt, ExpertLayout::kPerExpert));
    ASSERT_TRUE(bitwise_equal(packed.fc2_weight().value(), per.fc2_weight().value()));
    const MlpReference ref = mlp_layers_reference(packed, b, dt);
    for (GroupedMLP* m : {&packed, &per}) {
      SCOPED_TRACE(layout_name(m->options().layout));
      MlpForwardResult f = m->forward(b.x, b.groups(), b.scales);
      EXPECT_TRUE(bitwise_equal(f.y, ref.y));
      EXPECT_TRUE(f.ctx.saves_input() && f.ctx.saves_fc1_out() && f.ctx.saves_act());
      EXPECT_FALSE(f.ctx.fp8_saved().fc1_out.data.defined()) << "the pre-activation stays in the module's dtype";
      EXPECT_EQ(f.ctx.saved_bytes(), saved_bytes(r, kT, kG, kH, kF, 2 * kF, int64_t(dtype_size(dt))));
      MlpBackwardResult g = m->backward(f.ctx, b.dy);
      expect_backward_equals(g, ref);
      EXPECT_FALSE(f.ctx.saves_input() || f.ctx.saves_fc1_out() || f.ctx.saves_act()) << "backward releases";
      EXPECT_EQ(m->fp8_weight_quantizations(), r.forward || r.dgrad ? 2u : 0u)
          << "each weight once for forward and backward; a wgrad-only recipe never quantizes one";
    }
  }
}

// Forward keeps only what the wanted gradients read: no input without the FC1 weight's gradient,
// no act without FC2's, no pre-activation when nothing before the activation wants one; backward
// then refuses a gradient forward did not keep for.
TEST_P(Fp8MlpOverrides, KeepsOnlyWhatBackwardNeeds) {
  const int mask = GetParam();
  const Fp8ModuleRecipe r = recipe_of(mask);
  Rng rng;
  const Batch b(rng, kSplits, kT, kH, kH, DType::kBFloat16);
  GroupedMLP m(kG, kH, kF, options_with(r));
  const MlpReference ref = mlp_layers_reference(m, b, DType::kBFloat16);
  m.fc1_weight().requires_grad = false;
  m.fc1_bias().requires_grad = false;
  {  // FC2's weight only, no probs, no input gradient: act (or its columns) alone
    MlpForwardResult f = m.forward(b.x, b.groups(), {}, /*input_requires_grad=*/false);
    EXPECT_FALSE(f.ctx.saves_input());
    EXPECT_FALSE(f.ctx.saves_fc1_out());
    EXPECT_TRUE(f.ctx.saves_act());
    const int64_t act = r.wgrad ? columns_bytes(kT, kG, kF) : kT * kF * 2;
    EXPECT_EQ(f.ctx.saved_bytes(), act);
    MlpBackwardResult g = m.backward(f.ctx, b.dy);
    EXPECT_FALSE(g.dx.defined());
    EXPECT_EQ(g.fc1_weight.kind, GradKind::kNone);
    EXPECT_EQ(g.fc2_weight.kind, GradKind::kGrad);
  }
  {  // the FC1 weight wants a gradient after a forward that kept nothing for it
    MlpForwardResult f = m.forward(b.x, b.groups(), {}, false);
    m.fc1_weight().requires_grad = true;
    try {
      m.backward(f.ctx, b.dy);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("kept no pre-activation"), std::string::npos) << e.what();
    }
  }
  m.fc1_bias().requires_grad = true;
  m.fc2_weight().requires_grad = false;
  {  // FC1's gradients and the probs' without FC2's weight: no act
    MlpForwardResult f = m.forward(b.x, b.groups(), b.scales);
    EXPECT_FALSE(f.ctx.saves_act());
    MlpBackwardResult g = m.backward(f.ctx, b.dy);
    EXPECT_EQ(g.fc2_weight.kind, GradKind::kNone);
    EXPECT_TRUE(bitwise_equal(packed_of(g.fc1_weight.grad.view()), ref.dw1));
    EXPECT_TRUE(bitwise_equal(g.dprobs, ref.dprobs));
    EXPECT_TRUE(bitwise_equal(g.dx, ref.dx));
  }
}

// srelu and gelu_tanh: FC1 of F rows, the pre-activation [T, F]; the module gives the ops' bits.
TEST_P(Fp8MlpOverrides, NonGatedActivationsEqualTheLayersOps) {
  const Fp8ModuleRecipe r = recipe_of(GetParam());
  Rng rng;
  const Batch b(rng, kSplits, kT, kH, kH, DType::kBFloat16);
  for (Activation act : kElementwiseActivations) {
    SCOPED_TRACE(activation_name(act));
    GroupedMLPOptions o = options_with(r);
    o.glu = spec_of(act);
    GroupedMLP m(kG, kH, kF, o);
    EXPECT_EQ(m.fc1_weight().expert_shape(), (Shape{kF, kH}));
    const MlpReference ref = mlp_layers_reference(m, b, DType::kBFloat16);
    MlpForwardResult f = m.forward(b.x, b.groups(), b.scales);
    EXPECT_TRUE(bitwise_equal(f.y, ref.y));
    EXPECT_EQ(f.ctx.saved_bytes(), saved_bytes(r, kT, kG, kH, kF, kF, 2));
    MlpBackwardResult g = m.backward(f.ctx, b.dy);
    EXPECT_TRUE(bitwise_equal(g.dx, ref.dx));
    EXPECT_TRUE(bitwise_equal(g.dprobs, ref.dprobs));
    EXPECT_TRUE(bitwise_equal(packed_of(g.fc1_weight.grad.view()), ref.dw1));
    EXPECT_TRUE(bitwise_equal(packed_of(g.fc1_bias.grad.view()), ref.db1));
    EXPECT_TRUE(bitwise_equal(packed_of(g.fc2_weight.grad.view()), ref.dw2));
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8MlpOverrides, ::testing::ValuesIn(partial_masks()),
                         [](const auto& info) { return mask_name(info.param); });

// Three layers' contexts through ActivationOffload (all but the last go to host memory and back):
// the same bits as without, whatever the recipe keeps (act or its FP8 columns).
TEST(Fp8MlpOverridesModule, OffloadedContextsGiveTheSameBits) {
  constexpr int kLayers = 3;
  Rng rng;
  const Batch b(rng, kSplits, kT, kH, kH, DType::kBFloat16);
  for (int mask : {3, 4}) {
    SCOPED_TRACE(mask_name(mask));
    GroupedMLPOptions o = options_with(recipe_of(mask));
    o.accumulate_into_main_grad = true;
    auto run = [&](ActivationOffload* offload) {
      std::vector<std::unique_ptr<GroupedMLP>> layers;
      std::vector<Tensor> main_grads;
      for (int i = 0; i < kLayers; ++i) {
        o.seed = 30 + uint64_t(i);
        layers.push_back(std::make_unique<GroupedMLP>(kG, kH, kF, o));
        main_grads.push_back(main_grad_for(layers.back()->fc1_weight()));
        main_grads.push_back(main_grad_for(layers.back()->fc2_weight()));
      }
      std::vector<MlpContext> ctx(kLayers);
      Tensor x = b.x;
      for (int i = 0; i < kLayers; ++i) {
        if (offload) offload->begin_layer(i, nullptr);
        MlpForwardResult f = layers[size_t(i)]->forward(x, b.groups(), b.scales);
        if (offload) offload->offload(f.ctx, nullptr);
        EXPECT_EQ(f.ctx.offloaded(), offload != nullptr && i < kLayers - 1);
        ctx[size_t(i)] = std::move(f.ctx);
        x = f.y;
      }
      std::vector<Tensor> out{x};
      Tensor dy = b.dy;
      for (int i = kLayers - 1; i >= 0; --i) {
        if (offload) offload->restore(ctx[size_t(i)], nullptr);
        MlpBackwardResult g = layers[size_t(i)]->backward(ctx[size_t(i)], dy);
        out.push_back(g.dprobs);
        dy = g.dx;
      }
      out.push_back(dy);
      for (const Tensor& t : main_grads) out.push_back(t);
      return out;
    };
    ActivationOffload offload(Device::cpu(), kLayers, -1, {.min_bytes = 0});
    const std::vector<Tensor> plain = run(nullptr), moved = run(&offload);
    EXPECT_GT(offload.reloaded_bytes(), 0);
    ASSERT_EQ(plain.size(), moved.size());
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(bitwise_equal(plain[i], moved[i])) << "output " << i;
  }
}

// A recipe naming no GEMM: test_modules_fp8.cpp (BadOptionsAreClearErrors). FC2's bias is scaled
// by the probs in the layers' form, which takes float32 probs only.
TEST(Fp8MlpOverridesModule, Float64ProbsAreAClearError) {
  Rng rng;
  const Batch b(rng, kSplits, kT, kH, kH, DType::kBFloat16);
  GroupedMLP m(kG, kH, kF, options_with(recipe_of(1)));
  EXPECT_MOE_ERROR(m.forward(b.x, b.groups(), Tensor::zeros({kT}, DType::kFloat64)), ErrorCode::kDType,
                   "scales FC2's bias by the probs, which must be float32, got float64");
}

}  // namespace
}  // namespace moe::test
