// GPU tests (ctest label "gpu"): the device offsets/validation kernel, its error reporting and
// its CUDA-graph safety; CUDA tensors; ops that have no CUDA kernel yet say so. Every test skips,
// with the reason, when no GPU is visible.
#include <cuda_runtime_api.h>

#include <numeric>

#include "gpu_support.hpp"

namespace moe::test {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

// What the kernel must produce, bad splits included: negative -> 0, offsets clamped to T.
std::vector<int64_t> sanitized_offsets(const std::vector<int64_t>& splits, int64_t capacity) {
  std::vector<int64_t> off(splits.size() + 1);
  int64_t sum = 0;
  for (size_t g = 0; g <= splits.size(); ++g) {
    off[g] = std::min(sum, capacity);
    if (g < splits.size()) sum += std::max<int64_t>(splits[g], 0);
  }
  return off;
}

template <class T>
Tensor splits_tensor(const std::vector<int64_t>& s) {
  Tensor t = Tensor::empty({int64_t(s.size())}, dtype_of_v<T>);
  for (size_t i = 0; i < s.size(); ++i) t.data_as<T>()[i] = T(s[i]);
  return t;
}

TEST_F(Gpu, TensorRoundTripAndFill) {
  Rng rng;
  Tensor a = random_tensor({33, 17}, DType::kBFloat16, rng);
  Tensor d = to_gpu(a);
  EXPECT_EQ(d.device(), Device::cuda(0));
  EXPECT_TRUE(bitwise_equal(to_host(d), a));
  fill_bytes(d, kPoison);
  EXPECT_TRUE(tail_untouched(to_host(d), 0));
}

TEST_F(Gpu, OffsetsMatchTheCpuForManyShapes) {
  Rng rng;
  for (int64_t G : {1, 7, 255, 256, 257, 1000, 3000}) {
    for (bool int32 : {false, true}) {
      SCOPED_TRACE("G = " + std::to_string(G) + (int32 ? " int32" : " int64"));
      const std::vector<int64_t> s = random_splits(rng, G, 300);
      const int64_t sum = std::accumulate(s.begin(), s.end(), int64_t(0));
      Tensor splits = to_gpu(int32 ? splits_tensor<int32_t>(s) : splits_tensor<int64_t>(s));
      Tensor offsets = Tensor::empty({G + 1}, DType::kInt64, Device::cuda(0));
      fill_bytes(offsets, kPoison);
      DeviceErrorFlag flag(Device::cuda(0));
      const GroupLayout layout = GroupLayout::compute(splits, sum + 5, offsets, &flag);
      EXPECT_EQ(layout.device(), Device::cuda(0));
      EXPECT_NO_THROW(flag.check());
      Tensor host = to_host(offsets);
      const auto expected = sanitized_offsets(s, sum + 5);
      for (int64_t g = 0; g <= G; ++g)
        ASSERT_EQ(host.data_as<int64_t>()[g], expected[size_t(g)]) << g;
    }
  }
}

TEST_F(Gpu, BadSplitsAreReportedAndNeverLeaveTheBuffer) {
  Rng rng;
  DeviceErrorFlag flag(Device::cuda(0));
  // negative splits
  std::vector<int64_t> s = random_splits(rng, 300, 20);
  s[5] = -3;
  s[290] = -1;
  const int64_t cap = 4000;
  Tensor offsets = Tensor::empty({301}, DType::kInt64, Device::cuda(0));
  GroupLayout::compute(to_gpu(splits_tensor<int64_t>(s)), cap, offsets, &flag);
  Tensor host = to_host(offsets);
  const auto expected = sanitized_offsets(s, cap);
  for (int g = 0; g <= 300; ++g) ASSERT_EQ(host.data_as<int64_t>()[g], expected[size_t(g)]);
  EXPECT_MOE_ERROR(flag.check(), ErrorCode::kDeviceReported, "splits[5] = -3 is negative");
  EXPECT_NO_THROW(flag.check());  // cleared

  // sum past the capacity: offsets stay within [0, T]
  std::vector<int64_t> big(64, 100);
  GroupLayout::compute(to_gpu(splits_tensor<int32_t>(big)), 1000,
                       Tensor::empty({65}, DType::kInt64, Device::cuda(0)), &flag);
  const DeviceErrorRecord rec = flag.read_and_clear();
  EXPECT_EQ(rec.bits, uint32_t(kSplitsExceedCapacity));
  EXPECT_EQ(rec.total, 6400);
  EXPECT_EQ(rec.capacity, 1000);
  Tensor off2 = Tensor::empty({65}, DType::kInt64, Device::cuda(0));
  GroupLayout::compute(to_gpu(splits_tensor<int64_t>(big)), 1000, off2, &flag);
  Tensor h2 = to_host(off2);
  for (int g = 0; g <= 64; ++g) {
    ASSERT_LE(h2.data_as<int64_t>()[g], 1000);
    if (g) ASSERT_GE(h2.data_as<int64_t>()[g], h2.data_as<int64_t>()[g - 1]);
  }
  EXPECT_MOE_ERROR(flag.check(), ErrorCode::kDeviceReported,
                   "sum(splits) = 6400 exceeds the buffer capacity T = 1000");
  // A huge split saturates instead of overflowing.
  std::vector<int64_t> huge = {INT64_MAX / 2, INT64_MAX / 2, 5};
  GroupLayout::compute(to_gpu(splits_tensor<int64_t>(huge)), 10,
                       Tensor::empty({4}, DType::kInt64, Device::cuda(0)), &flag);
  EXPECT_EQ(flag.read_and_clear().bits, uint32_t(kSplitsExceedCapacity));
}

// The device tail clear matches the CPU one for aligned and odd row sizes, full and empty routings.
TEST_F(Gpu, ZeroUnroutedRowsMatchesTheCpu) {
  Rng rng;
  for (int64_t cols : {1, 3, 8, 129}) {
    for (const auto& s : std::vector<std::vector<int64_t>>{{0, 0}, {4, 0, 9}, {20, 3}, {1}}) {
      SCOPED_TRACE("cols " + std::to_string(cols));
      const int64_t T = 23;
      DualRouting r(s, T);
      Tensor host = random_tensor({T, cols}, DType::kBFloat16, rng), dev = to_gpu(host);
      zero_unrouted_rows(host, r.cpu.layout);
      zero_unrouted_rows(dev, r.gpu);
      EXPECT_TRUE(bitwise_equal(to_host(dev), host));
    }
  }
}

// Several tensors in one call (more than one launch's worth), odd and aligned rows, a tail larger
// than one pass of the grid: the same bytes as the CPU.
TEST_F(Gpu, ZeroUnroutedRowsOfSeveralTensorsMatchesTheCpu) {
  Rng rng;
  for (const auto& s : std::vector<std::vector<int64_t>>{{0, 0}, {4, 0, 9}, {3000, 1}, {1}}) {
    const int64_t T = 3001;
    DualRouting r(s, T);
    std::vector<Tensor> host, dev;
    for (int64_t cols : {1, 3, 8, 129, 1024, 2, 7, 16, 5, 640}) {
      host.push_back(random_tensor({T, cols}, cols % 2 ? DType::kBFloat16 : DType::kFloat32, rng));
      dev.push_back(to_gpu(host.back()));
    }
    std::vector<TensorView> host_views(host.begin(), host.end()), dev_views(dev.begin(), dev.end());
    dev_views.insert(dev_views.begin() + 2, TensorView());
    zero_unrouted_rows(host_views, r.cpu.layout);
    zero_unrouted_rows(dev_views, r.gpu);
    for (size_t i = 0; i < host.size(); ++i)
      EXPECT_TRUE(bitwise_equal(to_host(dev[i]), host[i])) << "tensor " << i << " " << TensorView(host[i]).describe();
  }
}

TEST_F(Gpu, OffsetsReplayFromACapturedGraphWithNewSplits) {
  Rng rng;
  const int64_t G = 128, cap = 128 * 64;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Tensor splits = Tensor::empty({G}, DType::kInt64, Device::cuda(0));
  Tensor offsets = Tensor::empty({G + 1}, DType::kInt64, Device::cuda(0));
  DeviceErrorFlag flag(Device::cuda(0));

  CapturedGraph graph(stream, [&] {
    GroupLayout::compute(splits, cap, offsets, &flag, stream);
    EXPECT_TRUE(stream_is_capturing(stream));
    EXPECT_MOE_ERROR(flag.check(stream), ErrorCode::kInvalidArgument,
                     "being captured into a CUDA graph");
  });

  Tensor eager = Tensor::empty({G + 1}, DType::kInt64, Device::cuda(0));
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE("routing " + std::to_string(step));
    std::vector<int64_t> s = random_splits(rng, G, 64);
    if (step == 3) s[7] = -2;  // one replay with a bad routing
    Tensor host = splits_tensor<int64_t>(s);
    copy_tensor(splits, host, stream);
    graph.launch();
    const Tensor replayed = to_host(offsets);
    GroupLayout::compute(splits, cap, eager, &flag, stream);  // eager run on the same splits
    synchronize(stream);
    EXPECT_TRUE(bitwise_equal(replayed, to_host(eager)));
    if (step == 3)
      EXPECT_MOE_ERROR(flag.check(stream), ErrorCode::kDeviceReported,
                       "splits[7] = -2 is negative");
    else
      EXPECT_NO_THROW(flag.check(stream));
  }
  cudaStreamDestroy(stream);
}

TEST_F(Gpu, GroupLayoutOnCudaNeedsAnErrorFlag) {
  Tensor splits = to_gpu(splits_tensor<int64_t>({3, 5}));
  Tensor offsets = Tensor::empty({3}, DType::kInt64, Device::cuda(0));
  DeviceErrorFlag flag(Device::cuda(0));
  EXPECT_NO_THROW(GroupLayout::compute(splits, 8, offsets, &flag));
  EXPECT_MOE_ERROR(GroupLayout::compute(splits, 8, offsets), ErrorCode::kInvalidArgument,
                   "on CUDA a DeviceErrorFlag is required");
  flag.check();
}

}  // namespace
}  // namespace moe::test
