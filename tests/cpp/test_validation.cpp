// Bad input: every validation error is raised with a message that says what was wrong and what
// was expected.
#include "test_support.hpp"

namespace moe::test {
namespace {

class Validation : public ::testing::Test {
 protected:
  Rng rng;
  Routing r{{3, 0, 5}, 10};  // G = 3, T = 10
  Tensor x = random_tensor({10, 8}, DType::kBFloat16, rng);
  Tensor w = random_tensor({3, 6, 8}, DType::kBFloat16, rng);
  Tensor b = random_tensor({3, 6}, DType::kBFloat16, rng);
  Tensor y = Tensor::empty({10, 6}, DType::kBFloat16);
  Tensor p = uniform_tensor({10}, DType::kFloat32, rng, 0, 1);
};

TEST_F(Validation, Shapes) {
  const auto W = GroupedParam::packed(w);
  EXPECT_MOE_ERROR(
      grouped_linear_forward(x.view().reshape({10, 2, 4}), W, r.layout, y), ErrorCode::kShape,
      "grouped_linear_forward: x: expected a 2-D [T, K] tensor, got bfloat16[10, 2, 4]");
  EXPECT_MOE_ERROR(grouped_linear_forward(x.view().slice(0, 9), W, r.layout, y), ErrorCode::kShape,
                   "x: expected [T, K] = [10, 8], got bfloat16[9, 8]");
  // The weight sets N and K: an activation of another width is what the message names.
  Tensor w_bad = random_tensor({3, 6, 7}, DType::kBFloat16, rng);
  EXPECT_MOE_ERROR(grouped_linear_forward(x, GroupedParam::packed(w_bad), r.layout, y),
                   ErrorCode::kShape, "x: expected [T, K] = [10, 7], got bfloat16[10, 8]");
  EXPECT_MOE_ERROR(grouped_linear_forward(random_tensor({10, 9}, DType::kBFloat16, rng), W, r.layout, y),
                   ErrorCode::kShape, "grouped_linear_forward: x: expected [T, K] = [10, 8], got bfloat16[10, 9]");
  EXPECT_MOE_ERROR(grouped_linear_forward(x, W, r.layout, Tensor::empty({10, 5}, DType::kBFloat16)),
                   ErrorCode::kShape, "y: expected [T, N] = [10, 6], got bfloat16[10, 5]");
  EXPECT_MOE_ERROR(grouped_linear_forward(x, GroupedParam::packed(b), r.layout, y), ErrorCode::kShape,
                   "weight: expected G x [N, K], got packed bfloat16[3, 6]");
  Tensor b_bad = random_tensor({3, 5}, DType::kBFloat16, rng);
  EXPECT_MOE_ERROR(grouped_linear_forward(x, W, r.layout, y, {GroupedParam::packed(b_bad), {}}),
                   ErrorCode::kShape, "bias: expected G x [N] = 3 x [6]");
  EXPECT_MOE_ERROR(grouped_linear_dgrad(y, W, r.layout, Tensor::empty({10, 9}, DType::kBFloat16)),
                   ErrorCode::kShape,
                   "grouped_linear_dgrad: dx: expected [T, K] = [10, 8], got bfloat16[10, 9]");
  EXPECT_MOE_ERROR(grouped_linear_dscales(y, GroupedParam::packed(b), r.layout,
                                          Tensor::empty({9}, DType::kFloat32)),
                   ErrorCode::kShape, "dscales: expected a 1-D [T] = [10] tensor");
}

TEST_F(Validation, GroupCountMismatch) {
  Tensor w4 = random_tensor({4, 6, 8}, DType::kBFloat16, rng);
  EXPECT_MOE_ERROR(grouped_linear_forward(x, GroupedParam::packed(w4), r.layout, y),
                   ErrorCode::kGroupMismatch,
                   "weight has G = 4 experts but the group layout has G = 3");
  Tensor b2 = random_tensor({2, 6}, DType::kBFloat16, rng);
  EXPECT_MOE_ERROR(grouped_linear_dbias(y, r.layout, GroupedParam::packed(b2), GradMode::kWrite),
                   ErrorCode::kGroupMismatch, "dbias has G = 2 experts");
}

TEST_F(Validation, Dtypes) {
  Tensor w16 = random_tensor({3, 6, 8}, DType::kFloat16, rng);
  EXPECT_MOE_ERROR(grouped_linear_forward(x, GroupedParam::packed(w16), r.layout, y),
                   ErrorCode::kDType, "weight: expected bfloat16 like x, got float16");
  Tensor xi = Tensor::zeros({10, 8}, DType::kInt32);
  EXPECT_MOE_ERROR(grouped_linear_forward(xi, GroupedParam::packed(w), r.layout, y),
                   ErrorCode::kDType,
                   "x: expected a float tensor (float32, bfloat16, float16 or float64), got int32");
  Tensor x8 = Tensor::zeros({10, 8}, DType::kFloat8E4M3);
  EXPECT_MOE_ERROR(grouped_linear_forward(x8, GroupedParam::packed(w), r.layout, y),
                   ErrorCode::kDType,
                   "x: float8_e4m3 operands go to the FP8 ops (moe_engine/fp8.hpp: Fp8Rows, Fp8Columns, "
                   "Fp8Weight); expected float32, bfloat16, float16 or float64");
  Tensor x5 = Tensor::zeros({10, 8}, DType::kFloat8E5M2);
  EXPECT_MOE_ERROR(grouped_linear_forward(x5, GroupedParam::packed(w), r.layout, y),
                   ErrorCode::kDType, "x: float8_e5m2 is reserved and not supported yet");
  Tensor p16 = uniform_tensor({10}, DType::kBFloat16, rng, 0, 1);
  EXPECT_MOE_ERROR(grouped_linear_forward(x, GroupedParam::packed(w), r.layout, y,
                                          {GroupedParam::packed(b), p16}),
                   ErrorCode::kDType,
                   "row_scale: expected float32 (or float64 on the CPU), got bfloat16");
  Tensor main_grad_bf16 = Tensor::zeros({3, 6, 8}, DType::kBFloat16);
  EXPECT_MOE_ERROR(grouped_linear_wgrad(y, x, r.layout, GroupedParam::packed(main_grad_bf16),
                                        GradMode::kAccumulate),
                   ErrorCode::kDType,
                   "dweight: accumulate mode writes a float32 main_grad, got bfloat16");
  EXPECT_MOE_ERROR(grouped_linear_wgrad(y, x, r.layout, GroupedParam::packed(main_grad_bf16),
                                        GradMode::kOverwrite),
                   ErrorCode::kDType, "overwrite mode writes a float32 main_grad");
}

TEST_F(Validation, AlignmentStridesAndContiguity) {
  Tensor raw = Tensor::empty({10 * 8 + 1}, DType::kBFloat16);
  const TensorView misaligned(static_cast<char*>(raw.data()) + 1, {10, 8}, DType::kBFloat16,
                              Device::cpu());
  EXPECT_MOE_ERROR(grouped_linear_forward(misaligned, GroupedParam::packed(w), r.layout, y),
                   ErrorCode::kAlignment, "x: data pointer 0x");
  EXPECT_MOE_ERROR(grouped_linear_forward(misaligned, GroupedParam::packed(w), r.layout, y),
                   ErrorCode::kAlignment, "is not aligned to its 2-byte elements");
  Tensor wide = Tensor::empty({10, 16}, DType::kBFloat16);
  const TensorView column_strided(wide.data(), {10, 8}, {16, 2}, DType::kBFloat16, Device::cpu());
  EXPECT_MOE_ERROR(grouped_linear_forward(column_strided, GroupedParam::packed(w), r.layout, y),
                   ErrorCode::kShape, "x: expected unit column stride");
  Tensor big = Tensor::zeros({3, 6, 16}, DType::kFloat32);
  const TensorView slice(big.data(), {6, 8}, {16, 1}, DType::kFloat32, Device::cpu());
  EXPECT_MOE_ERROR(GroupedParam::per_expert({slice, slice, slice}), ErrorCode::kShape,
                   "tensor 0 is not contiguous");  // a non-contiguous main_grad
}

TEST_F(Validation, Devices) {
  const TensorView on_gpu(reinterpret_cast<void*>(0x10000), {10, 8}, DType::kBFloat16,
                          Device::cuda(0));
  EXPECT_MOE_ERROR(grouped_linear_forward(on_gpu, GroupedParam::packed(w), r.layout, y),
                   ErrorCode::kDevice, "x is on cuda:0; expected the group layout's device cpu");
  const TensorView w_gpu(reinterpret_cast<void*>(0x10000), {3, 6, 8}, DType::kBFloat16,
                         Device::cuda(1));
  EXPECT_MOE_ERROR(grouped_linear_forward(x, GroupedParam::packed(w_gpu), r.layout, y),
                   ErrorCode::kDevice,
                   "weight is on cuda:1; expected the group layout's device cpu");
  Tensor ws = Tensor::empty({1 << 16}, DType::kUInt8);
  const ExecContext gpu_ws{nullptr, {ws.data(), ws.nbytes(), Device::cuda(0)}};
  const ExpertMlpWeights weights{GroupedParam::packed(Tensor::zeros({3, 8, 8}, DType::kBFloat16)),
                                 {},
                                 GroupedParam::packed(Tensor::zeros({3, 8, 4}, DType::kBFloat16)),
                                 {}};
  EXPECT_MOE_ERROR(expert_mlp_forward(x, {}, weights, r.layout,
                                      Tensor::empty({10, 8}, DType::kBFloat16), {}, {}, gpu_ws),
                   ErrorCode::kDevice, "the workspace is on cuda:0");
}

TEST_F(Validation, ArgumentCombinations) {
  EXPECT_MOE_ERROR(grouped_linear_forward(x, GroupedParam::packed(w), GroupLayout(), y),
                   ErrorCode::kInvalidArgument, "the group layout is undefined");
  EXPECT_MOE_ERROR(grouped_linear_forward(x, GroupedParam(), r.layout, y),
                   ErrorCode::kInvalidArgument,
                   "weight: required per-expert tensor [N, K] is undefined");
  EXPECT_MOE_ERROR(grouped_linear_forward(x, GroupedParam::packed(w), r.layout, y, {{}, p}),
                   ErrorCode::kInvalidArgument,
                   "row_scale (scale_bias) is given but there is no bias");
  Tensor h = random_tensor({10, 8}, DType::kBFloat16, rng);
  Tensor d = random_tensor({10, 4}, DType::kBFloat16, rng);
  Tensor dh = Tensor::empty({10, 8}, DType::kBFloat16);
  Tensor dp = Tensor::empty({10}, DType::kFloat32);
  GluSpec spec;
  EXPECT_MOE_ERROR(glu_backward(h, {}, d, r.layout, {dh, dp, {}}, spec),
                   ErrorCode::kInvalidArgument,
                   "glu_backward: dprobs is requested but no probs were given");
  EXPECT_MOE_ERROR(glu_backward(h, p, d, r.layout, {{}, dp, {}}, spec), ErrorCode::kInvalidArgument,
                   "dh: required tensor [T, 2F] is undefined");
  EXPECT_MOE_ERROR(glu_forward(h, {}, r.layout, Tensor::empty({10, 5}, DType::kBFloat16), spec),
                   ErrorCode::kShape, "h: expected [T, 2F] = [10, 10], got bfloat16[10, 8]");
  spec.layout = GluLayout::blocks(3);
  EXPECT_MOE_ERROR(glu_forward(h, {}, r.layout, d, spec), ErrorCode::kShape,
                   "GLU layout blocks:3 needs F divisible by 3, got F = 4");
  spec = GluSpec{Activation::kClampedQGeGLU, 0.0f};
  EXPECT_MOE_ERROR(glu_forward(h, {}, r.layout, d, spec), ErrorCode::kInvalidArgument,
                   "clamped_qgeglu limit must be > 0, got 0");
}

// A module called on input of another dtype names its own setting, not a weight of the op.
TEST_F(Validation, ModulesNameTheirDtype) {
  const Tensor x32 = random_tensor({10, 8}, DType::kFloat32, rng);
  GroupedMLP mlp(3, 8, 4);  // the default dtype: bfloat16
  EXPECT_MOE_ERROR(mlp.forward(x32, r.layout), ErrorCode::kDType,
                   "GroupedMLP.forward: x is float32 but the module's parameters are bfloat16 "
                   "(GroupedMLPOptions::dtype)");
  GroupedLinear linear(3, 8, 6);
  EXPECT_MOE_ERROR(linear.forward(x32, r.layout), ErrorCode::kDType,
                   "GroupedLinear.forward: x is float32 but the module's parameters are bfloat16 "
                   "(GroupedLinearOptions::dtype)");
  // Sizes and dtypes are the module's errors, before any tensor is made from them.
  GroupedLinearOptions int_linear;
  int_linear.dtype = DType::kInt32;
  EXPECT_MOE_ERROR(GroupedLinear(2, 16, 16, int_linear), ErrorCode::kDType,
                   "GroupedLinear: GroupedLinearOptions::dtype: expected float32, bfloat16, float16 or float64, got int32");
  EXPECT_MOE_ERROR(GroupedLinear(0, 16, 16), ErrorCode::kInvalidArgument,
                   "GroupedLinear: expected G, in_features, out_features >= 1, got 0, 16, 16");
  EXPECT_MOE_ERROR(GroupedLinear(2, -16, 16), ErrorCode::kInvalidArgument,
                   "GroupedLinear: expected G, in_features, out_features >= 1, got 2, -16, 16");
  GroupedMLPOptions int_mlp;
  int_mlp.dtype = DType::kUInt8;
  EXPECT_MOE_ERROR(GroupedMLP(2, 16, 16, int_mlp), ErrorCode::kDType, "GroupedMLP: GroupedMLPOptions::dtype");
  EXPECT_MOE_ERROR(GroupedMLP(0, 16, 16), ErrorCode::kInvalidArgument, "GroupedMLP: expected G, hidden, ffn >= 1, got 0");
}

TEST_F(Validation, ExpertMlpArguments) {
  const int64_t H = 8, F = 4;
  Tensor w1 = random_tensor({3, 2 * F, H}, DType::kBFloat16, rng);
  Tensor w2 = random_tensor({3, H, F}, DType::kBFloat16, rng);
  Tensor w1_bad = random_tensor({3, 2 * F + 1, H}, DType::kBFloat16, rng);
  Tensor out = Tensor::empty({10, H}, DType::kBFloat16);
  Tensor ws = Tensor::empty({1 << 16}, DType::kUInt8);
  const ExecContext ctx{nullptr, {ws.data(), ws.nbytes(), Device::cpu()}};
  EXPECT_MOE_ERROR(
      expert_mlp_forward(x, {}, {GroupedParam::packed(w1_bad), {}, GroupedParam::packed(w2), {}},
                         r.layout, out, {}, {}, ctx),
      ErrorCode::kShape, "fc1_weight: expected G x [2F, H] = 3 x [8, 8]");
  EXPECT_MOE_ERROR(
      expert_mlp_forward(x, {}, {GroupedParam::packed(w1), {}, {}, {}}, r.layout, out, {}, {}, ctx),
      ErrorCode::kInvalidArgument, "fc2_weight: required per-expert tensor [H, F] is undefined");
  ExpertMlpGrads grads;
  grads.fc2_bias = {GroupedParam::packed(Tensor::zeros({3, H}, DType::kFloat32)), GradMode::kWrite};
  EXPECT_MOE_ERROR(
      expert_mlp_backward(out, x, {}, {GroupedParam::packed(w1), {}, GroupedParam::packed(w2), {}},
                          r.layout, {}, grads, {}, ctx),
      ErrorCode::kInvalidArgument, "fc2_bias: a gradient is requested but the MLP has no fc2_bias");
  // x may be left out only when the pre-activation is given and no FC1 weight gradient is asked.
  const ExpertMlpWeights weights{GroupedParam::packed(w1), {}, GroupedParam::packed(w2), {}};
  EXPECT_MOE_ERROR(expert_mlp_backward(out, {}, {}, weights, r.layout, {}, ExpertMlpGrads{}, {}, ctx),
                   ErrorCode::kInvalidArgument, "x: required tensor [T, H] is undefined");
  Tensor fc1_out = random_tensor({10, 2 * F}, DType::kBFloat16, rng);
  ExpertMlpGrads dw1;
  dw1.fc1_weight = {GroupedParam::packed(Tensor::zeros({3, 2 * F, H}, DType::kFloat32)), GradMode::kWrite};
  EXPECT_MOE_ERROR(expert_mlp_backward(out, {}, {}, weights, r.layout, fc1_out, dw1, {}, ctx),
                   ErrorCode::kInvalidArgument, "x: required tensor [T, H] is undefined");
  Tensor dx = Tensor::zeros({10, H}, DType::kBFloat16);
  ExpertMlpGrads dx_only;
  dx_only.dx = dx;
  EXPECT_NO_THROW(expert_mlp_backward(out, {}, {}, weights, r.layout, fc1_out, dx_only, {}, ctx));
  // The CUDA kernels read every activation in one dtype: mixes are errors on every device.
  const Tensor fc1_out32 = Tensor::zeros({10, 2 * F}, DType::kFloat32);
  EXPECT_MOE_ERROR(expert_mlp_backward(out, x, {}, weights, r.layout, fc1_out32, dx_only, {}, ctx), ErrorCode::kDType,
                   "expert_mlp_backward: fc1_out: expected bfloat16 like dy, got float32");
  GluSpec glu;
  const Tensor h = random_tensor({10, 2 * F}, DType::kBFloat16, rng), d_out32 = Tensor::zeros({10, F}, DType::kFloat32);
  Tensor dh = Tensor::zeros({10, 2 * F}, DType::kBFloat16);
  EXPECT_MOE_ERROR(glu_backward(h, {}, d_out32, r.layout, {dh, {}, {}}, glu), ErrorCode::kDType,
                   "glu_backward: d_out: expected bfloat16 like h, got float32");
  // A workspace over an argument is the op's error, not one of its inner steps'.
  Tensor big = Tensor::empty({(1 << 16) + 10 * H}, DType::kBFloat16);
  const TensorView x_in_ws(big.data(), {10, H}, DType::kBFloat16, Device::cpu());
  copy_tensor(x_in_ws, x);
  const ExecContext over_x{nullptr, {big.data(), big.nbytes(), Device::cpu()}};
  EXPECT_MOE_ERROR(expert_mlp_forward(x_in_ws, {}, weights, r.layout, out, {}, {}, over_x),
                   ErrorCode::kInvalidArgument, "expert_mlp_forward: the workspace overlaps x in memory");
  ExpertMlpGrads dx_in_ws;
  dx_in_ws.dx = x_in_ws;
  EXPECT_MOE_ERROR(expert_mlp_backward(out, {}, {}, weights, r.layout, fc1_out, dx_in_ws, {}, over_x),
                   ErrorCode::kInvalidArgument, "expert_mlp_backward: the workspace overlaps dx in memory");
  // dL/d(fc1_out) written out: [T, W] in dy's dtype, apart from the inputs and dx.
  // (ExpertMlpGrads holds views: the tensors they see stay named.)
  const Tensor narrow = Tensor::zeros({10, F}, DType::kBFloat16), f32 = Tensor::zeros({10, 2 * F}, DType::kFloat32),
               good = Tensor::zeros({10, 2 * F}, DType::kBFloat16);
  ExpertMlpGrads to_d_fc1;
  to_d_fc1.d_fc1 = narrow;
  EXPECT_MOE_ERROR(expert_mlp_backward(out, {}, {}, weights, r.layout, fc1_out, to_d_fc1, {}, ctx), ErrorCode::kShape,
                   "expert_mlp_backward: d_fc1: expected [T, 2F] = [10, 8], got bfloat16[10, 4]");
  to_d_fc1.d_fc1 = f32;
  EXPECT_MOE_ERROR(expert_mlp_backward(out, {}, {}, weights, r.layout, fc1_out, to_d_fc1, {}, ctx), ErrorCode::kDType,
                   "d_fc1");
  to_d_fc1.d_fc1 = fc1_out;
  EXPECT_MOE_ERROR(expert_mlp_backward(out, {}, {}, weights, r.layout, fc1_out, to_d_fc1, {}, ctx),
                   ErrorCode::kInvalidArgument, "d_fc1");
  to_d_fc1.d_fc1 = good;
  EXPECT_NO_THROW(expert_mlp_backward(out, {}, {}, weights, r.layout, fc1_out, to_d_fc1, {}, ctx));
  // FC2's input written out: [T, F], apart from the other outputs.
  const Tensor act_wide = Tensor::zeros({10, 2 * F}, DType::kBFloat16), act = Tensor::zeros({10, F}, DType::kBFloat16);
  ExpertMlpGrads to_act;
  to_act.act = act_wide;
  EXPECT_MOE_ERROR(expert_mlp_backward(out, {}, {}, weights, r.layout, fc1_out, to_act, {}, ctx), ErrorCode::kShape,
                   "expert_mlp_backward: act: expected [T, F] = [10, 4], got bfloat16[10, 8]");
  to_act.act = act;
  to_act.d_fc1 = act;
  EXPECT_MOE_ERROR(expert_mlp_backward(out, {}, {}, weights, r.layout, fc1_out, to_act, {}, ctx),
                   ErrorCode::kShape, "d_fc1");
  to_act.d_fc1 = good;
  EXPECT_NO_THROW(expert_mlp_backward(out, {}, {}, weights, r.layout, fc1_out, to_act, {}, ctx));
}

// A non-gated activation's FC1 has F rows: a GLU-sized FC1 (the usual mistake) names the shape it
// expected; its pre-activation is [T, F]; a GLU layout for it is refused; so is the activation op
// on a [T, 2F] h.
TEST_F(Validation, NonGatedActivationShapes) {
  const int64_t H = 8, F = 4;
  Tensor w1 = random_tensor({3, F, H}, DType::kBFloat16, rng);
  Tensor w1_glu = random_tensor({3, 2 * F, H}, DType::kBFloat16, rng);
  Tensor w2 = random_tensor({3, H, F}, DType::kBFloat16, rng);
  Tensor out = Tensor::empty({10, H}, DType::kBFloat16);
  Tensor ws = Tensor::empty({1 << 16}, DType::kUInt8);
  const ExecContext ctx{nullptr, {ws.data(), ws.nbytes(), Device::cpu()}};
  for (Activation act : kElementwiseActivations) {
    SCOPED_TRACE(activation_name(act));
    const ExpertMlpSpec spec{spec_of(act)};
    EXPECT_MOE_ERROR(expert_mlp_forward(x, {}, {GroupedParam::packed(w1_glu), {}, GroupedParam::packed(w2), {}},
                                        r.layout, out, {}, spec, ctx),
                     ErrorCode::kShape,
                     "expert_mlp_forward: fc1_weight: expected G x [F, H] = 3 x [4, 8], got packed bfloat16[3, 8, 8]");
    Tensor b1_glu = random_tensor({3, 2 * F}, DType::kBFloat16, rng);
    EXPECT_MOE_ERROR(expert_mlp_forward(x, {}, {GroupedParam::packed(w1), GroupedParam::packed(b1_glu),
                                                GroupedParam::packed(w2), {}},
                                        r.layout, out, {}, spec, ctx),
                     ErrorCode::kShape, "fc1_bias: expected G x [F] = 3 x [4]");
    const ExpertMlpWeights weights{GroupedParam::packed(w1), {}, GroupedParam::packed(w2), {}};
    Tensor h_glu = Tensor::empty({10, 2 * F}, DType::kBFloat16);
    EXPECT_MOE_ERROR(expert_mlp_forward(x, {}, weights, r.layout, out, h_glu, spec, ctx), ErrorCode::kShape,
                     "expert_mlp_forward: fc1_out: expected [T, F] = [10, 4], got bfloat16[10, 8]");
    EXPECT_NO_THROW(expert_mlp_forward(x, {}, weights, r.layout, out, Tensor::empty({10, F}, DType::kBFloat16),
                                       spec, ctx));
    EXPECT_MOE_ERROR(expert_mlp_forward(x, {}, weights, r.layout, out, {}, {spec_of(act, GluLayout::pairs())}, ctx),
                     ErrorCode::kInvalidArgument,
                     "expert_mlp_forward: GLU layout pairs given for " + std::string(activation_name(act)) +
                         ", which is not gated");
    EXPECT_MOE_ERROR(glu_forward(h_glu, {}, r.layout, Tensor::empty({10, F}, DType::kBFloat16), spec.glu),
                     ErrorCode::kShape, "glu_forward: h: expected [T, F] = [10, 4], got bfloat16[10, 8]");
    ExpertMlpGrads dw1;
    dw1.fc1_weight = {GroupedParam::packed(Tensor::zeros({3, 2 * F, H}, DType::kFloat32)), GradMode::kWrite};
    EXPECT_MOE_ERROR(expert_mlp_backward(out, x, {}, weights, r.layout, {}, dw1, spec, ctx), ErrorCode::kShape,
                     "expert_mlp_backward: fc1_weight: expected G x [F, H] = 3 x [4, 8], got packed float32[3, 8, 8]");
  }
  // The module: FC1 of F rows; a GLU layout is refused there too.
  GroupedMLPOptions o;
  o.glu = spec_of(Activation::kGeluTanh);
  GroupedMLP mlp(3, H, F, o);
  EXPECT_EQ(mlp.fc1_weight().expert_shape(), (Shape{F, H}));
  o.glu.layout = GluLayout::blocks(2);
  EXPECT_MOE_ERROR(GroupedMLP(3, H, F, o), ErrorCode::kInvalidArgument,
                   "GroupedMLP: GLU layout blocks:2 given for gelu_tanh, which is not gated");
}

TEST_F(Validation, OutputsMustNotAliasInputs) {
  const auto W = GroupedParam::packed(w);
  Tensor buf = random_tensor({10, 16}, DType::kBFloat16, rng);
  const TensorView left(buf.data(), {10, 8}, {16, 1}, DType::kBFloat16, Device::cpu());
  const TensorView right(buf.data_as<BFloat16>() + 8, {10, 6}, {16, 1}, DType::kBFloat16,
                         Device::cpu());
  EXPECT_MOE_ERROR(grouped_linear_forward(left, W, r.layout, right), ErrorCode::kInvalidArgument,
                   "grouped_linear_forward: output y overlaps input x in memory");
  Tensor shared =
      random_tensor({80 + 144}, DType::kBFloat16, rng);  // x, then dweight from x's middle
  const TensorView xs(shared.data(), {10, 8}, DType::kBFloat16, Device::cpu());
  const TensorView dw(shared.data_as<BFloat16>() + 40, {3, 6, 8}, DType::kBFloat16, Device::cpu());
  EXPECT_MOE_ERROR(
      grouped_linear_wgrad(y, xs, r.layout, GroupedParam::packed(dw), GradMode::kWrite),
      ErrorCode::kInvalidArgument, "output dweight overlaps input x");
  GluSpec spec;
  Tensor h = random_tensor({10, 8}, DType::kBFloat16, rng);
  EXPECT_MOE_ERROR(glu_forward(h, {}, r.layout, h.view().reshape({20, 4}).slice(0, 10), spec),
                   ErrorCode::kInvalidArgument, "output out overlaps input h");
  // glu_backward may run in place, but a shifted view of an input is an error.
  Tensor hh = random_tensor({11, 8}, DType::kBFloat16, rng), dd = random_tensor({10, 4}, DType::kBFloat16, rng);
  const TensorView h10(hh.data(), {10, 8}, DType::kBFloat16, Device::cpu());
  const TensorView shifted(hh.data_as<BFloat16>() + 8, {10, 8}, DType::kBFloat16, Device::cpu());
  EXPECT_NO_THROW(glu_backward(h10, {}, dd, r.layout, {h10, {}, dd}, spec));
  EXPECT_MOE_ERROR(glu_backward(h10, {}, dd, r.layout, {shifted, {}, {}}, spec), ErrorCode::kInvalidArgument,
                   "glu_backward: output dh overlaps input h in memory; expected separate buffers, or h itself "
                   "(in place)");
}

// Overlaps the first checks missed: every output against every input it reads while writing, the
// experts of a per-expert gradient against each other, rows of an output that overlap.
TEST_F(Validation, MoreOutputsMustNotAliasInputs) {
  const auto W = GroupedParam::packed(w);
  Tensor f = Tensor::zeros({10 * 6 + 16}, DType::kFloat32);
  const TensorView y32(f.data(), {10, 6}, DType::kFloat32, Device::cpu());
  const TensorView scale_in_y(f.data_as<float>() + 1, {10}, DType::kFloat32, Device::cpu());
  const Tensor x32 = random_tensor({10, 8}, DType::kFloat32, rng), w32 = random_tensor({3, 6, 8}, DType::kFloat32, rng);
  const Tensor b32 = random_tensor({3, 6}, DType::kFloat32, rng), p32 = uniform_tensor({10}, DType::kFloat32, rng, 0, 1);
  EXPECT_MOE_ERROR(grouped_linear_forward(x32, GroupedParam::packed(w32), r.layout, y32,
                                          {GroupedParam::packed(b32), scale_in_y}),
                   ErrorCode::kInvalidArgument, "grouped_linear_forward: output y overlaps input row_scale");
  const TensorView bias_in_y(f.data(), {3, 6}, DType::kFloat32, Device::cpu());
  EXPECT_MOE_ERROR(grouped_linear_forward(x32, GroupedParam::packed(w32), r.layout, y32,
                                          {GroupedParam::packed(bias_in_y), {}}),
                   ErrorCode::kInvalidArgument, "grouped_linear_forward: output y overlaps input bias");
  const TensorView db(f.data(), {3, 6}, DType::kFloat32, Device::cpu());
  const TensorView scale_in_db(f.data_as<float>() + 4, {10}, DType::kFloat32, Device::cpu());
  const Tensor dy32 = random_tensor({10, 6}, DType::kFloat32, rng);
  EXPECT_MOE_ERROR(grouped_linear_dbias(dy32, r.layout, GroupedParam::packed(db), GradMode::kWrite, scale_in_db),
                   ErrorCode::kInvalidArgument, "grouped_linear_dbias: output dbias overlaps input row_scale");
  const TensorView ds(f.data(), {10}, DType::kFloat32, Device::cpu());
  EXPECT_MOE_ERROR(grouped_linear_dscales(dy32, GroupedParam::packed(db), r.layout, ds, false),
                   ErrorCode::kInvalidArgument, "grouped_linear_dscales: output dscales overlaps input bias");
  // One tensor listed for two experts: each expert's sum would be added into the same memory.
  Tensor shared = Tensor::zeros({6, 8}, DType::kFloat32);
  const std::vector<TensorView> twice = {shared, Tensor::zeros({6, 8}, DType::kFloat32), shared};
  const Tensor table = make_pointer_table(twice);
  EXPECT_MOE_ERROR(grouped_linear_wgrad(dy32, x32, r.layout, GroupedParam::per_expert(twice, table), GradMode::kAccumulate),
                   ErrorCode::kInvalidArgument, "output dweight: two experts' tensors overlap in memory");
  // Rows of an output on top of each other (row stride 0, or below the row's width).
  for (const int64_t stride : {0, 4}) {
    const TensorView rows(f.data(), {10, 6}, {stride, 1}, DType::kFloat32, Device::cpu());
    EXPECT_MOE_ERROR(grouped_linear_forward(x32, GroupedParam::packed(w32), r.layout, rows), ErrorCode::kShape,
                     "grouped_linear_forward: y: expected rows that do not overlap (row stride >= 6)");
  }
  (void)W;
  (void)p32;
}

// What the routing's buffers must stay: offsets written by GroupLayout::compute (the CPU backend
// indexes rows by them), separate from the splits; a GradMode outside the enum.
TEST_F(Validation, RoutingBuffersAndModes) {
  Routing changed({2, 2}, 4);
  changed.offsets_tensor.data_as<int64_t>()[1] = int64_t(1) << 19;
  changed.offsets_tensor.data_as<int64_t>()[2] = int64_t(1) << 20;
  const Tensor x4 = random_tensor({4, 8}, DType::kFloat32, rng), w4 = random_tensor({2, 6, 8}, DType::kFloat32, rng);
  Tensor y4 = Tensor::empty({4, 6}, DType::kFloat32);
  EXPECT_MOE_ERROR(grouped_linear_forward(x4, GroupedParam::packed(w4), changed.layout, y4), ErrorCode::kInvalidArgument,
                   "grouped_linear_forward: the group layout's offsets[0..1] = 0, 524288 are not the prefix sums "
                   "GroupLayout::compute wrote");
  Tensor buf = Tensor::zeros({5}, DType::kInt64);
  buf.data_as<int64_t>()[0] = 3, buf.data_as<int64_t>()[1] = 2, buf.data_as<int64_t>()[2] = 1;
  const TensorView splits(buf.data(), {3}, DType::kInt64, Device::cpu());
  const TensorView offsets(buf.data_as<int64_t>() + 1, {4}, DType::kInt64, Device::cpu());
  EXPECT_MOE_ERROR(GroupLayout::compute(splits, 6, offsets), ErrorCode::kInvalidArgument,
                   "GroupLayout: offsets overlap splits in memory");
  const Tensor dy = random_tensor({10, 6}, DType::kFloat32, rng), x32 = random_tensor({10, 8}, DType::kFloat32, rng);
  Tensor dw = Tensor::zeros({3, 6, 8}, DType::kFloat32);
  EXPECT_MOE_ERROR(grouped_linear_wgrad(dy, x32, r.layout, GroupedParam::packed(dw), static_cast<GradMode>(7)),
                   ErrorCode::kInvalidArgument, "mode: expected GradMode kWrite, kAccumulate or kOverwrite, got the value 7");
}

// Shapes whose bytes do not fit in 64 bits are refused where a tensor or a view is made (numel()
// would wrap to a small number and pass every shape check after it); a failed allocation is
// kOutOfMemory.
TEST(TensorLimits, OverflowingShapesAndFailedAllocations) {
  const int64_t huge = int64_t(1) << 62;
  EXPECT_MOE_ERROR(Tensor::empty({huge, 4}, DType::kFloat32), ErrorCode::kShape,
                   "Tensor::empty: [4611686018427387904, 4] of float32 is more than 2^63 bytes");
  float cell = 0;
  EXPECT_MOE_ERROR(TensorView(&cell, {huge, 4}, DType::kFloat32, Device::cpu()), ErrorCode::kShape,
                   "spans more than 2^63 bytes");
  EXPECT_MOE_ERROR(TensorView(&cell, {3, huge}, {huge, 1}, DType::kFloat32, Device::cpu()), ErrorCode::kShape,
                   "spans more than 2^63 bytes");
  EXPECT_NO_THROW(TensorView(&cell, {huge, 0}, DType::kFloat32, Device::cpu()));  // no elements
  EXPECT_MOE_ERROR(Tensor::empty({int64_t(1) << 45}, DType::kFloat32), ErrorCode::kOutOfMemory,
                   "Tensor::empty: out of host memory");
}

TEST(Names, UnknownNamesAreClearErrors) {
  EXPECT_MOE_ERROR(dtype_from_name("bfloat"), ErrorCode::kInvalidArgument,
                   "unknown dtype 'bfloat'");
  EXPECT_STREQ(error_code_name(ErrorCode::kGroupMismatch), "group mismatch");
  EXPECT_STREQ(grad_mode_name(GradMode::kOverwrite), "overwrite");
  try {
    throw_error(ErrorCode::kShape, "x: expected ", 3);
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "moe-engine shape error: x: expected 3");
  }
}

}  // namespace
}  // namespace moe::test
