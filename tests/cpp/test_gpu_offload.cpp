// ActivationOffload on CUDA (label "gpu"): bit-identical to no offload on a non-blocking stream
// with nothing synchronizing inside a step (so only the events order the copies); the peak of
// stream-ordered device memory drops by what the offloaded layers saved; many layers x steps leak
// neither device nor pinned memory; the whole stack's step captured in a CUDA graph, with and
// without offload, replays new routings like eager steps. Skips, saying why, without a GPU.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <memory>

#include "gpu_support.hpp"
#include "offload_stack.hpp"

namespace moe::test {
namespace {

struct GpuInputs {
  std::vector<std::unique_ptr<DualRouting>> routings;
  std::vector<GroupLayout> layouts;
  Tensor x, probs, dy;
  GpuInputs(const StackShape& s, int64_t T, Rng& rng)
      : x(to_gpu(random_tensor({T, s.hidden}, DType::kBFloat16, rng))),
        probs(to_gpu(uniform_tensor({T}, DType::kFloat32, rng, 0.05, 1.0))),
        dy(to_gpu(random_tensor({T, s.hidden}, DType::kBFloat16, rng))) {
    for (int i = 0; i < s.layers; ++i) {  // an empty expert, a 1-row expert, rows past the end
      std::vector<int64_t> splits = random_splits(rng, s.groups, 2 * T / s.groups);
      splits[0] = 0;
      splits[1] = 1;
      int64_t sum = 0;
      for (int64_t& v : splits) v = std::min(v, T - 8 - sum), sum += v;
      routings.push_back(std::make_unique<DualRouting>(splits, T));
      layouts.push_back(routings.back()->gpu);
    }
  }
  void check_flags() {
    for (auto& r : routings) r->flag.check(nullptr);
  }
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
  ~Stream() { cudaStreamDestroy(s); }
};

class GpuOffload : public ::testing::TestWithParam<bool> {};  // delayed weight gradients or not

TEST_P(GpuOffload, BitIdenticalToNoOffloadWithoutSynchronizing) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  const StackShape shape{.layers = 5, .groups = 8, .hidden = 256, .ffn = 512, .delay_wgrad = GetParam(),
                         .opt_out_layer = 2};
  Rng rng;
  GpuInputs in(shape, 2048, rng);
  Stream stream;
  const Device cuda = Device::cuda(0);
  OffloadStack plain(shape, cuda), offloaded(shape, cuda);
  ActivationOffload offload(cuda, shape.layers);
  size_t pinned = 0;
  for (int step = 0; step < 3; ++step) {
    const StepResult a = plain.step(in.x, in.layouts, in.probs, in.dy, nullptr, stream.s);
    const StepResult b = offloaded.step(in.x, in.layouts, in.probs, in.dy, &offload, stream.s);
    EXPECT_TRUE(bitwise_equal(a.y, b.y)) << "step " << step;
    EXPECT_TRUE(bitwise_equal(a.dx, b.dx)) << "step " << step;
    ASSERT_EQ(a.dprobs.size(), b.dprobs.size());
    for (size_t i = 0; i < a.dprobs.size(); ++i) EXPECT_TRUE(bitwise_equal(a.dprobs[i], b.dprobs[i])) << i;
    EXPECT_EQ(b.mlp_offloaded, (std::vector<bool>{true, true, false, true, false}));
    if (step == 0) pinned = offload.pinned_bytes();
    EXPECT_EQ(offload.pinned_bytes(), pinned);
  }
  const std::vector<Tensor> ga = plain.main_grads_on_host(stream.s), gb = offloaded.main_grads_on_host(stream.s);
  ASSERT_EQ(ga.size(), gb.size());
  for (size_t i = 0; i < ga.size(); ++i) EXPECT_TRUE(bitwise_equal(ga[i], gb[i])) << "main_grad " << i;
  in.check_flags();
}

INSTANTIATE_TEST_SUITE_P(Wgrad, GpuOffload, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Delayed" : "Immediate"; });

// Peak of the stream-ordered pool over one step (after a warm-up step of the same shapes).
size_t step_peak(OffloadStack& stack, GpuInputs& in, ActivationOffload* offload, cudaStream_t stream,
                 int64_t* saved_per_layer) {
  const Device cuda = Device::cuda(0);
  stack.step(in.x, in.layouts, in.probs, in.dy, offload, stream);
  synchronize(stream);
  const size_t base = stream_ordered_memory(cuda).used_bytes;
  reset_peak_stream_ordered_memory(cuda);
  const StepResult r = stack.step(in.x, in.layouts, in.probs, in.dy, offload, stream);
  synchronize(stream);
  if (saved_per_layer) *saved_per_layer = r.saved_bytes / int64_t(r.mlp_offloaded.size());
  return stream_ordered_memory(cuda).peak_used_bytes - base;
}

TEST(GpuOffloadMemory, PeakDropsByTheOffloadedLayers) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  const StackShape shape{.layers = 8, .groups = 8, .hidden = 512, .ffn = 1024};
  Rng rng;
  GpuInputs in(shape, 4096, rng);
  Stream stream;
  OffloadStack plain(shape, Device::cuda(0)), offloaded(shape, Device::cuda(0));
  ActivationOffload offload(Device::cuda(0), shape.layers);
  int64_t per_layer = 0;  // the MLP's saved bytes per layer without offload (x + pre-activation)
  const size_t off = step_peak(plain, in, nullptr, stream.s, &per_layer);
  const size_t on = step_peak(offloaded, in, &offload, stream.s, nullptr);
  std::printf("[ offload ] peak stream-ordered memory: %.1f MB without, %.1f MB with offload (%.3fx); "
              "%.1f MB saved per layer by the MLP alone, %.1f MB offloaded per step\n",
              off / 1e6, on / 1e6, double(on) / double(off), per_layer / 1e6, offload.offloaded_bytes() / 1e6);
  // 7 of 8 layers go; at most the last layer, two layers in flight in each direction and the
  // backward's scratch stay: at least 3 layers' worth must be gone from the peak.
  EXPECT_LT(on + size_t(3 * per_layer), off);
  in.check_flags();
}

TEST(GpuOffloadMemory, ManyLayersAndStepsLeakNothing) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  const StackShape shape{.layers = smaller_under_sanitizer(12, 4), .groups = 4, .hidden = 128, .ffn = 256};
  Rng rng;
  GpuInputs in(shape, 2048, rng);
  Stream stream;
  const Device cuda = Device::cuda(0);
  OffloadStack stack(shape, cuda);
  ActivationOffload offload(cuda, shape.layers, -1, {.min_bytes = 0});
  StepResult first;
  size_t used = 0, pinned = 0;
  const int steps = smaller_under_sanitizer(10, 3);
  for (int step = 0; step < steps; ++step) {
    const StepResult r = stack.step(in.x, in.layouts, in.probs, in.dy, &offload, stream.s);
    synchronize(stream.s);
    const size_t now = stream_ordered_memory(cuda).used_bytes;
    if (step == 0) {
      first = r, used = now, pinned = offload.pinned_bytes();
      EXPECT_GT(pinned, 0u);
      continue;
    }
    EXPECT_TRUE(bitwise_equal(r.y, first.y)) << "step " << step;
    EXPECT_TRUE(bitwise_equal(r.dx, first.dx)) << "step " << step;
    EXPECT_EQ(now, used) << "device memory after step " << step;
    EXPECT_EQ(offload.pinned_bytes(), pinned) << "pinned memory after step " << step;
  }
  in.check_flags();
}

// The whole stack (per layer a GroupedMLP and a GroupedLinear; delayed wgrad, main_grad
// accumulation, bias grads, dprobs) captured once with cudaStreamCaptureModeGlobal, with and
// without offload, and replayed with new routings: every replay equal bit for bit to an eager step
// of an identical stack without offload.
class GpuOffloadGraph : public ::testing::TestWithParam<bool> {};  // with offload or not

TEST_P(GpuOffloadGraph, WholeStackReplaysWithNewRoutingsLikeEager) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  const StackShape shape{.layers = 4, .groups = 8, .hidden = 256, .ffn = 512, .delay_wgrad = true};
  const int64_t T = 2048;
  Rng rng;
  GpuInputs in(shape, T, rng);  // its routings' device splits are the graph's routing inputs
  Stream stream;
  const Device cuda = Device::cuda(0);
  OffloadStack plain(shape, cuda), graphed(shape, cuda);
  std::unique_ptr<ActivationOffload> offload;
  if (GetParam()) offload = std::make_unique<ActivationOffload>(cuda, shape.layers);
  auto layouts = [&] {  // offsets from the current splits, on the stream (captured with the step)
    std::vector<GroupLayout> l;
    for (auto& r : in.routings) l.push_back(GroupLayout::compute(r->splits, T, r->offsets, &r->flag, stream.s));
    return l;
  };
  Tensor y = Tensor::empty({T, shape.hidden}, DType::kBFloat16, cuda);
  Tensor dx = Tensor::empty({T, shape.hidden}, DType::kBFloat16, cuda);
  std::vector<Tensor> dprobs;
  for (int i = 0; i < 2 * shape.layers; ++i) dprobs.push_back(Tensor::empty({T}, DType::kFloat32, cuda));
  auto record = [&] {  // the step's own tensors are allocated and freed inside it
    const DeviceStep d = graphed.run(in.x, layouts(), in.probs, in.dy, offload.get(), stream.s);
    copy_tensor(y, d.y, stream.s);
    copy_tensor(dx, d.dx, stream.s);
    for (size_t i = 0; i < dprobs.size(); ++i) copy_tensor(dprobs[i], d.dprobs[i], stream.s);
  };
  record();  // eager warm-up: pinned buffers
  synchronize(stream.s);
  CapturedGraph graph(stream.s, record);
  for (int replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE("routing " + std::to_string(replay));
    for (auto& r : in.routings) {
      std::vector<int64_t> s = random_splits(rng, shape.groups, 2 * T / shape.groups);
      if (replay == 1) s.assign(size_t(shape.groups), 0), s[3] = T - 8;  // one expert takes (almost) all
      if (replay == 2) s.assign(size_t(shape.groups), 0);                // no rows at all
      int64_t sum = 0;
      for (int64_t& v : s) v = std::min(v, T - 8 - sum), sum += v;  // rows past the end stay
      copy_tensor(r->splits, splits_tensor_for(s), stream.s);
    }
    for (OffloadStack* st : {&plain, &graphed})
      for (const Tensor& g : st->main_grads()) fill_bytes(g, 0, stream.s);
    for (Tensor* t : {&y, &dx}) fill_bytes(*t, kPoison, stream.s);
    graph.launch();
    const StepResult eager = plain.step(in.x, layouts(), in.probs, in.dy, nullptr, stream.s);
    EXPECT_TRUE(bitwise_equal(to_host(y), eager.y));
    EXPECT_TRUE(bitwise_equal(to_host(dx), eager.dx));
    for (size_t i = 0; i < dprobs.size(); ++i) EXPECT_TRUE(bitwise_equal(to_host(dprobs[i]), eager.dprobs[i])) << i;
    const std::vector<Tensor> ga = plain.main_grads_on_host(stream.s), gb = graphed.main_grads_on_host(stream.s);
    for (size_t i = 0; i < ga.size(); ++i) EXPECT_TRUE(bitwise_equal(ga[i], gb[i])) << "main_grad " << i;
  }
  in.check_flags();
}

INSTANTIATE_TEST_SUITE_P(Offload, GpuOffloadGraph, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "WithOffload" : "WithoutOffload"; });

}  // namespace
}  // namespace moe::test
