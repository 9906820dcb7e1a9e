// The MoE layer on CUDA: the CPU layer's routing decisions exactly (choices, counts, kept and
// dropped assignments) and its values within rounding on every case of the CPU suite (capacity
// drops included), and with FP8 experts within FP8's error of the float64 layer; a whole forward +
// backward captured in a CUDA graph and replayed with new inputs gives the bits of eager runs.
#include <cuda_runtime_api.h>

#include <map>
#include <string>
#include <tuple>

#include "gpu_support.hpp"
#include "moe_layer_ep_support.hpp"
#include "moe_layer_support.hpp"

namespace moe::test {
namespace {

std::vector<int64_t> int64s(const TensorView& t) {
  const Tensor h = to_host(t);
  return std::vector<int64_t>(h.data_as<int64_t>(), h.data_as<int64_t>() + h.numel());
}

// A host state dict (for loading into a layer on another device).
std::map<std::string, Tensor> host_state(const MoELayer& layer) {
  std::map<std::string, Tensor> out;
  for (const auto& [key, t] : layer.state_dict()) out[key] = to_host(t);
  return out;
}

class GpuMoELayer : public ::testing::TestWithParam<std::tuple<LayerCase, DType>> {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(GpuMoELayer, SameRoutingAsTheCpuAndValuesWithinRounding) {
  const auto& [c, dtype] = GetParam();
  Rng rng;
  MoELayer cpu(c.E, c.H, c.F, layer_options(c, dtype));
  const LayerInputs in = layer_inputs(c, cpu, dtype, rng);
  MoELayer gpu(c.E, c.H, c.F, layer_options(c, dtype, Device::cuda(0)));
  gpu.load_state_dict(host_state(cpu));

  MoELayerForwardResult fc = cpu.forward(in.x);
  const MoELayerBackwardResult bc = cpu.backward(fc.ctx, in.dy, in.d_loss);
  MoELayerForwardResult fg = gpu.forward(to_gpu(in.x));
  const MoELayerBackwardResult bg = gpu.backward(fg.ctx, to_gpu(in.dy), in.d_loss);
  synchronize(nullptr);
  gpu.check_errors();

  EXPECT_EQ(int64s(fg.counts), int64s(fc.counts));
  EXPECT_EQ(int64s(fg.splits), int64s(fc.splits));
  if (c.capacity_factor) EXPECT_EQ(int64s(fg.dropped), int64s(fc.dropped));
  EXPECT_EQ(int64s(gpu.tokens_per_expert()), int64s(cpu.tokens_per_expert()));
  const double tol = dtype == DType::kFloat32 ? 1e-5 : 1e-2;
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(to_host(fg.y)), oracle::to_matrix(fc.y)), tol);
  EXPECT_NEAR(scalar_value(fg.loss), scalar_value(fc.loss), 1e-5 * std::abs(scalar_value(fc.loss)) + 1e-12);
  EXPECT_LE(oracle::rel_error(oracle::to_matrix(to_host(bg.dx)), oracle::to_matrix(bc.dx)), tol);
  for (const auto& [name, g, h] : {std::tuple{"router", &bg.router_weight, &bc.router_weight},
                                   std::tuple{"fc1", &bg.fc1_weight, &bc.fc1_weight},
                                   std::tuple{"fc2", &bg.fc2_weight, &bc.fc2_weight}})
    EXPECT_LE(oracle::rel_error(grad_matrices(*g), grad_matrices(*h)), tol) << name;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuMoELayer,
                         ::testing::Combine(::testing::ValuesIn(layer_cases()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" + dtype_name(std::get<1>(info.param));
                         });

// FP8 experts (options.experts.fp8) on CUDA: the CPU layer's routing exactly, y and every gradient
// within FP8's error of the float64 layer (expect_fp8_layer_close), on the cases' fp8_shapes.
TEST_P(GpuMoELayer, Fp8ExpertsSameRoutingAndWithinFp8ErrorOfFloat64) {
  MOE_SKIP_WITHOUT_HOPPER();
  const LayerCase c = fp8_shapes(std::get<0>(GetParam()));
  const DType dtype = std::get<1>(GetParam());
  Rng rng;
  MoELayer cpu(c.E, c.H, c.F, fp8_layer_options(c, dtype));
  const LayerInputs in = layer_inputs(c, cpu, dtype, rng);
  const LayerReference ref =
      layer_reference(c, layer_params(cpu), oracle::to_matrix(in.x), oracle::to_matrix(in.dy), in.d_loss);
  ASSERT_GE(ref.min_margin, 1e-4) << "inputs near a routing tie";
  MoELayer gpu(c.E, c.H, c.F, fp8_layer_options(c, dtype, Device::cuda(0)));
  gpu.load_state_dict(host_state(cpu));
  MoELayerForwardResult f = gpu.forward(to_gpu(in.x));
  const MoELayerBackwardResult b = gpu.backward(f.ctx, to_gpu(in.dy), in.d_loss);
  synchronize(nullptr);
  gpu.check_errors();
  EXPECT_EQ(int64s(f.counts), ref.counts);
  EXPECT_EQ(int64s(f.splits), ref.splits);
  if (c.capacity_factor) EXPECT_EQ(int64s(f.dropped), ref.dropped);
  expect_fp8_layer_close(f, b, ref, c.mlp_bias);
}

struct OwnedStream {
  cudaStream_t s = nullptr;
  OwnedStream() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
  ~OwnedStream() { cudaStreamDestroy(s); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
};

// One step (forward, backward with a device d_loss, main_grad overwritten) captured once and
// replayed with new x, dy and d_loss written into the same buffers: the bits of eager steps on
// those inputs, capacity drops and an expert bias included.
TEST(GpuMoELayerGraph, ReplayWithNewInputsMatchesEagerSteps) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  const Device dev = Device::cuda(0);
  LayerCase c{"graph", 301, 64, 48, 16, layer_spec(RouterScore::kSigmoid, 4, 4, 2, true, 2.5f, 0.01f, 0.001f), 0.8,
              true};
  MoELayerOptions o = layer_options(c, DType::kBFloat16, dev);
  o.experts.accumulate_into_main_grad = true;
  o.experts.overwrite_main_grad = true;  // every replay writes the same gradients
  MoELayer layer(c.E, c.H, c.F, o);
  const Tensor router_mg = Tensor::zeros({1, c.E, c.H}, DType::kFloat32, dev);
  const Tensor fc1_mg = Tensor::zeros({c.E, 2 * c.F, c.H}, DType::kFloat32, dev);
  const Tensor fc2_mg = Tensor::zeros({c.E, c.H, c.F}, DType::kFloat32, dev);
  layer.router_weight().set_main_grad(GroupedParam::packed(router_mg));
  layer.experts().fc1_weight().set_main_grad(GroupedParam::packed(fc1_mg));
  layer.experts().fc2_weight().set_main_grad(GroupedParam::packed(fc2_mg));
  Rng rng;
  Tensor bias = Tensor::empty({c.E}, DType::kFloat32);
  oracle::Vector b(size_t(c.E));
  for (double& v : b) v = rng.uniform(-0.05, 0.05);
  oracle::assign(bias, b);
  copy_tensor(layer.expert_bias(), bias);
  struct Inputs {
    Tensor x, dy, d_loss;
  };
  const Inputs sets[2] = {{random_tensor({c.T, c.H}, DType::kBFloat16, rng), random_tensor({c.T, c.H}, DType::kBFloat16, rng),
                           scalar_tensor(0.5, DType::kFloat32)},
                          {random_tensor({c.T, c.H}, DType::kBFloat16, rng), random_tensor({c.T, c.H}, DType::kBFloat16, rng),
                           scalar_tensor(-1.25, DType::kFloat32)}};
  const Tensor x = Tensor::empty({c.T, c.H}, DType::kBFloat16, dev), dy = Tensor::empty({c.T, c.H}, DType::kBFloat16, dev);
  const Tensor d_loss = Tensor::empty({}, DType::kFloat32, dev);
  // Outputs that outlive the graph: the step copies its own tensors into them.
  const Tensor y = Tensor::empty({c.T, c.H}, DType::kBFloat16, dev), dx = Tensor::empty({c.T, c.H}, DType::kBFloat16, dev);
  const Tensor loss = Tensor::empty({}, DType::kFloat32, dev), dropped = Tensor::empty({c.E}, DType::kInt64, dev);
  OwnedStream stream;
  const ExecContext exec{stream.s, {}};
  auto step = [&] {
    MoELayerForwardResult f = layer.forward(x, true, exec);
    const MoELayerBackwardResult b = layer.backward(f.ctx, dy, d_loss, exec);
    copy_tensor(y, f.y, stream.s);
    copy_tensor(loss, f.loss, stream.s);
    copy_tensor(dropped, f.dropped, stream.s);
    copy_tensor(dx, b.dx, stream.s);
  };
  auto load = [&](const Inputs& in) {
    copy_tensor(x, in.x);
    copy_tensor(dy, in.dy);
    copy_tensor(d_loss, in.d_loss);
    synchronize(nullptr);
  };
  auto snapshot = [&] {
    return std::vector<Tensor>{to_host(y), to_host(loss), to_host(dropped), to_host(dx),
                               to_host(router_mg), to_host(fc1_mg), to_host(fc2_mg)};
  };
  std::vector<std::vector<Tensor>> eager;
  for (const Inputs& in : sets) {
    load(in);
    step();
    synchronize(stream.s);
    eager.push_back(snapshot());
  }
  int64_t drops = 0;
  for (int64_t v : int64s(eager[0][2])) drops += v;
  EXPECT_GT(drops, 0) << "the capacity factor should drop assignments";
  CapturedGraph graph(stream.s, step);
  for (int replay = 0; replay < 4; ++replay) {
    load(sets[replay % 2]);
    graph.launch();
    const std::vector<Tensor> got = snapshot();
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(bitwise_equal(got[i], eager[size_t(replay % 2)][i])) << "replay " << replay << ", output " << i;
  }
  layer.check_errors(stream.s);
}

// Expert parallelism on one GPU: P ranks as threads, each on its own stream, over the in-process
// communicator (device-to-device copies); every rank against the layer without expert parallelism
// on its tokens, as the CPU suite checks, with 16-bit and FP8 experts.
class GpuMoELayerExpertParallel : public ::testing::TestWithParam<std::tuple<EpCase, DType>> {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_P(GpuMoELayerExpertParallel, EachRankMatchesTheFullLayerOnItsTokens) {
  const auto& [e, dtype] = GetParam();
  if (e.fp8) {
    MOE_SKIP_WITHOUT_HOPPER();
  }
  std::vector<Stream> streams;
  for (int r = 0; r < e.ranks; ++r) {
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    streams.push_back(s);
  }
  check_expert_parallel(e, dtype, Device::cuda(0), streams, dtype == DType::kFloat32 ? 1e-5 : 1e-2);
  for (Stream s : streams) cudaStreamDestroy(static_cast<cudaStream_t>(s));
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuMoELayerExpertParallel,
                         ::testing::Combine(::testing::ValuesIn(ep_cases()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         ep_param_name);

INSTANTIATE_TEST_SUITE_P(Fp8, GpuMoELayerExpertParallel,
                         ::testing::Combine(::testing::ValuesIn(ep_fp8_cases()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         ep_param_name);

}  // namespace
}  // namespace moe::test
