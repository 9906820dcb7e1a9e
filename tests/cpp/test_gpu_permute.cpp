// GPU tests of permute and unpermute (ctest label "gpu"): the plan and the four row ops bit for bit
// against the CPU backend (rows of 16-byte vectors, and odd or unaligned rows element by element),
// replayed from a CUDA graph with new routings as the eager calls compute them, and bad routing
// values reported through the device error flag without a byte written out of bounds. Every test
// skips, with the reason, when no GPU is visible.
#include <cuda_runtime_api.h>

#include <tuple>

#include "gpu_support.hpp"
#include "permute_support.hpp"

namespace moe::test {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

class GpuPermute : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

// The plan's device buffers for static T, k, E, with its workspace and error flag: what a captured
// step keeps at fixed addresses.
struct GpuPlan {
  std::optional<double> factor;
  Tensor indices, row_of, splits, offsets, dropped, workspace;
  DeviceErrorFlag flag{Device::cuda(0)};

  GpuPlan(int64_t T, int64_t k, int64_t E, std::optional<double> capacity_factor = std::nullopt,
          DType index_dtype = DType::kInt64)
      : factor(capacity_factor) {
    const Device gpu = Device::cuda(0);
    indices = Tensor::empty({T, k}, index_dtype, gpu);
    row_of = poisoned_gpu({T, k}, DType::kInt32);
    splits = poisoned_gpu({E}, DType::kInt64);
    offsets = poisoned_gpu({E + 1}, DType::kInt64);
    dropped = poisoned_gpu({E}, DType::kInt64);
    workspace = Tensor::empty({int64_t(permute_plan_workspace_size(T, k, E))}, DType::kUInt8, gpu);
  }
  ExecContext ctx(cudaStream_t stream) const {
    return {stream, {workspace.data(), workspace.nbytes(), Device::cuda(0)}};
  }
  GroupLayout run(cudaStream_t stream = nullptr) {
    return permute_plan(indices, {row_of, splits, offsets, dropped}, factor, &flag, ctx(stream));
  }
};

// [rows, cols] views of a [rows, stride] storage: rows strided by `stride` elements.
TensorView columns(const Tensor& storage, int64_t cols) {
  return TensorView(storage.data(), {storage.size(0), cols}, {storage.size(1), 1}, storage.dtype(),
                    storage.device());
}

struct PlanCase {
  int64_t T, k, E;
};

TEST_F(GpuPermute, PlanMatchesTheCpuBitForBit) {
  Rng rng;
  // Shapes from empty to several thousand chunks' worth, one expert to the most the kernel takes.
  const PlanCase cases[] = {{0, 2, 4},    {1, 1, 1},       {7, 2, 3},
                            {33, 8, 256}, {257, 1, 1},     {3000, 8, 256},
                            {4096, 2, 8}, {1500, 6, 2048}, {20000, 8, 64}};
  for (const PlanCase& c : cases)
    for (std::optional<double> factor :
         {std::optional<double>(), std::optional(0.8), std::optional(1.3)})
      for (DType dtype : {DType::kInt64, DType::kInt32}) {
        SCOPED_TRACE("T " + std::to_string(c.T) + " k " + std::to_string(c.k) + " E " +
                     std::to_string(c.E) + " factor " +
                     (factor ? std::to_string(*factor) : "none") + " " + dtype_name(dtype));
        const Plan cpu(random_choices(rng, c.T, c.k, c.E), c.T, c.k, c.E, factor, dtype);
        GpuPlan gpu(c.T, c.k, c.E, factor, dtype);
        copy_tensor(gpu.indices, cpu.indices);
        const GroupLayout layout = gpu.run();
        EXPECT_NO_THROW(gpu.flag.check());
        EXPECT_EQ(layout.capacity(), cpu.R());
        EXPECT_TRUE(bitwise_equal(to_host(gpu.row_of), cpu.row_of));
        EXPECT_TRUE(bitwise_equal(to_host(gpu.splits), cpu.splits));
        EXPECT_TRUE(bitwise_equal(to_host(gpu.dropped), cpu.dropped));
        EXPECT_TRUE(bitwise_equal(to_host(gpu.offsets), cpu.offsets));
      }
  GpuPlan too_many(4, 2, 2049);
  EXPECT_MOE_ERROR(too_many.run(), ErrorCode::kNotImplemented,
                   "permute_plan on CUDA: E = 2049 experts");
  GpuPlan plan(4, 2, 4);
  EXPECT_MOE_ERROR(permute_plan(plan.indices, {plan.row_of, plan.splits, plan.offsets, {}},
                                std::nullopt, &plan.flag),
                   ErrorCode::kWorkspace, "size it with permute_plan_workspace_size(...)");
  EXPECT_MOE_ERROR(permute_plan(plan.indices, {plan.row_of, plan.splits, plan.offsets, {}},
                                std::nullopt, nullptr, plan.ctx(nullptr)),
                   ErrorCode::kInvalidArgument, "on CUDA a DeviceErrorFlag is required");
}

struct RowsCase {
  int64_t cols, stride;  // stride > cols: strided rows; odd sizes: element by element
};

class GpuPermuteRows : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

// All four ops, with probs and drops, on the same inputs on both devices: the same bytes, tails
// included (both start poisoned).
TEST_P(GpuPermuteRows, MatchTheCpuBitForBit) {
  const DType dtype = GetParam();
  Rng rng;
  // k = 4 at widths of one vector a thread and less; then k = 1, 2, 4, 8 at 4200 columns, more
  // than 2 vectors a thread of 16-bit values (the kernels' several-vector paths).
  struct Case {
    int64_t T, k, E;
    RowsCase rows;
  };
  for (const Case& rc : {Case{300, 4, 32, {264, 264}}, Case{300, 4, 32, {7, 7}}, Case{300, 4, 32, {1000, 1008}},
                         Case{300, 4, 32, {1000, 1001}}, Case{97, 1, 8, {4200, 4200}}, Case{130, 2, 16, {4200, 4208}},
                         Case{61, 4, 32, {4200, 4200}}, Case{40, 8, 64, {4200, 4200}}})
    for (std::optional<double> factor : {std::optional<double>(), std::optional(0.7)}) {
      const int64_t T = rc.T, k = rc.k, E = rc.E;
      const RowsCase& c = rc.rows;
      SCOPED_TRACE("T " + std::to_string(T) + " k " + std::to_string(k) + " H " + std::to_string(c.cols) +
                   " stride " + std::to_string(c.stride) + " factor " + (factor ? std::to_string(*factor) : "none"));
      const Plan cpu(random_choices(rng, T, k, E), T, k, E, factor);
      GpuPlan gpu(T, k, E, factor);
      copy_tensor(gpu.indices, cpu.indices);
      const GroupLayout layout = gpu.run();
      const int64_t R = cpu.R(), H = c.cols;

      // Inputs (host storages; the GPU gets copies) and poisoned outputs on both devices.
      const Tensor x = random_tensor({T, c.stride}, dtype, rng),
                   out = random_tensor({R, c.stride}, dtype, rng);
      const Tensor dy = random_tensor({T, c.stride}, dtype, rng),
                   g = random_tensor({R, c.stride}, dtype, rng);
      const Tensor probs = uniform_tensor({T, k}, DType::kFloat32, rng, 0, 1);
      const Tensor g_probs = random_tensor({R}, DType::kFloat32, rng);
      const Tensor x_d = to_gpu(x), out_d = to_gpu(out), dy_d = to_gpu(dy), g_d = to_gpu(g);
      const Tensor probs_d = to_gpu(probs), g_probs_d = to_gpu(g_probs);
      struct Outputs {
        Tensor x_sorted, probs_sorted, y, dx, d_probs_sorted_grad, d_out, d_probs, d_copy;
      };
      auto fresh = [&](bool on_gpu) {
        auto make = [&](Shape s, DType d) { return on_gpu ? poisoned_gpu(s, d) : poisoned(s, d); };
        return Outputs{make({R, c.stride}, dtype),    make({R}, DType::kFloat32),
                       make({T, c.stride}, dtype),    make({T, c.stride}, dtype),
                       make({T, k}, DType::kFloat32), make({R, c.stride}, dtype),
                       make({T, k}, DType::kFloat32), make({R, c.stride}, dtype)};
      };
      auto run = [&](const Outputs& o, const GroupLayout& l, const TensorView& row_of,
                     const Tensor& x_, const Tensor& out_, const Tensor& dy_, const Tensor& g_,
                     const Tensor& probs_, const Tensor& g_probs_) {
        permute(columns(x_, H), probs_, row_of, l, columns(o.x_sorted, H), o.probs_sorted);
        unpermute(columns(out_, H), probs_, row_of, l, columns(o.y, H));
        permute_backward(columns(g_, H), g_probs_, row_of, l, columns(o.dx, H),
                         o.d_probs_sorted_grad);
        unpermute_backward(columns(dy_, H), columns(out_, H), probs_, row_of, l,
                           columns(o.d_out, H), o.d_probs);
        unpermute_backward(columns(dy_, H), {}, {}, row_of, l, columns(o.d_copy, H), {});
      };
      const Outputs host = fresh(false), dev = fresh(true);
      run(host, cpu.layout, cpu.row_of, x, out, dy, g, probs, g_probs);
      run(dev, layout, gpu.row_of, x_d, out_d, dy_d, g_d, probs_d, g_probs_d);
      EXPECT_NO_THROW(gpu.flag.check());
      EXPECT_TRUE(bitwise_equal(to_host(dev.x_sorted), host.x_sorted)) << "permute";
      EXPECT_TRUE(bitwise_equal(to_host(dev.probs_sorted), host.probs_sorted)) << "permute: probs";
      EXPECT_TRUE(bitwise_equal(to_host(dev.y), host.y)) << "unpermute";
      EXPECT_TRUE(bitwise_equal(to_host(dev.dx), host.dx)) << "permute_backward";
      EXPECT_TRUE(bitwise_equal(to_host(dev.d_probs_sorted_grad), host.d_probs_sorted_grad))
          << "permute_backward: probs";
      EXPECT_TRUE(bitwise_equal(to_host(dev.d_out), host.d_out)) << "unpermute_backward";
      EXPECT_TRUE(bitwise_equal(to_host(dev.d_probs), host.d_probs))
          << "unpermute_backward: d_probs";
      EXPECT_TRUE(bitwise_equal(to_host(dev.d_copy), host.d_copy))
          << "unpermute_backward without probs";
    }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuPermuteRows,
                         ::testing::Values(DType::kBFloat16, DType::kFloat16, DType::kFloat32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// One step (plan, permute, unpermute and both backward ops) captured once and replayed with new
// routings written into the same indices tensor: the routed rows equal an eager run's, bit for bit.
TEST_F(GpuPermute, GraphReplayWithNewRoutingsEqualsEager) {
  Rng rng;
  const int64_t T = 512, k = 4, E = 64, H = 256;
  const double factor = 1.0;
  const DType dtype = DType::kBFloat16;
  const int64_t R = permuted_rows(T, k, E, factor);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  const Tensor x = to_gpu(random_tensor({T, H}, dtype, rng)),
               dy = to_gpu(random_tensor({T, H}, dtype, rng));
  const Tensor probs = to_gpu(uniform_tensor({T, k}, DType::kFloat32, rng, 0, 1));
  struct Step {
    GpuPlan plan;
    Tensor x_sorted, probs_sorted, y, d_out, d_probs, dx, d_probs_back;
    Step(int64_t T, int64_t k, int64_t E, int64_t R, int64_t H, double factor, DType dtype)
        : plan(T, k, E, factor),
          x_sorted(poisoned_gpu({R, H}, dtype)),
          probs_sorted(poisoned_gpu({R}, DType::kFloat32)),
          y(poisoned_gpu({T, H}, dtype)),
          d_out(poisoned_gpu({R, H}, dtype)),
          d_probs(poisoned_gpu({T, k}, DType::kFloat32)),
          dx(poisoned_gpu({T, H}, dtype)),
          d_probs_back(poisoned_gpu({T, k}, DType::kFloat32)) {}
    // The experts are the identity here: unpermute combines x_sorted itself.
    void record(const Tensor& x, const Tensor& dy, const Tensor& probs, cudaStream_t stream) {
      const GroupLayout l = plan.run(stream);
      const ExecContext ctx{stream, {}};
      permute(x, probs, plan.row_of, l, x_sorted, probs_sorted, ctx);
      unpermute(x_sorted, probs, plan.row_of, l, y, ctx);
      unpermute_backward(dy, x_sorted, probs, plan.row_of, l, d_out, d_probs, ctx);
      permute_backward(d_out, probs_sorted, plan.row_of, l, dx, d_probs_back, ctx);
    }
  };
  Step captured(T, k, E, R, H, factor, dtype), eager(T, k, E, R, H, factor, dtype);
  copy_tensor(captured.plan.indices, index_tensor(random_choices(rng, T, k, E), T, k));
  captured.record(x, dy, probs, stream);  // one eager step first (section 7 of docs/design.md)
  CUDA_OK(cudaStreamSynchronize(stream));
  CapturedGraph graph(stream, [&] { captured.record(x, dy, probs, stream); });

  std::vector<std::vector<int64_t>> routings = {random_choices(rng, T, k, E),
                                                random_choices(rng, T, k, 4)};
  std::vector<int64_t> hot;  // every token's first choice on expert 5: most are dropped
  for (int64_t t = 0; t < T; ++t) hot.insert(hot.end(), {5, 6, 7, 8});
  routings.push_back(hot);
  for (size_t i = 0; i < routings.size(); ++i) {
    SCOPED_TRACE("routing " + std::to_string(i));
    const Tensor host_indices = index_tensor(routings[i], T, k);
    copy_tensor(captured.plan.indices, host_indices);
    copy_tensor(eager.plan.indices, host_indices);
    synchronize(nullptr);
    graph.launch();
    eager.record(x, dy, probs, nullptr);
    synchronize(nullptr);
    EXPECT_NO_THROW(captured.plan.flag.check(stream));
    EXPECT_NO_THROW(eager.plan.flag.check());
    const Tensor offsets = to_host(eager.plan.offsets);
    const int64_t routed = offsets.data_as<int64_t>()[E];
    EXPECT_TRUE(bitwise_equal(to_host(captured.plan.row_of), to_host(eager.plan.row_of)));
    EXPECT_TRUE(bitwise_equal(to_host(captured.plan.offsets), offsets));
    EXPECT_TRUE(bitwise_equal(to_host(captured.plan.dropped), to_host(eager.plan.dropped)));
    for (auto [a, b] :
         {std::pair(&captured.x_sorted, &eager.x_sorted), std::pair(&captured.d_out, &eager.d_out)})
      EXPECT_TRUE(
          bitwise_equal(to_host(a->view().slice(0, routed)), to_host(b->view().slice(0, routed))));
    EXPECT_TRUE(bitwise_equal(to_host(captured.probs_sorted.view().slice(0, routed)),
                              to_host(eager.probs_sorted.view().slice(0, routed))));
    for (auto [a, b] :
         {std::pair(&captured.y, &eager.y), std::pair(&captured.d_probs, &eager.d_probs),
          std::pair(&captured.dx, &eager.dx),
          std::pair(&captured.d_probs_back, &eager.d_probs_back)})
      EXPECT_TRUE(bitwise_equal(to_host(*a), to_host(*b)));
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

// An index outside [0, E) cannot throw on the device: its assignment is dropped (row -1, counted
// nowhere) and the flag names it.
TEST_F(GpuPermute, BadIndicesAreDroppedAndReported) {
  Rng rng;
  const int64_t T = 100, k = 2, E = 8;
  std::vector<int64_t> indices = random_choices(rng, T, k, E);
  indices[37] = 8;  // token 18, choice 1
  indices[91] = -3;
  GpuPlan gpu(T, k, E);
  copy_tensor(gpu.indices, index_tensor(indices, T, k));
  gpu.run();
  EXPECT_MOE_ERROR(
      gpu.flag.check(), ErrorCode::kDeviceReported,
      "indices[18, 1] = 8 is not an expert in [0, E = 8) (expected every index in range; the "
      "assignment was dropped: its row_of is -1)");
  const oracle::PermutePlan expected =
      oracle::permute_plan(indices, T, k, E);  // counts only [0, E)
  const Tensor row_of = to_host(gpu.row_of), splits = to_host(gpu.splits);
  for (int64_t i = 0; i < T * k; ++i)
    ASSERT_EQ(row_of.data_as<int32_t>()[i], expected.row_of[size_t(i)]) << i;
  for (int64_t e = 0; e < E; ++e)
    ASSERT_EQ(splits.data_as<int64_t>()[e], expected.splits[size_t(e)]);

  // Each kind of error keeps the details of its own first report: a splits error after a bad index.
  gpu.run();
  std::vector<int64_t> negative(size_t(E), 1);
  negative[5] = -3;
  GroupLayout::compute(to_gpu(splits_tensor_for(negative)), T,
                       Tensor::empty({E + 1}, DType::kInt64, Device::cuda(0)), &gpu.flag);
  const std::string text = describe_device_errors(gpu.flag.read_and_clear());
  EXPECT_NE(text.find("indices[18, 1] = 8 is not an expert"), std::string::npos) << text;
  EXPECT_NE(text.find("splits[5] = -3 is negative"), std::string::npos) << text;
}

// The expert-parallel send plan: the CPU's bits, from one destination to 64 and from no tokens to
// many tiles' worth; a bad index is not sent and is reported.
TEST_F(GpuPermute, SendPlanMatchesTheCpuBitForBit) {
  Rng rng;
  struct Case {
    int64_t T, k, P, L;
  };
  for (const Case& c : {Case{0, 2, 2, 3}, Case{1, 1, 1, 1}, Case{300, 8, 8, 4}, Case{4097, 2, 4, 2},
                        Case{20000, 8, 64, 4}, Case{513, 6, 3, 16}})
    for (double factor : {0.3, 1.0, double(c.P)})
      for (bool with_kept : {false, true}) {
        SCOPED_TRACE("T " + std::to_string(c.T) + " k " + std::to_string(c.k) + " P " + std::to_string(c.P) +
                     " factor " + std::to_string(factor) + (with_kept ? " with layer drops" : ""));
        const int64_t C = pair_capacity(c.T, c.k, c.P, factor);
        const std::vector<int64_t> idx = random_choices(rng, c.T, c.k, c.P * c.L);
        Tensor kept;
        if (with_kept) {
          kept = Tensor::empty({c.T, c.k}, DType::kInt32);
          for (int64_t i = 0; i < c.T * c.k; ++i) kept.data_as<int32_t>()[i] = rng.uniform(0, 1) < 0.2 ? -1 : 0;
        }
        const Tensor indices = index_tensor(idx, c.T, c.k, DType::kInt32);
        const SendPlanRun cpu(indices, kept, c.P, c.L, C, Device::cpu(), nullptr);
        DeviceErrorFlag flag{Device::cuda(0)};
        const SendPlanRun gpu(to_gpu(indices), with_kept ? to_gpu(kept) : Tensor(), c.P, c.L, C, Device::cuda(0),
                              &flag);
        EXPECT_NO_THROW(flag.check());
        for (const auto& [name, g, h] : {std::tuple{"row_send", &gpu.row_send, &cpu.row_send},
                                         std::tuple{"ids", &gpu.ids, &cpu.ids},
                                         std::tuple{"splits", &gpu.splits, &cpu.splits},
                                         std::tuple{"offsets", &gpu.offsets, &cpu.offsets},
                                         std::tuple{"dropped", &gpu.dropped, &cpu.dropped}})
          EXPECT_TRUE(bitwise_equal(to_host(*g), *h)) << name;
      }
  std::vector<int64_t> idx = random_choices(rng, 50, 2, 8);
  idx[41] = 8;  // token 20, choice 1
  DeviceErrorFlag flag{Device::cuda(0)};
  const SendPlanRun gpu(to_gpu(index_tensor(idx, 50, 2)), {}, 2, 4, 100, Device::cuda(0), &flag);
  EXPECT_MOE_ERROR(flag.check(), ErrorCode::kDeviceReported, "indices[20, 1] = 8 is not an expert in [0, E = 8)");
  EXPECT_EQ(to_host(gpu.row_send).data_as<int32_t>()[41], -1);
}

// True if every byte of rows [from, to) of a contiguous host tensor is still poison.
bool rows_untouched(const TensorView& t, int64_t from, int64_t to) {
  return tail_untouched(t.slice(from, to), 0);
}

// A row_of entry neither -1 nor a routed row is skipped (treated as dropped) and reported; the
// guard rows around the sorted buffers keep their bytes.
TEST_F(GpuPermute, BadRowsAreSkippedAndNothingIsWrittenOutOfBounds) {
  Rng rng;
  const int64_t T = 50, k = 2, E = 4, H = 64, guard = 8;
  const DType dtype = DType::kBFloat16;
  const Plan cpu(random_choices(rng, T, k, E), T, k, E);
  const int64_t R = cpu.R();
  GpuPlan gpu(T, k, E);
  copy_tensor(gpu.indices, cpu.indices);
  const GroupLayout layout = gpu.run();
  // The map with three bad entries, and the same map with those entries dropped: what must happen.
  Tensor bad = Tensor::empty({T, k}, DType::kInt32),
         dropped_instead = Tensor::empty({T, k}, DType::kInt32);
  copy_tensor(bad, cpu.row_of);
  bad.data_as<int32_t>()[3 * k + 1] = int32_t(R + 5);
  bad.data_as<int32_t>()[7 * k] = -9;
  bad.data_as<int32_t>()[9 * k + 1] = int32_t(R);
  copy_tensor(dropped_instead, bad);
  for (int64_t i : {3 * k + 1, 7 * k, 9 * k + 1}) dropped_instead.data_as<int32_t>()[i] = -1;

  const Tensor x = random_tensor({T, H}, dtype, rng), dy = random_tensor({T, H}, dtype, rng);
  const Tensor out = random_tensor({R, H}, dtype, rng),
               probs = uniform_tensor({T, k}, DType::kFloat32, rng, 0, 1);
  Tensor sorted = poisoned_gpu({R + 2 * guard, H}, dtype),
         d_out = poisoned_gpu({R + 2 * guard, H}, dtype);
  Tensor y = poisoned_gpu({T, H}, dtype), d_probs = poisoned_gpu({T, k}, DType::kFloat32);
  const Tensor bad_d = to_gpu(bad), x_d = to_gpu(x), dy_d = to_gpu(dy), out_d = to_gpu(out),
               probs_d = to_gpu(probs);
  permute(x_d, {}, bad_d, layout, sorted.view().slice(guard, guard + R), {});
  EXPECT_MOE_ERROR(gpu.flag.check(), ErrorCode::kDeviceReported,
                   "is neither -1 nor a routed row in [0, offsets[G] = ");
  unpermute(out_d, probs_d, bad_d, layout, y);
  EXPECT_MOE_ERROR(gpu.flag.check(), ErrorCode::kDeviceReported, "is neither -1 nor a routed row");
  unpermute_backward(dy_d, out_d, probs_d, bad_d, layout, d_out.view().slice(guard, guard + R),
                     d_probs);
  EXPECT_MOE_ERROR(gpu.flag.check(), ErrorCode::kDeviceReported, "is neither -1 nor a routed row");

  const Tensor sorted_h = to_host(sorted), d_out_h = to_host(d_out);
  for (const Tensor* t : {&sorted_h, &d_out_h}) {
    EXPECT_TRUE(rows_untouched(*t, 0, guard));
    EXPECT_TRUE(rows_untouched(*t, guard + R, R + 2 * guard));
  }
  // The rest is what the map with those entries dropped gives on the CPU.
  Tensor sorted_ref = poisoned({R, H}, dtype), y_ref = poisoned({T, H}, dtype);
  Tensor d_out_ref = poisoned({R, H}, dtype), d_probs_ref = poisoned({T, k}, DType::kFloat32);
  permute(x, {}, dropped_instead, cpu.layout, sorted_ref, {});
  unpermute(out, probs, dropped_instead, cpu.layout, y_ref);
  unpermute_backward(dy, out, probs, dropped_instead, cpu.layout, d_out_ref, d_probs_ref);
  EXPECT_TRUE(bitwise_equal(sorted_h.view().slice(guard, guard + R), sorted_ref));
  EXPECT_TRUE(bitwise_equal(to_host(y), y_ref));
  EXPECT_TRUE(bitwise_equal(d_out_h.view().slice(guard, guard + R), d_out_ref));
  EXPECT_TRUE(bitwise_equal(to_host(d_probs), d_probs_ref));
}

}  // namespace
}  // namespace moe::test
