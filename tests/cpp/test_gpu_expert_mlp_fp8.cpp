// The FP8 expert MLP on the GPU: against the float64 MLP of the unquantized inputs and the CPU
// backend's FP8 MLP, deterministic, and forward + backward captured once in a CUDA graph, replayed
// with new routings bit for bit as eager runs.
#include <limits>
#include <utility>

#include "fp8_mlp_support.hpp"
#include "gpu_support.hpp"

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

namespace moe::test {
namespace {

class GpuFp8Mlp : public ::testing::Test {
 protected:
  void SetUp() override { MOE_SKIP_WITHOUT_HOPPER(); }
};

Fp8MlpRun to_host(const Fp8MlpRun& r) {
  Fp8MlpRun h;
  for (auto [from, to] : {std::pair{&r.y, &h.y}, {&r.dx, &h.dx}, {&r.dprobs, &h.dprobs}, {&r.dw1, &h.dw1},
                          {&r.dw2, &h.dw2}, {&r.db1, &h.db1}, {&r.db2, &h.db2}})
    if (from->defined()) *to = test::to_host(*from);
  h.saved_h = r.saved_h.to(Device::cpu());
  if (r.saved_x.data.defined()) h.saved_x = r.saved_x.to(Device::cpu());
  if (r.saved_x_rows.data.defined()) h.saved_x_rows = r.saved_x_rows.to(Device::cpu());
  return h;
}

std::vector<const Tensor*> outputs_of(const Fp8MlpRun& r) {
  std::vector<const Tensor*> all;
  for (const Tensor* t : {&r.y, &r.dx, &r.dprobs, &r.dw1, &r.dw2, &r.db1, &r.db2, &r.saved_h.data,
                          &r.saved_h.scales, &r.saved_x.data, &r.saved_x.scales, &r.saved_x.offsets,
                          &r.saved_x_rows.data, &r.saved_x_rows.scales})
    if (t->defined()) all.push_back(t);
  return all;
}

// GPU and CPU FP8 MLPs sum in different orders, so a few quantized values land one E4M3 step
// apart; their results agree far closer than either agrees with the unquantized MLP.
constexpr double kGpuVsCpuBound = 5e-4;

TEST_F(GpuFp8Mlp, MatchesTheFloat64MlpAndTheCpuBackend) {
  Rng rng;
  struct Case {
    const char* name;
    std::vector<int64_t> splits;
    int64_t T;
  };
  std::vector<Case> cases = {{"odd_with_empty_and_one_row_experts", {300, 0, 1, 129, 0, 77, 255, 2}, 1100},
                             {"one_expert_takes_all", {0, 0, 0, 700, 0}, 720},
                             {"single_expert", {513}, 520}};
  cases.push_back({"256_experts", random_splits(rng, 256, 12), 256 * 12});
  for (const Case& k : cases) {
    // Every activation; the non-gated ones (FC1 of F rows) take the separate steps around them.
    for (const auto& [act, bias] : {std::pair{Activation::kSwiGLU, false}, {Activation::kClampedQGeGLU, true},
                                    {Activation::kSReLU, true}, {Activation::kGeluTanh, false}}) {
      SCOPED_TRACE(std::string(k.name) + ", " + activation_name(act) + (bias ? " with biases and probs" : ""));
      DualRouting r(k.splits, k.T);
      const Fp8MlpCase c(rng, k.T, r.cpu.num_groups(), 272, 208, DType::kBFloat16,
                         spec_of(act, is_gated(act) ? GluLayout::pairs() : GluLayout::halves()), bias, bias);
      const Fp8MlpWeights wg(c, Device::cuda(0)), wc(c, Device::cpu());
      const Fp8MlpBuffers gpu(c, Device::cuda(0)), cpu(c, Device::cpu());
      gpu.step(c, wg, r.gpu);
      cpu.step(c, wc, r.cpu.layout);
      synchronize(nullptr);
      EXPECT_NO_THROW(r.flag.check());
      const Fp8MlpRun got = to_host(gpu.out);
      expect_fp8_mlp_matches_oracle(c, r.cpu, got);
      const int64_t rows = r.cpu.rows();
      EXPECT_LE(oracle::similarity_diff(rows_of(got.y, rows), rows_of(cpu.out.y, rows)), kGpuVsCpuBound) << "y vs CPU";
      EXPECT_LE(oracle::similarity_diff(rows_of(got.dx, rows), rows_of(cpu.out.dx, rows)), kGpuVsCpuBound) << "dx vs CPU";
      EXPECT_LE(oracle::similarity_diff(experts_of(got.dw1), experts_of(cpu.out.dw1)), kGpuVsCpuBound) << "dw1 vs CPU";
      EXPECT_LE(oracle::similarity_diff(experts_of(got.dw2), experts_of(cpu.out.dw2)), kGpuVsCpuBound) << "dw2 vs CPU";
      // x's columns are the quantizer's: the same bytes on both backends.
      EXPECT_TRUE(bitwise_equal(got.saved_x.data, cpu.out.saved_x.data));
      EXPECT_TRUE(bitwise_equal(got.saved_x.scales, cpu.out.saved_x.scales));
    }
  }
}

TEST_F(GpuFp8Mlp, RunsAreBitIdentical) {
  Rng rng;
  DualRouting r(random_splits(rng, 8, 300), 8 * 300);
  const Fp8MlpCase c(rng, 8 * 300, 8, 256, 128, DType::kBFloat16, spec_of(Activation::kSwiGLU, GluLayout::pairs()),
                     true, true);
  const Fp8MlpWeights w(c, Device::cuda(0));
  const Fp8MlpBuffers a(c, Device::cuda(0)), b(c, Device::cuda(0));
  a.step(c, w, r.gpu);
  b.step(c, w, r.gpu);
  synchronize(nullptr);
  const auto x = outputs_of(a.out), y = outputs_of(b.out);
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(bitwise_equal(test::to_host(*x[i]), test::to_host(*y[i]))) << i;
}

// The fused steps around the GLU (forward: h and act quantized in the GLU's pass; backward, fusion
// forward and all alike: h dequantized, the GLU backward, dL/dh by rows and columns and act by
// columns in one pass, or, where that pass declines (float32, layouts whose 128 columns of h do not
// hold both halves of their features), h dequantized and the GLU backward in one pass and the
// quantizers after it) against the unfused ops: the same bytes everywhere but dprobs (summed in
// another order), over the layouts they take (pairs and blocks of 4 in a lane, blocks of 8..64 over
// two lanes, runs of 128), ones they leave to the unfused steps, both activation dtypes and
// power-of-two scales. Each case names the passes that must have run, as the ops report them.
TEST_F(GpuFp8Mlp, FusedStepsEqualTheUnfusedOps) {
  Rng rng;
  using Path = Fp8GluBackwardPath;
  struct Case {
    const char* layout;
    int64_t F;
    DType dt;
    bool pow2;
    bool forward_pass;  // the GLU + quantize pass (keeping h's rows)
    Path backward;
  };
  const Case cases[] = {
      {"pairs", 208, DType::kBFloat16, false, true, Path::kOnePass},
      {"blocks:32", 192, DType::kBFloat16, true, true, Path::kOnePass},
      {"blocks:64", 320, DType::kFloat32, false, true, Path::kRows},      // the one pass: bfloat16 only
      {"blocks:128", 256, DType::kBFloat16, false, true, Path::kRows},    // runs of 128: gate and linear in two tiles
      {"halves", 384, DType::kBFloat16, false, true, Path::kRows},        // runs of 384
      {"halves", 144, DType::kFloat32, false, false, Path::kRows},        // runs of 144: h's blocks not runs
      {"blocks:8", 112, DType::kBFloat16, true, true, Path::kOnePass},
      {"blocks:2", 96, DType::kBFloat16, false, false, Path::kSeparate},  // runs of 2: no pass takes them
      {"blocks:4", 176, DType::kBFloat16, false, true, Path::kOnePass},
      {"blocks:16", 80, DType::kBFloat16, false, true, Path::kOnePass}};
  for (const Case& k : cases) {
    SCOPED_TRACE(std::string(k.layout) + " F=" + std::to_string(k.F) + " " + dtype_name(k.dt) +
                 (k.pow2 ? " pow2" : ""));
    DualRouting r({150, 0, 1, 300, 129}, 640);
    const Fp8MlpCase c(rng, 640, 5, 160, k.F, k.dt, spec_of(Activation::kSwiGLU, GluLayout::parse(k.layout)), false,
                       true);
    const Fp8MlpWeights w(c, Device::cuda(0));
    const Fp8MlpBuffers fused(c, Device::cuda(0)), standard(c, Device::cuda(0)), unfused(c, Device::cuda(0));
    const Fp8Recipe recipe{k.pow2, 0.f};
    bool forward_ran[3] = {};
    Path backward_ran[3] = {};
    fused.step(c, w, r.gpu, nullptr, GradMode::kWrite, MlpFusion::kForwardBackward, recipe, &forward_ran[0],
               &backward_ran[0]);
    standard.step(c, w, r.gpu, nullptr, GradMode::kWrite, MlpFusion::kForward, recipe, &forward_ran[1],
                  &backward_ran[1]);
    unfused.step(c, w, r.gpu, nullptr, GradMode::kWrite, MlpFusion::kNone, recipe, &forward_ran[2], &backward_ran[2]);
    synchronize(nullptr);
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(forward_ran[i], k.forward_pass) << (i == 0 ? "fusion all" : "fusion forward");
      EXPECT_STREQ(enum_name(backward_ran[i]), enum_name(k.backward)) << (i == 0 ? "fusion all" : "fusion forward");
    }
    EXPECT_FALSE(forward_ran[2]) << "fusion none";
    EXPECT_STREQ(enum_name(backward_ran[2]), enum_name(Path::kSeparate)) << "fusion none";
    const int64_t rows = r.cpu.rows();
    for (const Fp8MlpBuffers* run : {&fused, &standard}) {
      SCOPED_TRACE(run == &fused ? "fusion all" : "fusion forward");
      const auto a = outputs_of(run->out), b = outputs_of(unfused.out);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i)
        if (a[i] != &run->out.dprobs)
          EXPECT_TRUE(bitwise_equal(test::to_host(*a[i]), test::to_host(*b[i]))) << "output " << i;
      EXPECT_LE(oracle::similarity_diff(head_of(test::to_host(run->out.dprobs), rows),
                                        head_of(test::to_host(unfused.out.dprobs), rows)),
                1e-9)
          << "dprobs";
      expect_fp8_mlp_matches_oracle(c, r.cpu, to_host(run->out));
    }
  }
}

// SwiGLU's GLU backward passes take its constants at compile time (GluMath::swiglu); clamped_qgeglu
// with the same constants (limit inf, alpha 1, offset 0) takes them from the parameters: the same
// function, so every output the same bits, through the one-pass backward (blocks of 32: partner
// lanes; pairs: four in a lane) and the rows pass (runs of 128).
TEST_F(GpuFp8Mlp, SwigluEqualsClampedQGeGLUWithSwigluConstantsBitForBit) {
  Rng rng;
  using Path = Fp8GluBackwardPath;
  const std::pair<const char*, Path> layouts[] = {
      {"blocks:32", Path::kOnePass}, {"pairs", Path::kOnePass}, {"blocks:128", Path::kRows}};
  for (const auto& [layout, path] : layouts) {
    SCOPED_TRACE(layout);
    DualRouting r({150, 0, 1, 300, 129}, 640);
    const Fp8MlpCase swiglu(rng, 640, 5, 160, 256, DType::kBFloat16,
                            spec_of(Activation::kSwiGLU, GluLayout::parse(layout)), false, true);
    Fp8MlpCase generic = swiglu;
    generic.glu = GluSpec{Activation::kClampedQGeGLU, std::numeric_limits<float>::infinity(), 1.f, 0.f,
                          swiglu.glu.layout};
    const Fp8MlpWeights w(swiglu, Device::cuda(0));
    const Fp8MlpBuffers a(swiglu, Device::cuda(0)), b(generic, Device::cuda(0));
    bool forward_ran[2] = {};
    Path backward_ran[2] = {};
    a.step(swiglu, w, r.gpu, nullptr, GradMode::kWrite, MlpFusion::kForward, Fp8Recipe{}, &forward_ran[0],
           &backward_ran[0]);
    b.step(generic, w, r.gpu, nullptr, GradMode::kWrite, MlpFusion::kForward, Fp8Recipe{}, &forward_ran[1],
           &backward_ran[1]);
    synchronize(nullptr);
    for (int i = 0; i < 2; ++i) EXPECT_STREQ(enum_name(backward_ran[i]), enum_name(path)) << i;
    const auto x = outputs_of(a.out), y = outputs_of(b.out);
    ASSERT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(bitwise_equal(test::to_host(*x[i]), test::to_host(*y[i]))) << i;
  }
}

// x kept as rows (256 experts of a few tokens: its columns would be ~30x the bytes): against the
// oracle, and equal to keeping the columns in everything but the FC1 weight gradient.
TEST_F(GpuFp8Mlp, KeepingTheRowsOfXInsteadOfItsColumns) {
  Rng rng;
  const int64_t G = 256, T = 256 * 4;
  ASSERT_TRUE(expert_mlp_fp8_keeps_x_rows(T, G));
  DualRouting r(random_splits(rng, G, 8), T);
  const Fp8MlpCase c(rng, T, G, 256, 128, DType::kBFloat16, spec_of(Activation::kSwiGLU, GluLayout::blocks(32)),
                     false, true);
  const Fp8MlpWeights w(c, Device::cuda(0));
  const Fp8MlpBuffers rows(c, Device::cuda(0), /*x_rows=*/true), columns(c, Device::cuda(0));
  rows.step(c, w, r.gpu);
  columns.step(c, w, r.gpu);
  synchronize(nullptr);
  const Fp8MlpRun a = to_host(rows.out), b = to_host(columns.out);
  expect_fp8_mlp_matches_oracle(c, r.cpu, a);
  for (auto [x, y] : {std::pair{&a.y, &b.y}, {&a.dx, &b.dx}, {&a.dprobs, &b.dprobs}, {&a.dw2, &b.dw2}})
    EXPECT_TRUE(bitwise_equal(*x, *y));
  EXPECT_LE(oracle::similarity_diff(experts_of(a.dw1), experts_of(b.dw1)), 1e-3);
}

// Offsets + quantization + the six FP8 GEMMs + GLU, with main_grad accumulation, captured once;
// replayed with new routings (one expert taking almost all rows among them), equal bit for bit
// to eager runs and right against the oracle.
TEST_F(GpuFp8Mlp, CapturedOnceReplayedWithNewRoutingsEqualsEager) {
  Rng rng;
  const int64_t G = 16, T = 1024;
  const Fp8MlpCase c(rng, T, G, 256, 192, DType::kBFloat16,
                     spec_of(Activation::kClampedQGeGLU, GluLayout::pairs()), true, true);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Device dev = Device::cuda(0);
  const Fp8MlpWeights w(c, dev, stream);
  const Fp8MlpBuffers b(c, dev);
  Tensor splits = Tensor::empty({G}, DType::kInt64, dev), offsets = Tensor::empty({G + 1}, DType::kInt64, dev);
  DeviceErrorFlag flag(dev);
  const Tensor start_w1 = random_tensor({G, 2 * c.F, c.H}, DType::kFloat32, rng),
               start_w2 = random_tensor({G, c.H, c.F}, DType::kFloat32, rng);
  auto step = [&] {
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag, stream);
    b.step(c, w, groups, stream, GradMode::kAccumulate);
  };
  auto reset = [&] {
    for (const Tensor* t : outputs_of(b.out)) fill_bytes(*t, kPoison, stream);
    copy_tensor(b.out.dw1, start_w1, stream);
    copy_tensor(b.out.dw2, start_w2, stream);
  };
  copy_tensor(splits, splits_tensor_for(random_splits_within(rng, G, T)), stream);
  reset();
  step();  // warm-up outside capture
  CUDA_OK(cudaStreamSynchronize(stream));
  CapturedGraph graph(stream, step);
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE("routing " + std::to_string(replay));
    std::vector<int64_t> s = random_splits_within(rng, G, T);
    if (replay == 1) s.assign(size_t(G), 0), s[7] = T - 5;
    copy_tensor(splits, splits_tensor_for(s), stream);
    reset();
    graph.launch();
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<Tensor> replayed;
    for (const Tensor* t : outputs_of(b.out)) replayed.push_back(test::to_host(*t));
    reset();
    step();
    CUDA_OK(cudaStreamSynchronize(stream));
    const auto eager = outputs_of(b.out);
    for (size_t i = 0; i < eager.size(); ++i)
      EXPECT_TRUE(bitwise_equal(test::to_host(*eager[i]), replayed[i])) << "output " << i;
    EXPECT_NO_THROW(flag.check(stream));
    // The accumulated gradient minus its start is the step's gradient: check it with the rest.
    Fp8MlpRun got = to_host(b.out);
    for (auto [grad, start] : {std::pair{&got.dw1, &start_w1}, {&got.dw2, &start_w2}}) {
      Tensor diff = Tensor::empty(grad->shape(), DType::kFloat32);
      const float* g = static_cast<const float*>(grad->data());
      const float* s0 = static_cast<const float*>(start->data());
      float* d = static_cast<float*>(diff.data());
      for (int64_t i = 0; i < grad->numel(); ++i) d[i] = g[i] - s0[i];
      *grad = diff;
    }
    const Routing r(s, T);
    expect_fp8_mlp_matches_oracle(c, r, got);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace moe::test
