// GPU grouped linear (label "gpu"): every form x output dtype x bias / gradient mode against the
// CPU backend on the same inputs, odd routings, poisoned tails, CUDA-graph replay with new
// routings, determinism and bad splits. Skips, saying why, without a GPU.
#include <cuda_runtime_api.h>

#include <numeric>
#include <thread>

#include "gpu_support.hpp"

namespace moe::test {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

struct Shape3 {
  const char* name;
  std::vector<int64_t> splits;
  int64_t capacity, n, k;
};

// N and K multiples of 8 (TMA alignment), otherwise as odd as possible.
// The pipelines (heuristics.hpp) by rows per expert on average: single_expert,
// long_k_many_tiles and long_groups (>= 256) run their 16-bit wgrads on WideEpilogue, the others on
// DeepRing; fp32 wgrads run on PingPong up to 1024 rows (all but long_groups), DeepRing above;
// forward / dgrad with 16-bit outputs run on PingPong up to 64 rows (empty_and_one_row, g256).
std::vector<Shape3> gpu_cases() {
  Rng rng;
  std::vector<int64_t> many = random_splits(rng, 256, 40);
  std::vector<int64_t> big(8);
  for (auto& v : big) v = rng.integer(0, 700);
  const auto sum = [](const std::vector<int64_t>& v) {
    return std::accumulate(v.begin(), v.end(), int64_t(0));
  };
  return {
      {"single_expert", {300}, 320, 136, 200},
      {"empty_and_one_row", {0, 1, 37, 0, 129}, 180, 64, 64},
      {"one_expert_takes_all", {0, 0, 777, 0}, 800, 520, 264},
      {"g256", many, sum(many) + 13, 96, 128},
      {"long_k_many_tiles", big, sum(big) + 5, 1032, 776},
      {"long_groups", {1500, 0, 1900}, 3410, 136, 72},
  };
}

class GpuGroupedLinear : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

// GPU output vs the CPU backend's on the same inputs, and rows past the routed ones untouched.
void expect_matches(const TensorView& gpu_out, const TensorView& cpu_out, int64_t routed_rows,
                    DType dtype, const char* what) {
  const Tensor got = to_host(gpu_out);
  const double err =
      oracle::rel_error(oracle::to_matrix(got), head(oracle::to_matrix(cpu_out), routed_rows));
  EXPECT_LE(err, tolerance(dtype)) << what << ": rel. error vs the CPU backend " << err;
  EXPECT_TRUE(tail_untouched(got, routed_rows)) << what << ": rows past sum(splits) were written";
}

TEST_P(GpuGroupedLinear, ForwardEveryBiasModeAndOutputDtype) {
  const DType dt = GetParam();
  Rng rng;
  for (const Shape3& c : gpu_cases()) {
    SCOPED_TRACE(c.name);
    DualRouting r(c.splits, c.capacity);
    const int64_t G = r.cpu.num_groups(), T = c.capacity;
    Tensor x = random_tensor({T, c.k}, dt, rng), w = random_tensor({G, c.n, c.k}, dt, rng, 0.1);
    Tensor b = random_tensor({G, c.n}, dt, rng),
           p = uniform_tensor({T}, DType::kFloat32, rng, 0, 1);
    Tensor xd = to_gpu(x), wd = to_gpu(w), bd = to_gpu(b), pd = to_gpu(p);
    for (int mode = 0; mode < 3; ++mode)
      for (DType out : {dt, DType::kFloat32}) {
        SCOPED_TRACE(std::string(mode == 0   ? "no bias"
                                 : mode == 1 ? "bias"
                                             : "scale_bias") +
                     ", out " + dtype_name(out));
        BiasEpilogue cpu_epi, gpu_epi;
        if (mode > 0) {
          cpu_epi.bias = GroupedParam::packed(b);
          gpu_epi.bias = GroupedParam::packed(bd);
        }
        if (mode == 2) {
          cpu_epi.row_scale = p;
          gpu_epi.row_scale = pd;
        }
        Tensor y_cpu = poisoned({T, c.n}, out);
        grouped_linear_forward(x, GroupedParam::packed(w), r.cpu.layout, y_cpu, cpu_epi);
        Tensor y = poisoned_gpu({T, c.n}, out);
        grouped_linear_forward(xd, GroupedParam::packed(wd), r.gpu, y, gpu_epi);
        expect_matches(y, y_cpu, r.cpu.rows(), out, "y");
      }
    EXPECT_NO_THROW(r.flag.check());
  }
}

// An op called on a thread that has made no CUDA call yet (as autograd's backward thread is when
// the routing comes from the forward): the op makes the device's context current itself. Without
// that, the Hopper kernel's tensor-map encoding failed with CUDA_ERROR_INVALID_CONTEXT.
TEST(GpuThreads, AnOpRunsOnAFreshThread) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  Rng rng;
  DualRouting r({40, 0, 300, 7}, 360);
  const int64_t G = r.cpu.num_groups(), T = 360, N = 256, K = 128;
  Tensor xd = to_gpu(random_tensor({T, K}, DType::kBFloat16, rng));
  Tensor wd = to_gpu(random_tensor({G, N, K}, DType::kBFloat16, rng, 0.1));
  Tensor here = poisoned_gpu({T, N}, DType::kBFloat16), there = poisoned_gpu({T, N}, DType::kBFloat16);
  grouped_linear_forward(xd, GroupedParam::packed(wd), r.gpu, here);
  std::string error;
  std::thread worker([&] {
    try {
      grouped_linear_forward(xd, GroupedParam::packed(wd), r.gpu, there);
      synchronize(nullptr);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  worker.join();
  ASSERT_EQ(error, "");
  synchronize(nullptr);
  EXPECT_TRUE(bitwise_equal(to_host(here), to_host(there)));
  EXPECT_NO_THROW(r.flag.check());
}

TEST_P(GpuGroupedLinear, Dgrad) {
  const DType dt = GetParam();
  Rng rng;
  for (const Shape3& c : gpu_cases()) {
    SCOPED_TRACE(c.name);
    DualRouting r(c.splits, c.capacity);
    const int64_t G = r.cpu.num_groups(), T = c.capacity;
    Tensor dy = random_tensor({T, c.n}, dt, rng), w = random_tensor({G, c.n, c.k}, dt, rng, 0.1);
    Tensor dx_cpu = poisoned({T, c.k}, dt);
    grouped_linear_dgrad(dy, GroupedParam::packed(w), r.cpu.layout, dx_cpu);
    Tensor dx = poisoned_gpu({T, c.k}, dt);
    grouped_linear_dgrad(to_gpu(dy), GroupedParam::packed(to_gpu(w)), r.gpu, dx);
    expect_matches(dx, dx_cpu, r.cpu.rows(), dt, "dx");
  }
}

TEST_P(GpuGroupedLinear, WgradWriteAccumulateOverwrite) {
  const DType dt = GetParam();
  Rng rng;
  for (const Shape3& c : gpu_cases()) {
    SCOPED_TRACE(c.name);
    DualRouting r(c.splits, c.capacity);
    const int64_t G = r.cpu.num_groups(), T = c.capacity;
    Tensor dy = random_tensor({T, c.n}, dt, rng), x = random_tensor({T, c.k}, dt, rng);
    Tensor dyd = to_gpu(dy), xd = to_gpu(x);
    const std::pair<GradMode, DType> modes[] = {{GradMode::kWrite, dt},
                                                {GradMode::kWrite, DType::kFloat32},
                                                {GradMode::kAccumulate, DType::kFloat32},
                                                {GradMode::kOverwrite, DType::kFloat32}};
    for (auto [mode, out] : modes) {
      SCOPED_TRACE(std::string(grad_mode_name(mode)) + ", out " + dtype_name(out));
      Tensor start = random_tensor({G, c.n, c.k}, out, rng);
      Tensor cpu = start.to(Device::cpu());
      grouped_linear_wgrad(dy, x, r.cpu.layout, GroupedParam::packed(cpu), mode);
      Tensor gpu = to_gpu(start);
      grouped_linear_wgrad(dyd, xd, r.gpu, GroupedParam::packed(gpu), mode);
      const Tensor got = to_host(gpu);
      const double err = oracle::rel_error(oracle::to_matrix(got.view().reshape({G * c.n, c.k})),
                                           oracle::to_matrix(cpu.view().reshape({G * c.n, c.k})));
      EXPECT_LE(err, tolerance(out)) << "dW rel. error vs the CPU backend " << err;
      // Empty experts: zeros when writing, untouched (bit for bit) when accumulating.
      for (int64_t g = 0; g < G; ++g)
        if (c.splits[size_t(g)] == 0) {
          EXPECT_TRUE(bitwise_equal(got.view().select(g), cpu.view().select(g)))
              << "empty expert " << g;
        }
    }
  }
}

TEST_P(GpuGroupedLinear, DbiasAndDscales) {
  const DType dt = GetParam();
  Rng rng;
  for (const Shape3& c : gpu_cases()) {
    SCOPED_TRACE(c.name);
    DualRouting r(c.splits, c.capacity);
    const int64_t G = r.cpu.num_groups(), T = c.capacity;
    Tensor dy = random_tensor({T, c.n}, dt, rng), b = random_tensor({G, c.n}, dt, rng);
    Tensor p = uniform_tensor({T}, DType::kFloat32, rng, 0, 1);
    for (GradMode mode : {GradMode::kWrite, GradMode::kAccumulate}) {
      Tensor start = random_tensor({G, c.n}, DType::kFloat32, rng);
      Tensor cpu = start.to(Device::cpu()), gpu = to_gpu(start);
      grouped_linear_dbias(dy, r.cpu.layout, GroupedParam::packed(cpu), mode, p);
      grouped_linear_dbias(to_gpu(dy), r.gpu, GroupedParam::packed(gpu), mode, to_gpu(p));
      EXPECT_LE(oracle::rel_error(oracle::to_matrix(to_host(gpu)), oracle::to_matrix(cpu)), 1e-5)
          << "dbias " << grad_mode_name(mode);
    }
    Tensor ds_cpu = poisoned({T}, DType::kFloat32);
    grouped_linear_dscales(dy, GroupedParam::packed(b), r.cpu.layout, ds_cpu);
    Tensor ds = poisoned_gpu({T}, DType::kFloat32);
    grouped_linear_dscales(to_gpu(dy), GroupedParam::packed(to_gpu(b)), r.gpu, ds);
    expect_matches(ds, ds_cpu, r.cpu.rows(), DType::kFloat32, "dscales");
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuGroupedLinear,
                         ::testing::Values(DType::kBFloat16, DType::kFloat16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

class GpuGroupedLinearGraph : public GpuGroupedLinear {};

// Capture offsets + forward + dgrad + wgrad (accumulate) once; replay with five routings; every
// replay equals an eager run bit for bit, and eager runs are deterministic.
TEST_F(GpuGroupedLinearGraph, CapturedOnceReplayedWithNewRoutingsEqualsEager) {
  Rng rng;
  const DType dt = DType::kBFloat16;
  const int64_t G = 16, T = 2048, N = 264, K = 392;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Tensor x = to_gpu(random_tensor({T, K}, dt, rng)),
         w = to_gpu(random_tensor({G, N, K}, dt, rng, 0.1));
  Tensor dy = to_gpu(random_tensor({T, N}, dt, rng));
  Tensor start = to_gpu(random_tensor({G, N, K}, DType::kFloat32, rng));
  Tensor splits = Tensor::empty({G}, DType::kInt64, Device::cuda(0));
  Tensor offsets = Tensor::empty({G + 1}, DType::kInt64, Device::cuda(0));
  Tensor y = poisoned_gpu({T, N}, dt), dx = poisoned_gpu({T, K}, dt), dw = to_gpu(start);
  DeviceErrorFlag flag(Device::cuda(0));
  const ExecContext ctx{stream, {}};
  auto step = [&] {
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag, stream);
    grouped_linear_forward(x, GroupedParam::packed(w), groups, y, {}, ctx);
    grouped_linear_dgrad(dy, GroupedParam::packed(w), groups, dx, ctx);
    grouped_linear_wgrad(dy, x, groups, GroupedParam::packed(dw), GradMode::kAccumulate, ctx);
  };
  auto reset = [&] {
    fill_bytes(y, kPoison, stream);
    fill_bytes(dx, kPoison, stream);
    copy_tensor(dw, start, stream);
  };
  copy_tensor(splits, splits_tensor_for(random_splits(rng, G, 120)), stream);
  step();  // warm-up outside capture (first-launch setup)
  CUDA_OK(cudaStreamSynchronize(stream));
  CapturedGraph graph(stream, step);
  for (int replay = 0; replay < 5; ++replay) {
    SCOPED_TRACE("routing " + std::to_string(replay));
    std::vector<int64_t> s = random_splits_within(rng, G, T);
    if (replay == 2) s.assign(size_t(G), 0), s[5] = T - 3;  // one expert takes (almost) all
    const Tensor host_splits = splits_tensor_for(s);
    copy_tensor(splits, host_splits, stream);
    reset();
    graph.launch();
    const Tensor y1 = to_host(y), dx1 = to_host(dx), dw1 = to_host(dw);
    for (int eager = 0; eager < 2; ++eager) {
      reset();
      step();
      CUDA_OK(cudaStreamSynchronize(stream));
      EXPECT_TRUE(bitwise_equal(to_host(y), y1)) << "forward";
      EXPECT_TRUE(bitwise_equal(to_host(dx), dx1)) << "dgrad";
      EXPECT_TRUE(bitwise_equal(to_host(dw), dw1)) << "wgrad";
    }
    // and the replayed result is right
    Routing cpu_routing(s, T);
    Tensor y_cpu = poisoned({T, N}, dt);
    grouped_linear_forward(to_host(x), GroupedParam::packed(to_host(w)), cpu_routing.layout, y_cpu);
    expect_matches(y, y_cpu, cpu_routing.rows(), dt, "replayed y");
    EXPECT_NO_THROW(flag.check(stream));
  }
  cudaStreamDestroy(stream);
}

// Per-expert weights, biases and float32 main_grad (separate allocations + pointer tables) run
// on the same kernels as packed ones: every output equals the packed run bit for bit, eagerly and
// from a graph captured once (after one eager call) and replayed with new routings.
TEST_F(GpuGroupedLinearGraph, PerExpertTensorsEqualPackedBitForBitAlsoWhenReplayed) {
  Rng rng;
  const DType dt = DType::kBFloat16;
  const int64_t G = 8, T = 1500, N = 200, K = 136;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Tensor x = to_gpu(random_tensor({T, K}, dt, rng)), dy = to_gpu(random_tensor({T, N}, dt, rng));
  Tensor w = to_gpu(random_tensor({G, N, K}, dt, rng, 0.1)), b = to_gpu(random_tensor({G, N}, dt, rng));
  Tensor p = to_gpu(uniform_tensor({T}, DType::kFloat32, rng, 0, 1));
  Tensor start = to_gpu(random_tensor({G, N, K}, DType::kFloat32, rng));
  const PerExpertCopy w_experts(w), b_experts(b), dw_experts(start);
  const GroupedParam &W = w_experts.param, &B = b_experts.param, &dW = dw_experts.param;
  Tensor dw = to_gpu(start);
  Tensor splits = Tensor::empty({G}, DType::kInt64, Device::cuda(0));
  Tensor offsets = Tensor::empty({G + 1}, DType::kInt64, Device::cuda(0));
  DeviceErrorFlag flag(Device::cuda(0));
  struct Out {
    Tensor y, dx;
  } packed_out{poisoned_gpu({T, N}, dt), poisoned_gpu({T, K}, dt)},
      expert_out{poisoned_gpu({T, N}, dt), poisoned_gpu({T, K}, dt)};
  const ExecContext ctx{stream, {}};
  auto step = [&](bool experts) {
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag, stream);
    Out& o = experts ? expert_out : packed_out;
    grouped_linear_forward(x, experts ? W : GroupedParam::packed(w), groups, o.y,
                           {experts ? B : GroupedParam::packed(b), p}, ctx);
    grouped_linear_dgrad(dy, experts ? W : GroupedParam::packed(w), groups, o.dx, ctx);
    grouped_linear_wgrad(dy, x, groups, experts ? dW : GroupedParam::packed(dw), GradMode::kAccumulate, ctx);
  };
  auto reset = [&] {
    for (Out* o : {&packed_out, &expert_out}) fill_bytes(o->y, kPoison, stream), fill_bytes(o->dx, kPoison, stream);
    copy_tensor(dw, start, stream);
    for (int64_t g = 0; g < G; ++g) copy_tensor(dW.expert(g), start.view().select(g), stream);
  };
  auto expect_equal = [&](const char* when) {
    CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_TRUE(bitwise_equal(to_host(expert_out.y), to_host(packed_out.y))) << when << ": forward";
    EXPECT_TRUE(bitwise_equal(to_host(expert_out.dx), to_host(packed_out.dx))) << when << ": dgrad";
    for (int64_t g = 0; g < G; ++g)
      EXPECT_TRUE(bitwise_equal(to_host(dW.expert(g)), to_host(dw.view().select(g)))) << when << ": wgrad " << g;
  };
  copy_tensor(splits, splits_tensor_for({300, 0, 1, 450, 7, 0, 500, 200}), stream);
  reset();
  step(false);
  step(true);  // the eager call that encodes the per-expert maps
  expect_equal("eager");
  CapturedGraph graph(stream, [&] { step(true); });
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE("routing " + std::to_string(replay));
    copy_tensor(splits, splits_tensor_for(random_splits_within(rng, G, T)), stream);
    reset();
    step(false);
    graph.launch();
    expect_equal("replayed");
  }
  EXPECT_NO_THROW(flag.check(stream));
  cudaStreamDestroy(stream);
}

// A per-expert set met for the first time inside a capture is a clear error, not a failed graph.
TEST_F(GpuGroupedLinearGraph, NewPerExpertTensorsDuringCaptureAreAClearError) {
  Rng rng;
  const DType dt = DType::kBFloat16;
  const int64_t G = 3, T = 64, N = 64, K = 64;
  Tensor x = to_gpu(random_tensor({T, K}, dt, rng)), y = poisoned_gpu({T, N}, dt);
  const PerExpertCopy w_experts(random_tensor({G, N, K}, dt, rng));
  const GroupedParam& W = w_experts.param;
  DualRouting r({10, 20, 30}, T);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EXPECT_MOE_ERROR(grouped_linear_forward(x, W, r.gpu, y, {}, {stream, {}}), ErrorCode::kInvalidArgument,
                   "run one eager call with the same tensors first");
  cudaGraph_t g = nullptr;
  cudaStreamEndCapture(stream, &g);
  if (g) cudaGraphDestroy(g);
  cudaGetLastError();
  cudaStreamDestroy(stream);
}

// Bad splits never make a kernel write outside the buffer: offsets are clamped on the device,
// the error is reported, and rows past the clamped end stay poisoned.
TEST_F(GpuGroupedLinearGraph, BadSplitsAreReportedAndNothingIsWrittenOutOfBounds) {
  Rng rng;
  const DType dt = DType::kBFloat16;
  const int64_t G = 6, T = 700, N = 128, K = 64;
  Tensor x = to_gpu(random_tensor({T, K}, dt, rng)),
         w = to_gpu(random_tensor({G, N, K}, dt, rng, 0.1));
  for (const std::vector<int64_t>& s : {std::vector<int64_t>{100, -50, 200, 30, 0, 10},
                                        std::vector<int64_t>{300, 300, 300, 300, 0, 1}}) {
    Tensor splits = to_gpu(splits_tensor_for(s));
    Tensor offsets = Tensor::empty({G + 1}, DType::kInt64, Device::cuda(0));
    DeviceErrorFlag flag(Device::cuda(0));
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag);
    // A buffer with guard rows after T: the op sees only the first T rows.
    Tensor y_big = poisoned_gpu({T + 64, N}, dt);
    grouped_linear_forward(x, GroupedParam::packed(w), groups, y_big.view().slice(0, T));
    const Tensor host_offsets = to_host(offsets);
    const int64_t end = host_offsets.data_as<int64_t>()[G];
    EXPECT_LE(end, T);
    EXPECT_TRUE(tail_untouched(to_host(y_big), end)) << "rows past the clamped end were written";
    EXPECT_MOE_ERROR(flag.check(), ErrorCode::kDeviceReported, "splits");
  }
}

// Shapes the Hopper kernel cannot take (rows not 16-byte multiples) run on the portable kernel.
TEST_P(GpuGroupedLinear, PortableKernelTakesUnalignedShapes) {
  const DType dt = GetParam();
  Rng rng;
  DualRouting r({0, 1, 45, 70, 0, 3}, 130);
  const int64_t G = 6, T = 130, N = 30, K = 12;
  Tensor x = random_tensor({T, K}, dt, rng), w = random_tensor({G, N, K}, dt, rng, 0.3);
  Tensor b = random_tensor({G, N}, dt, rng), p = uniform_tensor({T}, DType::kFloat32, rng, 0, 1);
  Tensor dy = random_tensor({T, N}, dt, rng);
  Tensor y_cpu = poisoned({T, N}, dt), dx_cpu = poisoned({T, K}, dt);
  grouped_linear_forward(x, GroupedParam::packed(w), r.cpu.layout, y_cpu,
                         {GroupedParam::packed(b), p});
  grouped_linear_dgrad(dy, GroupedParam::packed(w), r.cpu.layout, dx_cpu);
  Tensor y = poisoned_gpu({T, N}, dt), dx = poisoned_gpu({T, K}, dt);
  grouped_linear_forward(to_gpu(x), GroupedParam::packed(to_gpu(w)), r.gpu, y,
                         {GroupedParam::packed(to_gpu(b)), to_gpu(p)});
  grouped_linear_dgrad(to_gpu(dy), GroupedParam::packed(to_gpu(w)), r.gpu, dx);
  expect_matches(y, y_cpu, r.cpu.rows(), dt, "y");
  expect_matches(dx, dx_cpu, r.cpu.rows(), dt, "dx");
  for (GradMode mode : {GradMode::kWrite, GradMode::kAccumulate, GradMode::kOverwrite}) {
    Tensor start = random_tensor({G, N, K}, DType::kFloat32, rng);
    Tensor cpu = start.to(Device::cpu()), gpu = to_gpu(start);
    grouped_linear_wgrad(dy, x, r.cpu.layout, GroupedParam::packed(cpu), mode);
    grouped_linear_wgrad(to_gpu(dy), to_gpu(x), r.gpu, GroupedParam::packed(gpu), mode);
    const Tensor got = to_host(gpu);
    EXPECT_LE(oracle::rel_error(oracle::to_matrices(GroupedParam::packed(got)),
                                oracle::to_matrices(GroupedParam::packed(cpu))),
              2e-5)
        << grad_mode_name(mode);
    for (int64_t g : {0, 4})  // empty experts: zeros, or untouched when accumulating
      EXPECT_TRUE(bitwise_equal(got.view().select(g), cpu.view().select(g)))
          << grad_mode_name(mode);
  }
}

// Per-expert weights, biases and gradients through device pointer tables.
TEST_P(GpuGroupedLinear, PerExpertTensorsThroughPointerTables) {
  const DType dt = GetParam();
  Rng rng;
  DualRouting r({40, 0, 1, 90}, 140);
  const int64_t G = 4, T = 140, N = 72, K = 48;
  Tensor x = random_tensor({T, K}, dt, rng), w = random_tensor({G, N, K}, dt, rng, 0.2);
  Tensor b = random_tensor({G, N}, dt, rng), dy = random_tensor({T, N}, dt, rng);
  const PerExpertCopy w_experts(w), b_experts(b);
  const GroupedParam &W = w_experts.param, &B = b_experts.param;
  Tensor y_cpu = poisoned({T, N}, dt), dx_cpu = poisoned({T, K}, dt);
  grouped_linear_forward(x, GroupedParam::packed(w), r.cpu.layout, y_cpu,
                         {GroupedParam::packed(b), {}});
  grouped_linear_dgrad(dy, GroupedParam::packed(w), r.cpu.layout, dx_cpu);
  Tensor y = poisoned_gpu({T, N}, dt), dx = poisoned_gpu({T, K}, dt);
  grouped_linear_forward(to_gpu(x), W, r.gpu, y, {B, {}});
  grouped_linear_dgrad(to_gpu(dy), W, r.gpu, dx);
  expect_matches(y, y_cpu, r.cpu.rows(), dt, "y");
  expect_matches(dx, dx_cpu, r.cpu.rows(), dt, "dx");
  Tensor dw_cpu = Tensor::zeros({G, N, K}, DType::kFloat32),
         db_cpu = Tensor::zeros({G, N}, DType::kFloat32);
  grouped_linear_wgrad(dy, x, r.cpu.layout, GroupedParam::packed(dw_cpu), GradMode::kWrite);
  grouped_linear_dbias(dy, r.cpu.layout, GroupedParam::packed(db_cpu), GradMode::kWrite);
  const PerExpertCopy dw_experts(Tensor::zeros({G, N, K}, DType::kFloat32)),
      db_experts(Tensor::zeros({G, N}, DType::kFloat32));
  const GroupedParam &dW = dw_experts.param, &dB = db_experts.param;
  grouped_linear_wgrad(to_gpu(dy), to_gpu(x), r.gpu, dW, GradMode::kWrite);
  grouped_linear_dbias(to_gpu(dy), r.gpu, dB, GradMode::kWrite);
  for (int64_t g = 0; g < G; ++g) {
    EXPECT_LE(oracle::rel_error(oracle::to_matrix(to_host(dW.expert(g))),
                                oracle::to_matrix(dw_cpu.view().select(g))),
              2e-5)
        << "dW expert " << g;
    EXPECT_LE(oracle::rel_error(oracle::to_vector(to_host(dB.expert(g))),
                                oracle::to_vector(db_cpu.view().select(g))),
              2e-5)
        << "db expert " << g;
  }
  // Without its pointer table a per-expert tensor cannot reach the kernels: a clear error.
  EXPECT_MOE_ERROR(
      grouped_linear_forward(to_gpu(x), GroupedParam::per_expert(W.experts()), r.gpu, y),
      ErrorCode::kInvalidArgument,
      "GroupedParam::per_expert(experts, make_pointer_table(experts))");
}

}  // namespace
}  // namespace moe::test
