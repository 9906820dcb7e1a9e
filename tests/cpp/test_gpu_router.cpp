// The router on CUDA (label "gpu") against the CPU backend on the same inputs: bit for bit the
// logits where both sum exactly (inputs whose products and sums are exact in float32), and the SIMT
// kernels' logits for any 16-bit inputs (the CPU's order); the logits of the grouped GEMM (Hopper)
// within float32 summation error of the float64 product, and the choices, probabilities and counts
// the CPU's bits given those logits; the losses and the gradients within float32 rounding. E = 8,
// 64, 256, odd counts (5, 12, 60, 200) and the limits (512 experts, topk 32); T = 0, 1, 3 and sizes
// that are multiples of nothing; both score functions, expert bias, group-limited routing; rows past
// every output untouched; CUDA-graph replay with new inputs, bit-identical to eager runs; the
// expert-bias update. Skips without a GPU.
#include <cuda_runtime_api.h>

#include <cstring>
#include <tuple>

#include "gpu_support.hpp"
#include "router_support.hpp"

namespace moe::test {
namespace {

RouterSpec router_spec(RouterScore score, int64_t topk, int64_t groups, int64_t topk_groups,
                       bool norm, float scaling) {
  RouterSpec s;
  s.score = score;
  s.topk = topk;
  s.num_groups = groups;
  s.topk_groups = topk_groups;
  s.norm_topk_prob = norm;
  s.scaling_factor = scaling;
  s.aux_loss_coeff = 0.01f;
  s.z_loss_coeff = 0.001f;
  return s;
}

// Plain softmax top-2; softmax with groups, unnormalized; DeepSeek-V3's sigmoid routing.
std::vector<RouterSpec> specs_for(int64_t E) {
  return {router_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f),
          router_spec(RouterScore::kSoftmax, std::min<int64_t>(6, E / 2), 4, 2, false, 1.f),
          router_spec(RouterScore::kSigmoid, std::min<int64_t>(8, E / 2), 8, 4, true, 2.5f)};
}

// Inputs on the host: values whose logits are exact in any order of summation (dyadic_tensor), or
// with exact = false normal 16-bit values.
struct Inputs {
  Tensor x, w, bias;
  Inputs(Rng& rng, int64_t T, int64_t H, int64_t E, DType dt, bool exact = true) {
    if (exact || dt == DType::kFloat32) {
      x = dyadic_tensor({T, H}, dt, rng, 0.25);
      w = dyadic_tensor({E, H}, dt, rng, 0.125);
    } else {
      x = random_tensor({T, H}, dt, rng);
      w = random_tensor({E, H}, dt, rng, 1.0 / std::sqrt(double(H)));
    }
    bias = random_tensor({E}, DType::kFloat32, rng, 0.05);
  }
};

// The choices, probabilities and counts bit for bit, the losses within float32 rounding.
void expect_same_choices(const RouterRun& gpu, const RouterRun& cpu) {
  EXPECT_EQ(gpu.host_indices(), cpu.host_indices());
  EXPECT_TRUE(bitwise_equal(gpu.probs.values(), cpu.probs.values())) << "probs";
  EXPECT_EQ(RouterRun::int64s(gpu.counts), RouterRun::int64s(cpu.counts));
  EXPECT_EQ(RouterRun::int64s(gpu.aux_counts), RouterRun::int64s(cpu.aux_counts));
  for (const auto& [name, g, c] : {std::tuple{"aux_loss", &gpu.aux_loss, &cpu.aux_loss},
                                   std::tuple{"z_loss", &gpu.z_loss, &cpu.z_loss}}) {
    // Sums of T terms in float32, in another order on each backend.
    const double want = scalar_value(c->view), got = scalar_value(g->view);
    EXPECT_NEAR(got, want, 1e-4 * std::abs(want)) << name;
  }
}

void expect_same_forward(const RouterRun& gpu, const RouterRun& cpu) {
  EXPECT_TRUE(gpu.tails_untouched()) << "an output was written past its end";
  EXPECT_TRUE(bitwise_equal(gpu.logits.values(), cpu.logits.values())) << "logits";
  expect_same_choices(gpu, cpu);
}

// dL/dlogits of a router run, on the host: the CPU router's dx for its logits and choices with an
// identity weight (the GPU's backward kernel computes the same function in the same order).
Tensor d_logits_of(const RouterRun& run, const RouterOutputGrads& d_out_on_host, const RouterSpec& spec) {
  const Tensor logits = run.logits.values();
  const int64_t T = logits.size(0), E = logits.size(1);
  Tensor identity = Tensor::zeros({E, E}, DType::kFloat32), dl = Tensor::zeros({T, E}, DType::kFloat32);
  for (int64_t e = 0; e < E; ++e) identity.data_as<float>()[e * E + e] = 1.f;
  const Tensor ws = workspace_tensor(router_backward_workspace_size(T, E, E, DType::kFloat32), Device::cpu());
  router_backward(d_out_on_host, Tensor::zeros({T, E}, DType::kFloat32), identity, logits, run.indices.values(),
                  run.aux_counts.values(), {dl, {}}, spec, {nullptr, workspace_of(ws, Device::cpu())});
  return dl;
}

class GpuRouter : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_F(GpuRouter, ForwardIsTheCpusBitsForEveryShapeAndSpec) {
  Rng rng;
  const int64_t H = 72;
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
    for (int64_t E : {8, 64, 256})
      for (int64_t T : {0, 1, 3, 1000, 4099}) {
        const Inputs in(rng, T, H, E, dt);
        const Tensor xd = to_gpu(in.x), wd = to_gpu(in.w), bd = to_gpu(in.bias);
        for (const RouterSpec& spec : specs_for(E))
          for (bool with_bias : {false, true}) {
            const DType index_dtype = with_bias ? DType::kInt32 : DType::kInt64;
            SCOPED_TRACE(std::string(dtype_name(dt)) + ", E = " + std::to_string(E) + ", T = " +
                         std::to_string(T) + ", " + describe(spec) + (with_bias ? ", bias" : ""));
            const RouterRun cpu = run_router_forward(
                in.x, in.w, with_bias ? TensorView(in.bias) : TensorView(), spec, index_dtype);
            // Contiguous logits (the grouped GEMM's on Hopper) and logits rows an odd number of
            // floats apart (the SIMT kernels').
            for (int64_t extra_cols : {0, 1}) {
              const RouterRun gpu = run_router_forward(xd, wd, with_bias ? TensorView(bd) : TensorView(), spec,
                                                       index_dtype, true, nullptr, extra_cols);
              expect_same_forward(gpu, cpu);
            }
          }
      }
}

// The 16-bit SIMT kernels' edges (router_linear_16bit.cu; logits rows an odd number of floats
// apart keep the grouped GEMM out of the logits on Hopper, and float16 out of the backward): hidden sizes of many pipeline stages with a partial
// last one, expert counts that fill no 8-expert chunk or power-of-2 chunk count, token counts that
// fill no block, the 256-expert limit of the logits kernel, every schedule of the logits kernel, and
// a hidden size that is no multiple of 8 (the generic kernel). Normal inputs: logits the CPU's bits;
// gradients within float32 rounding, written and accumulated into a float32 main_grad.
TEST_F(GpuRouter, SixteenBitProductsAtLongHiddenSizesAndOddExpertCounts) {
  Rng rng;
  // The last three take the logits schedules of 8 experts x 4 tokens and 2 x 2 a thread
  // (logits_config); the others 2 x 1.
  for (const auto& [T, H, E] : {std::tuple<int64_t, int64_t, int64_t>{777, 1000, 60}, {4097, 2048, 8},
                                {300, 136, 200}, {129, 264, 256}, {50, 70, 12}, {1, 3000, 5},
                                {8500, 136, 128}, {3001, 1000, 90}, {2001, 264, 70}})
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + ", T = " + std::to_string(T) + ", H = " + std::to_string(H) +
                   ", E = " + std::to_string(E));
      const Inputs in(rng, T, H, E, dt, /*exact=*/false);
      const Tensor xd = to_gpu(in.x), wd = to_gpu(in.w), bd = to_gpu(in.bias);
      const RouterSpec spec = router_spec(RouterScore::kSoftmax, std::min<int64_t>(4, E), 1, 1, true, 1.f);
      const RouterRun cpu = run_router_forward(in.x, in.w, in.bias, spec);
      const RouterRun gpu = run_router_forward(xd, wd, bd, spec, DType::kInt64, true, nullptr, /*extra_cols=*/1);
      expect_same_forward(gpu, cpu);
      const Tensor g = random_tensor({T, spec.topk}, DType::kFloat32, rng);
      const Tensor a = scalar_tensor(30, DType::kFloat32), z = scalar_tensor(-20, DType::kFloat32);
      const RouterBackwardRun bc = run_router_backward({g, a, z}, in.x, in.w, cpu, spec, DType::kFloat32);
      const RouterBackwardRun bg =
          run_router_backward({to_gpu(g), to_gpu(a), to_gpu(z)}, xd, wd, gpu, spec, DType::kFloat32);
      EXPECT_TRUE(bg.dx.tail_untouched());
      EXPECT_TRUE(bg.dweight.tail_untouched());
      EXPECT_LE(oracle::rel_error(oracle::to_matrix(bg.dx.values()), oracle::to_matrix(bc.dx.values())),
                tolerance(dt))
          << "dx";
      EXPECT_LE(oracle::rel_error(oracle::to_matrix(bg.dweight.values()), oracle::to_matrix(bc.dweight.values())),
                1e-5)
          << "dweight";
      const Tensor start = random_tensor({E, H}, DType::kFloat32, rng);
      const Tensor main_grad = to_gpu(start);
      const Tensor ws = workspace_tensor(router_backward_workspace_size(T, E, H, dt), Device::cuda(0));
      router_backward({to_gpu(g), {}, {}}, xd, wd, gpu.logits.view, gpu.indices.view, gpu.aux_counts.view,
                      {{}, main_grad, GradMode::kAccumulate}, spec, {nullptr, workspace_of(ws, Device::cuda(0))});
      const RouterBackwardRun probs_only = run_router_backward({g, {}, {}}, in.x, in.w, cpu, spec, DType::kFloat32);
      oracle::Matrix want = oracle::to_matrix(probs_only.dweight.values());
      for (size_t i = 0; i < want.data.size(); ++i) want.data[i] += start.data_as<float>()[i];
      EXPECT_LE(oracle::rel_error(oracle::to_matrix(to_host(main_grad)), want), 1e-5) << "main_grad accumulate";
    }
}

// The largest shapes the kernels take: 512 experts (16 per lane), 32 choices (one per lane).
TEST_F(GpuRouter, LargestExpertCountAndTopk) {
  Rng rng;
  const int64_t T = 301, H = 40, E = 512;
  const Inputs in(rng, T, H, E, DType::kBFloat16);
  for (const RouterSpec& spec : {router_spec(RouterScore::kSoftmax, 32, 1, 1, true, 1.f),
                                 router_spec(RouterScore::kSigmoid, 32, 16, 4, true, 2.5f),
                                 router_spec(RouterScore::kSigmoid, 8, 512, 64, false, 1.f)}) {
    SCOPED_TRACE(describe(spec));
    const RouterRun cpu = run_router_forward(in.x, in.w, in.bias, spec);
    const RouterRun gpu = run_router_forward(to_gpu(in.x), to_gpu(in.w), to_gpu(in.bias), spec);
    expect_same_forward(gpu, cpu);
  }
}

// The logits on the grouped GEMM (Hopper; elsewhere the SIMT kernels, which pass the same checks)
// for normal 16-bit inputs at the suite's hidden sizes: within float32 summation error of the
// float64 product (every product is exact, the sums run in the tensor cores' order), and the
// choices, probabilities, counts and losses the CPU's given those logits (the CPU router run on
// them as x with an identity weight, whose logits are x's bits).
TEST_F(GpuRouter, LogitsOfTheGroupedGemmAndTheChoicesTheyGive) {
  Rng rng;
  for (const auto& [T, H, E] : {std::tuple<int64_t, int64_t, int64_t>{4099, 7168, 256}, {1000, 2048, 128},
                                {1, 64, 8}, {777, 1000, 60}, {3, 4096, 8}, {8192, 4096, 64}})
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + ", T = " + std::to_string(T) + ", H = " + std::to_string(H) +
                   ", E = " + std::to_string(E));
      const Inputs in(rng, T, H, E, dt, /*exact=*/false);
      const RouterSpec spec = router_spec(RouterScore::kSigmoid, std::min<int64_t>(8, E / 2), 4, 2, true, 2.5f);
      const RouterRun gpu = run_router_forward(to_gpu(in.x), to_gpu(in.w), to_gpu(in.bias), spec);
      EXPECT_TRUE(gpu.tails_untouched()) << "an output was written past its end";
      const Tensor logits = gpu.logits.values();
      const oracle::Matrix x = oracle::to_matrix(in.x), w = oracle::to_matrix(in.w);
      double worst = 0;
      const int64_t step = std::max<int64_t>(1, T / 512);  // the float64 product of up to 512 tokens
      for (int64_t t = 0; t < T; t += step)
        for (int64_t e = 0; e < E; ++e) {
          double exact = 0, magnitude = 0;
          for (int64_t h = 0; h < H; ++h) {
            const double p = x.data[size_t(t * H + h)] * w.data[size_t(e * H + h)];
            exact += p;
            magnitude += std::abs(p);
          }
          const double got = logits.data_as<float>()[t * E + e];
          worst = std::max(worst, std::abs(got - exact) / std::max(magnitude, 1e-30));
        }
      // float32 sums of H exact products: a few 2^-24 of sum |x w| (one rounding to 16 bits anywhere
      // would be ~2^-9).
      EXPECT_LE(worst, 4e-6) << "logits";
      Tensor identity = Tensor::zeros({E, E}, DType::kFloat32);
      for (int64_t e = 0; e < E; ++e) identity.data_as<float>()[e * E + e] = 1.f;
      const RouterRun cpu = run_router_forward(logits, identity, in.bias, spec);
      EXPECT_TRUE(bitwise_equal(cpu.logits.values(), logits)) << "the CPU's logits of x I^T are x";
      expect_same_choices(gpu, cpu);
    }
}

// The backward's products on the grouped GEMM (Hopper, bfloat16: d_logits split exactly into three
// bfloat16 parts; float16 takes the SIMT kernels, which pass the same checks) at the suite's hidden
// sizes, expert counts with 3E no multiple of 8, and token counts that take one or many token
// slices: dx within float32 summation error of the float64 product of the same d_logits (then one
// rounding to 16 bits), also added into a start (accumulate_dx), and the weight gradient within
// float32 summation error; a bfloat16 weight gradient is the float32 one rounded. The d_logits come from the CPU router run on the GPU's
// logits with an identity weight (its dx is then d_logits).
TEST_F(GpuRouter, BackwardProductsWithinFloat32SummationError) {
  Rng rng;
  for (const auto& [T, H, E] : {std::tuple<int64_t, int64_t, int64_t>{4099, 7168, 256}, {1000, 2048, 128},
                                {8192, 4096, 8}, {1, 64, 8}, {777, 1000, 60}, {3, 4096, 8}, {2000, 7168, 5}})
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + ", T = " + std::to_string(T) + ", H = " + std::to_string(H) +
                   ", E = " + std::to_string(E));
      const Inputs in(rng, T, H, E, dt, /*exact=*/false);
      const RouterSpec spec = router_spec(RouterScore::kSigmoid, std::min<int64_t>(4, E / 2), 1, 1, true, 2.5f);
      const Tensor xd = to_gpu(in.x), wd = to_gpu(in.w);
      const RouterRun gpu = run_router_forward(xd, wd, to_gpu(in.bias), spec);
      const Tensor g = random_tensor({T, spec.topk}, DType::kFloat32, rng);
      const Tensor a = scalar_tensor(30, DType::kFloat32), z = scalar_tensor(-20, DType::kFloat32);
      const Tensor gd = to_gpu(g), ad = to_gpu(a), zd = to_gpu(z);
      const RouterOutputGrads d_out{gd, ad, zd};
      const RouterBackwardRun bg = run_router_backward(d_out, xd, wd, gpu, spec, DType::kFloat32);
      EXPECT_TRUE(bg.dx.tail_untouched());
      EXPECT_TRUE(bg.dweight.tail_untouched());
      const RouterBackwardRun rounded = run_router_backward(d_out, xd, wd, gpu, spec, DType::kBFloat16);
      Tensor want_rounded = Tensor::empty({E, H}, DType::kBFloat16);
      oracle::assign(want_rounded, oracle::to_matrix(bg.dweight.values()).data);
      EXPECT_TRUE(bitwise_equal(rounded.dweight.values(), want_rounded))
          << "a bfloat16 weight gradient is the float32 one rounded";

      // accumulate_dx (the C++ layer's): added into a start.
      const Tensor start = random_tensor({T, H}, dt, rng), added = to_gpu(start);
      const Tensor ws = workspace_tensor(router_backward_workspace_size(T, E, H, dt), Device::cuda(0));
      router_backward(d_out, xd, wd, gpu.logits.view, gpu.indices.view, gpu.aux_counts.view,
                      {added, {}, GradMode::kWrite, /*accumulate_dx=*/true}, spec,
                      {nullptr, workspace_of(ws, Device::cuda(0))});

      const Tensor dl = d_logits_of(gpu, {g, a, z}, spec);
      const oracle::Matrix x = oracle::to_matrix(in.x), w = oracle::to_matrix(in.w);
      const oracle::Matrix dx = oracle::to_matrix(bg.dx.values()), dw = oracle::to_matrix(bg.dweight.values());
      const oracle::Matrix dx0 = oracle::to_matrix(start), dx_added = oracle::to_matrix(to_host(added));
      const float* d = dl.data_as<float>();
      double worst_dx = 0, worst_added = 0, worst_dw = 0;
      const int64_t t_step = std::max<int64_t>(1, T / 48), h_step = std::max<int64_t>(1, H / 24);
      for (int64_t t = 0; t < T; t += t_step)
        for (int64_t h = 0; h < H; ++h) {
          double exact = 0, magnitude = 0;
          for (int64_t e = 0; e < E; ++e) {
            const double p = double(d[t * E + e]) * w.data[size_t(e * H + h)];
            exact += p;
            magnitude += std::abs(p);
          }
          // One rounding to 16 bits on top: half an ulp, 2^-8 of the value for bfloat16, 2^-11 for
          // float16 (2^-25 in its subnormal range).
          auto rounding = [&](double v) {
            return dt == DType::kBFloat16 ? std::ldexp(std::abs(v), -8) * 1.001
                                          : std::max(std::ldexp(std::abs(v), -11) * 1.001, std::ldexp(1.0, -25));
          };
          const size_t i = size_t(t * H + h);
          const double error = std::max(0.0, std::abs(dx.data[i] - exact) - rounding(exact));
          worst_dx = std::max(worst_dx, error / std::max(magnitude, 1e-30));
          // Added: at most two roundings (the grouped GEMM rounds the product, then the sum).
          const double sum = dx0.data[i] + exact;
          const double added_error =
              std::max(0.0, std::abs(dx_added.data[i] - sum) - rounding(exact) - rounding(sum));
          worst_added = std::max(worst_added, added_error / std::max(magnitude, 1e-30));
        }
      for (int64_t e = 0; e < E; ++e)
        for (int64_t h = 0; h < H; h += h_step) {
          double exact = 0, magnitude = 0;
          for (int64_t t = 0; t < T; ++t) {
            const double p = double(d[t * E + e]) * x.data[size_t(t * H + h)];
            exact += p;
            magnitude += std::abs(p);
          }
          worst_dw = std::max(worst_dw, std::abs(dw.data[size_t(e * H + h)] - exact) / std::max(magnitude, 1e-30));
        }
      // float32 sums of exact products: a few 2^-24 of sum |d w| (one rounding of d_logits to
      // bfloat16 would be ~2^-9). The tensor cores' float32 accumulation truncates, which adds up
      // over the weight gradient's long sums: measured on an H200 ~2^-24 of the magnitude per 16
      // tokens (1e-5 at T = 4099, E = 256); the bound allows 2^-23.
      EXPECT_LE(worst_dx, 2e-6) << "dx";
      EXPECT_LE(worst_added, 2e-6) << "dx added into a start (accumulate_dx)";
      EXPECT_LE(worst_dw, std::max(2e-6, std::ldexp(double(T) / 16, -23))) << "dweight";
    }
}

// The split of d_logits is exact: with one-hot tokens (x[t, t] = 1) each weight gradient dW[e, t] is
// the one product d_logits[t, e] * 1, which the grouped GEMM (three bfloat16 parts, added in
// float32) and the SIMT kernels (float16) both give bit for bit; columns past T are zeros. (No
// z-loss: its logarithm is each platform's, so its d_logits may differ from the CPU's in last bits.)
TEST_F(GpuRouter, WeightGradientOfOneHotTokensIsDLogitsBitForBit) {
  Rng rng;
  const int64_t T = 300, H = 304, E = 60;
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Inputs in(rng, T, H, E, dt, /*exact=*/false);
    oracle::Vector one_hot(size_t(T * H), 0.0);
    for (int64_t t = 0; t < T; ++t) one_hot[size_t(t * H + t)] = 1.0;
    Tensor x = Tensor::empty({T, H}, dt);
    oracle::assign(x, one_hot);
    const RouterSpec spec = router_spec(RouterScore::kSoftmax, 4, 1, 1, true, 1.f);
    const Tensor xd = to_gpu(x), wd = to_gpu(in.w);
    const RouterRun gpu = run_router_forward(xd, wd, to_gpu(in.bias), spec);
    const Tensor g = random_tensor({T, spec.topk}, DType::kFloat32, rng);
    const Tensor a = scalar_tensor(30, DType::kFloat32);
    const Tensor gd = to_gpu(g), ad = to_gpu(a);
    const RouterBackwardRun bg = run_router_backward({gd, ad, {}}, xd, wd, gpu, spec, DType::kFloat32);
    const Tensor dl = d_logits_of(gpu, {g, a, {}}, spec), dw = bg.dweight.values();
    int64_t differing = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t h = 0; h < H; ++h) {
        const float want = h < T ? dl.data_as<float>()[h * E + e] : 0.f;
        differing += std::memcmp(&want, dw.data_as<float>() + e * H + h, sizeof(float)) != 0;
      }
    EXPECT_EQ(differing, 0) << "of " << E * H << " weight gradients";
  }
}

TEST_F(GpuRouter, BackwardMatchesTheCpuInEveryGradientMode) {
  Rng rng;
  const int64_t H = 72;
  for (DType dt : {DType::kBFloat16, DType::kFloat32})
    for (int64_t E : {8, 256})
      for (int64_t T : {0, 3, 1000}) {
        const Inputs in(rng, T, H, E, dt);
        const Tensor xd = to_gpu(in.x), wd = to_gpu(in.w), bd = to_gpu(in.bias);
        for (const RouterSpec& spec : specs_for(E)) {
          SCOPED_TRACE(std::string(dtype_name(dt)) + ", E = " + std::to_string(E) +
                       ", T = " + std::to_string(T) + ", " + describe(spec));
          const RouterRun fc = run_router_forward(in.x, in.w, in.bias, spec);
          const RouterRun fg = run_router_forward(xd, wd, bd, spec);
          const Tensor g = random_tensor({T, spec.topk}, DType::kFloat32, rng);
          const Tensor a = scalar_tensor(30, DType::kFloat32),
                       z = scalar_tensor(-20, DType::kFloat32);
          const Tensor gd = to_gpu(g), ad = to_gpu(a), zd = to_gpu(z);
          const RouterBackwardRun bc =
              run_router_backward({g, a, z}, in.x, in.w, fc, spec, DType::kFloat32);
          const RouterBackwardRun bg =
              run_router_backward({gd, ad, zd}, xd, wd, fg, spec, DType::kFloat32);
          EXPECT_TRUE(bg.dx.tail_untouched());
          EXPECT_TRUE(bg.dweight.tail_untouched());
          if (T == 0) continue;
          EXPECT_LE(oracle::rel_error(oracle::to_matrix(bg.dx.values()),
                                      oracle::to_matrix(bc.dx.values())),
                    std::max(tolerance(dt), 1e-5))
              << "dx";
          const oracle::Matrix dw = oracle::to_matrix(bc.dweight.values());
          EXPECT_LE(oracle::rel_error(oracle::to_matrix(bg.dweight.values()), dw), 1e-5)
              << "dweight";
          // Into a float32 main_grad: added, or written over it.
          const Tensor start = random_tensor({E, H}, DType::kFloat32, rng);
          for (GradMode mode : {GradMode::kAccumulate, GradMode::kOverwrite}) {
            const Tensor main_grad = to_gpu(start);
            const Tensor ws =
                workspace_tensor(router_backward_workspace_size(T, E, H, dt), Device::cuda(0));
            router_backward({gd, {}, {}}, xd, wd, fg.logits.view, fg.indices.view,
                            fg.aux_counts.view, {{}, main_grad, mode}, spec,
                            {nullptr, workspace_of(ws, Device::cuda(0))});
            const RouterBackwardRun probs_only =
                run_router_backward({g, {}, {}}, in.x, in.w, fc, spec, DType::kFloat32);
            oracle::Matrix want = oracle::to_matrix(probs_only.dweight.values());
            if (mode == GradMode::kAccumulate)
              for (size_t i = 0; i < want.data.size(); ++i)
                want.data[i] += start.data_as<float>()[i];
            EXPECT_LE(oracle::rel_error(oracle::to_matrix(to_host(main_grad)), want), 1e-5)
                << grad_mode_name(mode);
          }
        }
      }
  // No tokens: a main_grad is left as it was, bit for bit; a written dweight is zeros.
  const Inputs in(rng, 0, 16, 8, DType::kBFloat16);
  const RouterSpec spec = specs_for(8)[0];
  const Tensor xd = to_gpu(in.x), wd = to_gpu(in.w);
  const RouterRun f = run_router_forward(xd, wd, {}, spec);
  const Tensor start = random_tensor({8, 16}, DType::kFloat32, rng), main_grad = to_gpu(start);
  const Tensor g = Tensor::empty({0, spec.topk}, DType::kFloat32, Device::cuda(0));
  router_backward({g, {}, {}}, xd, wd, f.logits.view, f.indices.view, {},
                  {{}, main_grad, GradMode::kAccumulate}, spec, {});
  EXPECT_TRUE(bitwise_equal(to_host(main_grad), start));
  const RouterBackwardRun written =
      run_router_backward({g, {}, {}}, xd, wd, f, spec, DType::kBFloat16);
  for (double v : oracle::to_matrix(written.dweight.values()).data) EXPECT_EQ(v, 0.0);
}

// Forward and backward captured once, replayed with new inputs written into the same buffers:
// the bits of eager runs on those inputs.
TEST_F(GpuRouter, GraphReplayWithNewInputsMatchesEagerRuns) {
  Rng rng;
  const int64_t T = 777, H = 64, E = 64;
  const RouterSpec spec = router_spec(RouterScore::kSigmoid, 6, 8, 4, true, 2.5f);
  const Device gpu = Device::cuda(0);
  const Inputs first(rng, T, H, E, DType::kBFloat16), second(rng, T, H, E, DType::kBFloat16);
  const Tensor x = to_gpu(first.x), w = to_gpu(first.w), bias = to_gpu(first.bias);
  const Tensor g = to_gpu(random_tensor({T, spec.topk}, DType::kFloat32, rng));
  const Tensor a = scalar_tensor(3, DType::kFloat32, gpu),
               z = scalar_tensor(-2, DType::kFloat32, gpu);
  RouterRun out;
  out.logits = Padded({T, E}, DType::kFloat32, gpu);
  out.indices = Padded({T, spec.topk}, DType::kInt32, gpu);
  out.probs = Padded({T, spec.topk}, DType::kFloat32, gpu);
  out.counts = Padded({E}, DType::kInt64, gpu);
  out.aux_loss = Padded({}, DType::kFloat32, gpu);
  out.aux_counts = Padded({E}, DType::kInt64, gpu);
  out.z_loss = Padded({}, DType::kFloat32, gpu);
  const Padded dx({T, H}, DType::kBFloat16, gpu), dweight({E, H}, DType::kFloat32, gpu);
  const Tensor fws = workspace_tensor(router_forward_workspace_size(T, E), gpu);
  const Tensor bws = workspace_tensor(router_backward_workspace_size(T, E, H, DType::kBFloat16), gpu);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto step = [&] {
    router_forward(x, w, bias, out.outputs(), spec, {stream, workspace_of(fws, gpu)});
    router_backward({g, a, z}, x, w, out.logits.view, out.indices.view, out.aux_counts.view,
                    {dx.view, dweight.view}, spec, {stream, workspace_of(bws, gpu)});
  };
  auto snapshot = [&] {
    return std::vector<Tensor>{out.logits.host(), out.indices.host(),  out.probs.host(),
                               out.counts.host(), out.aux_loss.host(), out.aux_counts.host(),
                               out.z_loss.host(), dx.host(),           dweight.host()};
  };
  std::vector<std::vector<Tensor>> eager;
  for (const Inputs* in : {&first, &second}) {
    copy_tensor(x, in->x);
    copy_tensor(w, in->w);
    copy_tensor(bias, in->bias);
    step();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    eager.push_back(snapshot());
  }
  CapturedGraph graph(stream, step);
  for (int replay = 0; replay < 4; ++replay) {
    const Inputs* in = replay % 2 == 0 ? &first : &second;
    copy_tensor(x, in->x);
    copy_tensor(w, in->w);
    copy_tensor(bias, in->bias);
    synchronize(nullptr);
    graph.launch();
    const std::vector<Tensor> got = snapshot();
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(bitwise_equal(got[i], eager[size_t(replay % 2)][i]))
          << "replay " << replay << ", output " << i;
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// counts_total, total_loss and accumulate_dx: the CPU's counts, its loss within float32 rounding,
// and dx added into its start within rounding (the CPU and the SIMT kernels round the sum once, the
// grouped GEMM the product and then the sum).
TEST_F(GpuRouter, AccumulatingOutputsMatchTheCpu) {
  Rng rng;
  const int64_t T = 300, H = 40, E = 24, k = 3;
  const RouterSpec spec = router_spec(RouterScore::kSigmoid, k, 4, 2, true, 2.5f);
  const Inputs in(rng, T, H, E, DType::kBFloat16);
  const Tensor g = random_tensor({T, k}, DType::kFloat32, rng), start = random_tensor({T, H}, DType::kBFloat16, rng);
  const RouterAccumulation cpu = run_router_accumulation(in.x, in.w, g, start, spec, Device::cpu());
  const RouterAccumulation gpu = run_router_accumulation(in.x, in.w, g, start, spec, Device::cuda(0));
  EXPECT_TRUE(bitwise_equal(gpu.counts_total, cpu.counts_total));
  EXPECT_NEAR(scalar_value(gpu.total_loss), scalar_value(cpu.total_loss), 1e-4 * std::abs(scalar_value(cpu.total_loss)));
  EXPECT_EQ(scalar_value(gpu.total_loss), double(float(scalar_value(gpu.aux_loss)) + float(scalar_value(gpu.z_loss))));
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(gpu.dx_added), oracle::to_matrix(cpu.dx_added)), 1e-2);
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(gpu.dx_written), oracle::to_matrix(cpu.dx_written)), 1e-2);
}

TEST_F(GpuRouter, ExpertBiasUpdateIsTheCpusBits) {
  Rng rng;
  const int64_t E = 300;
  const Tensor bias = random_tensor({E}, DType::kFloat32, rng, 0.1);
  Tensor counts = Tensor::empty({E}, DType::kInt64);
  for (int64_t e = 0; e < E; ++e)
    counts.data_as<int64_t>()[e] = rng.integer(0, 3) == 0 ? 7 : rng.integer(0, 20);
  Tensor cpu = Tensor::empty({E}, DType::kFloat32);
  copy_tensor(cpu, bias);
  const Tensor gpu = to_gpu(bias);
  router_update_expert_bias(cpu, counts, 0.001f);
  router_update_expert_bias(gpu, to_gpu(counts), 0.001f);
  EXPECT_TRUE(bitwise_equal(to_host(gpu), cpu));
}

TEST_F(GpuRouter, BeyondTheKernelsLimitsIsNotImplemented) {
  Rng rng;
  const Tensor x = to_gpu(random_tensor({4, 8}, DType::kBFloat16, rng));
  EXPECT_MOE_ERROR(run_router_forward(x, to_gpu(random_tensor({513, 8}, DType::kBFloat16, rng)), {},
                                      router_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f)),
                   ErrorCode::kNotImplemented,
                   "router_forward on CUDA: E = 513 experts (at most 512)");
  EXPECT_MOE_ERROR(run_router_forward(x, to_gpu(random_tensor({64, 8}, DType::kBFloat16, rng)), {},
                                      router_spec(RouterScore::kSoftmax, 33, 1, 1, true, 1.f)),
                   ErrorCode::kNotImplemented, "router_forward on CUDA: topk = 33 (at most 32)");
  EXPECT_MOE_ERROR(run_router_forward(to_gpu(random_tensor({4, 8}, DType::kFloat64, rng)),
                                      to_gpu(random_tensor({8, 8}, DType::kFloat64, rng)), {},
                                      router_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f)),
                   ErrorCode::kNotImplemented, "router_forward on CUDA: float64 inputs");
}

}  // namespace
}  // namespace moe::test
