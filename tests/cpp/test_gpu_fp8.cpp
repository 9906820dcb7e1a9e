// GPU FP8 block scaling (label "gpu"): the CUDA quantizers bit for bit against the CPU quantizer
// (data bytes, scale bits, column offsets, and the poison they must leave) over odd routings with
// inf/NaN inputs and every recipe; bad splits contained; graph replay of the quantizers; the
// dequantizer bit for bit against the CPU's (every code and kind of scale, ragged K, strided and
// misaligned outputs, bad splits, graph replay with new routings) and its bandwidth; the three
// FP8 GEMMs against the float64 oracle of the dequantized operands (the measured error is printed)
// and against the bf16 GEMM, wgrad modes, bias epilogues, poison past the routed rows, and a
// captured quantize + forward + dgrad + wgrad step replayed with new routings. Skips without a GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <numeric>

#include "fp8_support.hpp"
#include "gpu_support.hpp"
#include "oracle/fp8_oracle.hpp"

namespace moe::test {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

const Device kGpu = Device::cuda(0);

struct Fp8Case {
  const char* name;
  std::vector<int64_t> splits;
  int64_t capacity, n, k;
};

// Empty and 1-row experts, one expert with every token, G = 1 and G = 256, capacity > sum(splits),
// N and K multiples of 16, some not of 128, and sizes large enough for many blocks per expert.
std::vector<Fp8Case> gpu_fp8_cases() {
  Rng rng;
  std::vector<int64_t> many = random_splits(rng, 256, 40);
  std::vector<int64_t> big(8);
  for (auto& v : big) v = rng.integer(0, 700);
  const auto sum = [](const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t(0)); };
  return {
      {"single_expert", {300}, 320, 144, 208},
      {"empty_and_one_row", {0, 1, 37, 0, 129}, 180, 64, 48},
      {"one_expert_takes_all", {0, 0, 777, 0}, 800, 528, 272},
      {"g256", many, sum(many) + 13, 96, 128},
      {"long_k_many_blocks", big, sum(big) + 5, 1040, 784},
  };
}

class GpuFp8 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

class GpuFp8Dtypes : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  }
};

// Random values of mixed magnitudes (rows from 1e-5 to 1e3, a few zero rows) with a few infinities
// and NaNs sprinkled in: every special tile of the rule shows up.
Tensor mixed_tensor(int64_t T, int64_t K, DType dtype, Rng& rng, bool non_finite = true) {
  Tensor t = Tensor::empty({T, K}, dtype);
  oracle::Vector v(size_t(T * K));
  for (int64_t r = 0; r < T; ++r) {
    const double scale = r % 13 == 4 ? 0.0 : std::pow(10.0, rng.uniform(-5, 3));
    for (int64_t k = 0; k < K; ++k) v[size_t(r * K + k)] = rng.normal(scale);
  }
  if (non_finite)
    for (int i = 0; i < 3; ++i) {
      v[size_t(rng.integer(0, T * K - 1))] = std::numeric_limits<double>::infinity();
      v[size_t(rng.integer(0, T * K - 1))] = std::numeric_limits<double>::quiet_NaN();
    }
  oracle::assign(t, v);
  return t;
}

const Fp8Recipe kRecipes[] = {{}, {true, 0.f}, {false, 1e-4f}};

void expect_same_bytes(const TensorView& gpu, const TensorView& cpu, const char* what) {
  const Tensor got = to_host(gpu);
  EXPECT_TRUE(bitwise_equal(got, cpu)) << what << " differs from the CPU quantizer (or wrote past its end)";
}

// ---- quantizers: bit for bit the CPU's ----

TEST_P(GpuFp8Dtypes, QuantizeRowsAndColumnsBitIdenticalToCpu) {
  const DType dt = GetParam();
  Rng rng;
  for (const Fp8Case& c : gpu_fp8_cases())
    for (const Fp8Recipe& recipe : kRecipes) {
      SCOPED_TRACE(std::string(c.name) + (recipe.pow2_scales ? ", pow2" : recipe.amax_epsilon > 0 ? ", epsilon" : ""));
      DualRouting r(c.splits, c.capacity);
      const int64_t T = c.capacity, G = r.cpu.num_groups(), K = c.k;
      Tensor x = mixed_tensor(T, K, dt, rng);
      OwnedRows rows(T, K);
      OwnedColumns cols(T, G, K);
      quantize_fp8(x, r.cpu.layout, rows.view(), cols.view(), recipe);
      const Tensor xd = to_gpu(x);
      OwnedRows rows_d(T, K, kGpu);
      OwnedColumns cols_d(T, G, K, kGpu);
      quantize_fp8(xd, r.gpu, rows_d.view(), cols_d.view(), recipe);
      expect_same_bytes(rows_d.data, rows.data, "rows.data");
      expect_same_bytes(rows_d.scales, rows.scales, "rows.scales");
      expect_same_bytes(cols_d.data, cols.data, "columns.data");
      expect_same_bytes(cols_d.scales, cols.scales, "columns.scales");
      expect_same_bytes(cols_d.offsets, cols.offsets, "columns.offsets");
      // Rows only and columns only: the other kernels, the same bytes.
      OwnedRows rows_only(T, K, kGpu);
      OwnedColumns cols_only(T, G, K, kGpu);
      quantize_fp8(xd, r.gpu, rows_only.view(), {}, recipe);
      quantize_fp8(xd, r.gpu, {}, cols_only.view(), recipe);
      expect_same_bytes(rows_only.data, rows.data, "rows.data (rows only)");
      expect_same_bytes(rows_only.scales, rows.scales, "rows.scales (rows only)");
      expect_same_bytes(cols_only.data, cols.data, "columns.data (columns only)");
      expect_same_bytes(cols_only.scales, cols.scales, "columns.scales (columns only)");
      EXPECT_NO_THROW(r.flag.check());
    }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuFp8Dtypes, ::testing::Values(DType::kBFloat16, DType::kFloat16, DType::kFloat32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Rows whose stride is not a multiple of 16 bytes take the kernels' element-wise loads; a pitch
// wider than T; the same bytes.
TEST_F(GpuFp8, QuantizeStridedInputAndWiderPitch) {
  Rng rng;
  DualRouting r({70, 0, 1, 200}, 300);
  const int64_t T = 300, K = 160, ld = K + 4;  // 328-byte bf16 rows
  Tensor wide = mixed_tensor(T, ld, DType::kBFloat16, rng);
  const TensorView x(wide.data(), {T, K}, {ld, 1}, DType::kBFloat16, Device::cpu());
  const Tensor wide_d = to_gpu(wide);
  const TensorView xd(wide_d.data(), {T, K}, {ld, 1}, DType::kBFloat16, kGpu);
  OwnedRows rows(T, K, Device::cpu(), 320);
  OwnedColumns cols(T, 4, K);
  quantize_fp8(x, r.cpu.layout, rows.view(), cols.view());
  OwnedRows rows_d(T, K, kGpu, 320);
  OwnedColumns cols_d(T, 4, K, kGpu);
  quantize_fp8(xd, r.gpu, rows_d.view(), cols_d.view());
  expect_same_bytes(rows_d.data, rows.data, "rows.data");
  expect_same_bytes(rows_d.scales, rows.scales, "rows.scales");
  expect_same_bytes(cols_d.data, cols.data, "columns.data");
  expect_same_bytes(cols_d.scales, cols.scales, "columns.scales");
}

TEST_F(GpuFp8, QuantizeWeightBitIdenticalToCpuPackedAndPerExpert) {
  Rng rng;
  const int64_t G = 5, N = 272, K = 144;
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
    for (const Fp8Recipe& recipe : kRecipes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (recipe.pow2_scales ? ", pow2" : recipe.amax_epsilon > 0 ? ", epsilon" : ""));
      const Tensor flat = mixed_tensor(G * N, K, dt, rng);
      Tensor w = Tensor::empty({G, N, K}, dt);
      std::memcpy(w.data(), flat.data(), flat.nbytes());
      OwnedWeight cpu(G, N, K);
      quantize_fp8_weight(GroupedParam::packed(w), cpu.view(), recipe);
      const Tensor wd = to_gpu(w);
      const PerExpertCopy experts(wd);
      for (bool per_expert : {false, true}) {
        SCOPED_TRACE(per_expert ? "per-expert" : "packed");
        const GroupedParam W = per_expert ? experts.param : GroupedParam::packed(wd);
        OwnedWeight gpu(G, N, K, kGpu);
        quantize_fp8_weight(W, gpu.view(), recipe);
        expect_same_bytes(gpu.data, cpu.data, "data");
        expect_same_bytes(gpu.scales, cpu.scales, "scales");
        expect_same_bytes(gpu.data_t, cpu.data_t, "data_t");
        expect_same_bytes(gpu.scales_t, cpu.scales_t, "scales_t");
        OwnedWeight only_data(G, N, K, kGpu), only_t(G, N, K, kGpu);
        quantize_fp8_weight(W, {only_data.data, only_data.scales, {}, {}}, recipe);
        quantize_fp8_weight(W, {{}, {}, only_t.data_t, only_t.scales_t}, recipe);
        expect_same_bytes(only_data.data, cpu.data, "data (data only)");
        expect_same_bytes(only_t.data_t, cpu.data_t, "data_t (data_t only)");
        EXPECT_TRUE(tail_untouched(to_host(only_data.data_t), 0) && tail_untouched(to_host(only_t.data), 0));
      }
    }
}

// Bad splits: the offsets are clamped on the device, nothing is written past the capacity (rows) or
// past the clamped experts' columns, and the error flag reports the splits.
TEST_F(GpuFp8, QuantizeBadSplitsAreContainedAndReported) {
  Rng rng;
  const int64_t G = 6, T = 700, K = 64;
  const Tensor x = to_gpu(mixed_tensor(T, K, DType::kBFloat16, rng, false));
  const int64_t C = fp8_columns_capacity(T, G), guard = 128;
  for (const std::vector<int64_t>& s : {std::vector<int64_t>{100, -50, 200, 30, 0, 10},
                                        std::vector<int64_t>{300, 300, 300, 300, 0, 1}}) {
    Tensor splits = to_gpu(splits_tensor_for(s));
    Tensor offsets = Tensor::empty({G + 1}, DType::kInt64, kGpu);
    DeviceErrorFlag flag(kGpu);
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag);
    // Buffers with guard space after what the op sees.
    Tensor rows_data = poisoned_on({T + 64, K}, DType::kFloat8E4M3, kGpu);
    Tensor rows_scales = poisoned_on({1, fp8_scales_pitch(T) + 64}, DType::kFloat32, kGpu);
    Tensor cols_data = poisoned_on({K, C + guard}, DType::kFloat8E4M3, kGpu);
    Tensor cols_scales = poisoned_on({C / 128 + 2, K}, DType::kFloat32, kGpu);
    Tensor cols_offsets = poisoned_on({G + 1}, DType::kInt64, kGpu);
    const Fp8Rows rows{rows_data.view().slice(0, T),
                       TensorView(rows_scales.data(), {1, fp8_scales_pitch(T)}, {fp8_scales_pitch(T) + 64, 1},
                                  DType::kFloat32, kGpu)};
    const Fp8Columns cols{TensorView(cols_data.data(), {K, C}, {C + guard, 1}, DType::kFloat8E4M3, kGpu),
                          cols_scales.view().slice(0, C / 128), cols_offsets};
    quantize_fp8(x, groups, rows, cols);
    const Tensor host_offsets = to_host(offsets), host_cols = to_host(cols_offsets);
    const int64_t end = host_offsets.data_as<int64_t>()[G], last_column = host_cols.data_as<int64_t>()[G];
    EXPECT_LE(end, T);
    EXPECT_LE(last_column, C);
    EXPECT_TRUE(tail_untouched(to_host(rows_data), end)) << "rows past the clamped end were written";
    const Tensor rs = to_host(rows_scales);
    EXPECT_TRUE(tail_untouched(rs.view().reshape({rs.numel()}), end)) << "scales past the clamped end were written";
    const Tensor cd = to_host(cols_data);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = last_column; c < C + guard; ++c)
        ASSERT_EQ(cd.data_as<uint8_t>()[k * (C + guard) + c], kPoison) << "column " << c << " written";
    EXPECT_TRUE(tail_untouched(to_host(cols_scales), last_column / 128)) << "column blocks past the end written";
    EXPECT_MOE_ERROR(flag.check(), ErrorCode::kDeviceReported, "splits");
  }
}

// Problems with several tiles for every block of the quantizers' grid (a few per SM): each stage
// of the ring is filled and refilled, and a block's share of column blocks crosses experts. Bit for
// bit the CPU's, for both forms at once and each alone.
TEST_F(GpuFp8, QuantizeLargeProblemsBitIdenticalToCpu) {
  Rng rng;
  std::vector<int64_t> eight(8), many = random_splits(rng, 256, 60), more = random_splits(rng, 1500, 20);
  for (auto& v : eight) v = rng.integer(300, 1500);
  const auto sum = [](const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t(0)); };
  // 1500 experts: past the columns kernel's shared table of experts (it searches the offsets).
  const Fp8Case cases[] = {{"8 experts", eight, sum(eight) + 100, 0, 2048},
                           {"256 experts", many, sum(many) + 3, 0, 1024},
                           {"1500 experts", more, sum(more) + 5, 0, 256}};
  for (const Fp8Case& c : cases)
    for (const Fp8Recipe& recipe : {Fp8Recipe{}, Fp8Recipe{true, 0.f}}) {
      SCOPED_TRACE(std::string(c.name) + (recipe.pow2_scales ? ", pow2" : ""));
      DualRouting r(c.splits, c.capacity);
      const int64_t T = c.capacity, G = r.cpu.num_groups(), K = c.k;
      const Tensor x = mixed_tensor(T, K, DType::kBFloat16, rng);
      OwnedRows rows(T, K);
      OwnedColumns cols(T, G, K);
      quantize_fp8(x, r.cpu.layout, rows.view(), cols.view(), recipe);
      const Tensor xd = to_gpu(x);
      OwnedRows rows_d(T, K, kGpu), rows_only(T, K, kGpu);
      OwnedColumns cols_d(T, G, K, kGpu), cols_only(T, G, K, kGpu);
      quantize_fp8(xd, r.gpu, rows_d.view(), cols_d.view(), recipe);
      quantize_fp8(xd, r.gpu, rows_only.view(), {}, recipe);
      quantize_fp8(xd, r.gpu, {}, cols_only.view(), recipe);
      expect_same_bytes(rows_d.data, rows.data, "rows.data");
      expect_same_bytes(rows_d.scales, rows.scales, "rows.scales");
      expect_same_bytes(cols_d.data, cols.data, "columns.data");
      expect_same_bytes(cols_d.scales, cols.scales, "columns.scales");
      expect_same_bytes(cols_d.offsets, cols.offsets, "columns.offsets");
      expect_same_bytes(rows_only.data, rows.data, "rows.data (rows only)");
      expect_same_bytes(rows_only.scales, rows.scales, "rows.scales (rows only)");
      expect_same_bytes(cols_only.data, cols.data, "columns.data (columns only)");
      expect_same_bytes(cols_only.scales, cols.scales, "columns.scales (columns only)");
      EXPECT_NO_THROW(r.flag.check());
    }
}

TEST_F(GpuFp8, QuantizeLargeWeightBitIdenticalToCpu) {
  Rng rng;
  const int64_t G = 8, N = 1040, K = 2048;  // 8 x 9 x 16 blocks, the last row of blocks partial
  const Tensor flat = mixed_tensor(G * N, K, DType::kBFloat16, rng);
  Tensor w = Tensor::empty({G, N, K}, DType::kBFloat16);
  std::memcpy(w.data(), flat.data(), flat.nbytes());
  OwnedWeight cpu(G, N, K), gpu(G, N, K, kGpu);
  quantize_fp8_weight(GroupedParam::packed(w), cpu.view());
  quantize_fp8_weight(GroupedParam::packed(to_gpu(w)), gpu.view());
  expect_same_bytes(gpu.data, cpu.data, "data");
  expect_same_bytes(gpu.scales, cpu.scales, "scales");
  expect_same_bytes(gpu.data_t, cpu.data_t, "data_t");
  expect_same_bytes(gpu.scales_t, cpu.scales_t, "scales_t");
}

// A kernel's bandwidth next to a device-to-device copy of the same bytes timed in the same run
// (cudaMemcpyAsync of half of them: read + written), both on `stream`: medians of 5 rounds
// alternating copy and kernel, 10 launches each, after one untimed launch of each. Printed for the
// performance log; no bound is asserted (timings vary with the machine and its load).
class CopyReferencedBandwidth {
 public:
  // Kernels of up to 2 copy_capacity bytes read + written.
  CopyReferencedBandwidth(cudaStream_t stream, int64_t copy_capacity)
      : stream_(stream),
        timer_(kGpu, stream),
        capacity_(copy_capacity),
        src_(Tensor::empty({copy_capacity}, DType::kUInt8, kGpu)),
        dst_(Tensor::empty({copy_capacity}, DType::kUInt8, kGpu)) {}

  // "[ measure  ] <what>: ms, GB/s (read + written); the copy's; the fraction of the copy's rate".
  void report(const std::string& what, double bytes, const std::function<void()>& run) {
    ASSERT_LE(bytes / 2, double(capacity_));
    const auto copy = [&] {
      CUDA_OK(cudaMemcpyAsync(dst_.data(), src_.data(), size_t(bytes / 2), cudaMemcpyDeviceToDevice, stream_));
    };
    run();
    copy();
    std::vector<double> kernel, reference;
    for (int round = 0; round < 5; ++round) {
      reference.push_back(time_ms(copy));
      kernel.push_back(time_ms(run));
    }
    const double ms = median(kernel), copy_ms = median(reference);
    std::printf("[ measure  ] %s: %.3f ms, %.0f GB/s (read + written); copy of the same bytes %.3f ms, "
                "%.0f GB/s: %.2f of the copy\n",
                what.c_str(), ms, bytes / ms * 1e-6, copy_ms, bytes / copy_ms * 1e-6, copy_ms / ms);
  }

 private:
  double time_ms(const std::function<void()>& run) {
    timer_.start();
    for (int i = 0; i < 10; ++i) run();
    timer_.stop();
    return timer_.elapsed_ms() / 10;
  }
  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }

  cudaStream_t stream_;
  StreamTimer timer_;
  int64_t capacity_;
  Tensor src_, dst_;
};

// The quantizers' bandwidth on the suite's shapes (bytes read + written per second: x once, each
// FP8 copy once with the columns' zero padding, scales not counted) against a same-run copy
// (CopyReferencedBandwidth).
TEST_F(GpuFp8, QuantizerBandwidthIsReported) {
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const ExecContext ctx{stream, {}};
  // The weight moves 3.8 GB: copies of up to half that.
  CopyReferencedBandwidth bandwidth(stream, int64_t(1) << 31);
  const auto report = [&](const std::string& what, double bytes, const std::function<void()>& run) {
    bandwidth.report("quantize " + what, bytes, run);
  };
  struct TokenShape {
    const char* name;
    int64_t K;
    std::vector<int64_t> splits;
  };
  // Mixtral's mild routing (8 experts, 16384 tokens) and 256 experts of 32 .. 224 tokens (32640).
  const std::vector<int64_t> mixtral{1790, 1767, 1423, 1398, 1881, 1748, 2553, 3824};
  std::vector<int64_t> experts256(256);
  for (size_t g = 0; g < experts256.size(); ++g) experts256[g] = 32 + int64_t(g * 37 % 193);
  // Qwen3-30B-A3B's dY: 128 experts of 512 tokens, K = 2048 (16 feature blocks).
  const std::vector<int64_t> experts128(128, 512);
  const TokenShape shapes[] = {{"8 experts", 4096, mixtral},
                               {"8 experts", 28672, mixtral},
                               {"256 experts", 7168, experts256},
                               {"128 experts", 2048, experts128}};
  const Fp8Recipe pow2{true, 0.f};
  for (const TokenShape& shape : shapes) {
    const int64_t T = std::accumulate(shape.splits.begin(), shape.splits.end(), int64_t(0)), K = shape.K;
    const int64_t G = int64_t(shape.splits.size());
    DualRouting r(shape.splits, T);
    int64_t columns = 0;
    for (int64_t s : shape.splits) columns += (s + 127) / 128 * 128;
    Tensor x = Tensor::empty({T, K}, DType::kBFloat16, kGpu);
    fill_uniform(x, 1, -2.f, 2.f);
    OwnedRows rows(T, K, kGpu);
    OwnedColumns cols(T, G, K, kGpu);
    const double x_bytes = 2.0 * double(T * K), rows_bytes = double(T * K), cols_bytes = double(columns * K);
    char name[160];
    std::snprintf(name, sizeof(name), "bf16 x [%lld, %lld], %s", (long long)T, (long long)K, shape.name);
    report(std::string("rows, ") + name, x_bytes + rows_bytes,
           [&] { quantize_fp8(x, r.gpu, rows.view(), {}, {}, ctx); });
    report(std::string("columns, ") + name, x_bytes + cols_bytes,
           [&] { quantize_fp8(x, r.gpu, {}, cols.view(), {}, ctx); });
    report(std::string("rows + columns, ") + name, x_bytes + rows_bytes + cols_bytes,
           [&] { quantize_fp8(x, r.gpu, rows.view(), cols.view(), {}, ctx); });
    if (K == 4096)
      report(std::string("rows + columns, pow2, ") + name, x_bytes + rows_bytes + cols_bytes,
             [&] { quantize_fp8(x, r.gpu, rows.view(), cols.view(), pow2, ctx); });
    EXPECT_NO_THROW(r.flag.check());
  }
  {
    const int64_t G = 8, N = 28672, K = 4096;
    Tensor w = Tensor::empty({G, N, K}, DType::kBFloat16, kGpu);
    fill_uniform(w, 2, -1.f, 1.f);
    OwnedWeight weight(G, N, K, kGpu);
    const double values = double(G * N * K);
    report("weight data + data_t, bf16 8 x [28672, 4096]", 4 * values,
           [&] { quantize_fp8_weight(GroupedParam::packed(w), weight.view(), {}, ctx); });
    report("weight data, bf16 8 x [28672, 4096]", 3 * values,
           [&] { quantize_fp8_weight(GroupedParam::packed(w), {weight.data, weight.scales, {}, {}}, {}, ctx); });
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
}

// ---- the dequantizer: bit for bit the CPU's ----

// Hand-made rows: random bytes (NaN codes among them) and scales of every kind in a [T, K]
// view whose rows are `data_ld` bytes apart.
struct HandRows {
  Tensor data, scales;
  Fp8Rows view;
  HandRows(int64_t T, int64_t K, int64_t data_ld, Rng& rng, Device device = Device::cpu()) {
    Tensor d = poisoned({std::max<int64_t>(1, T * data_ld)}, DType::kFloat8E4M3);
    Tensor s = poisoned({blocks_of(K), fp8_scales_pitch(T) + 4}, DType::kFloat32);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        d.data_as<uint8_t>()[t * data_ld + k] = uint8_t(rng.integer(0, 255));
    const float specials[] = {0.f,
                              std::numeric_limits<float>::denorm_min(),
                              std::numeric_limits<float>::min(),
                              std::numeric_limits<float>::max(),
                              std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN(),
                              -2.5f,
                              1e-30f,
                              3e35f};
    for (int64_t i = 0; i < s.numel(); ++i)
      s.data_as<float>()[i] =
          i % 5 == 0 ? specials[size_t(i / 5) % std::size(specials)]
                     : float(std::ldexp(rng.uniform(-1, 1), int(rng.integer(-20, 20))));
    data = d.to(device);
    scales = s.to(device);
    view = {TensorView(data.data(), {T, K}, {data_ld, 1}, DType::kFloat8E4M3, device), scales};
  }
};

// Rows quantized on the CPU from x with non-finite tiles, on the suite's routings: the GPU's output
// is the CPU's, bytes past the routed rows (poison) included.
TEST_P(GpuFp8Dtypes, DequantizeBitIdenticalToCpu) {
  const DType dt = GetParam();
  Rng rng;
  for (const Fp8Case& c : gpu_fp8_cases()) {
    SCOPED_TRACE(c.name);
    DualRouting r(c.splits, c.capacity);
    const int64_t T = c.capacity, K = c.k;
    OwnedRows rows(T, K);
    quantize_fp8(mixed_tensor(T, K, DType::kBFloat16, rng), r.cpu.layout, rows.view(), {});
    Tensor want = poisoned({T, K}, dt);
    dequantize_fp8(rows.view(), r.cpu.layout, want);
    const OwnedRows rows_d = rows.to(kGpu);
    Tensor out = poisoned_gpu({T, K}, dt);
    dequantize_fp8(rows_d.view(), r.gpu, out);
    const Tensor got = to_host(out);
    EXPECT_TRUE(bitwise_equal(got, want)) << "differs from the CPU dequantizer";
    EXPECT_TRUE(tail_untouched(got, r.cpu.rows())) << "rows past sum(splits) were written";
    EXPECT_NO_THROW(r.flag.check());
  }
}

// Every code and kind of scale; K off a multiple of 16 (a ragged last chunk) and below 16; out rows
// strided off 16 bytes or shifted by one element (element stores); one row; more chunks than the
// grid has threads. The whole output buffer (gaps between rows, guard after the last) equals the
// CPU's, for every output dtype.
TEST_F(GpuFp8, DequantizeOddShapesAndStridesBitIdenticalToCpu) {
  Rng rng;
  std::vector<int64_t> eight(8);
  for (auto& v : eight) v = rng.integer(1500, 3000);
  const int64_t eight_rows = std::accumulate(eight.begin(), eight.end(), int64_t(0));
  struct Case {
    const char* name;
    std::vector<int64_t> splits;
    int64_t T, K, data_ld, out_ld, out_shift;
  };
  const Case cases[] = {
      {"K 200, ragged last chunk", {7, 0, 20, 1}, 40, 200, 208, 200, 0},
      {"K 8, one ragged chunk", {3, 2}, 8, 8, 16, 8, 0},
      {"out rows strided off 16 bytes", {50, 0, 13}, 70, 256, 256, 261, 0},
      {"out shifted by one element", {5, 5}, 16, 144, 144, 144, 1},
      {"one row", {1}, 1, 16, 16, 16, 0},
      {"many chunks per thread", eight, eight_rows + 9, 2048, 2048, 2048, 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    DualRouting r(c.splits, c.T);
    const HandRows rows(c.T, c.K, c.data_ld, rng);
    const HandRows rows_d = [&] {
      HandRows copy = rows;
      copy.data = rows.data.to(kGpu);
      copy.scales = rows.scales.to(kGpu);
      copy.view = {
          TensorView(copy.data.data(), {c.T, c.K}, {c.data_ld, 1}, DType::kFloat8E4M3, kGpu),
          copy.scales};
      return copy;
    }();
    for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      SCOPED_TRACE(dtype_name(dt));
      const int64_t elements =
          c.out_shift + (c.T - 1) * c.out_ld + c.K + 64;  // 64 elements of guard
      Tensor want = poisoned({elements}, dt);
      const auto at = [&](const Tensor& buffer, Device device) {
        return TensorView(static_cast<char*>(buffer.data()) + c.out_shift * int64_t(dtype_size(dt)),
                          {c.T, c.K}, {c.out_ld, 1}, dt, device);
      };
      dequantize_fp8(rows.view, r.cpu.layout, at(want, Device::cpu()));
      Tensor out = poisoned_gpu({elements}, dt);
      dequantize_fp8(rows_d.view, r.gpu, at(out, kGpu));
      EXPECT_TRUE(bitwise_equal(to_host(out), want)) << "differs from the CPU dequantizer";
    }
    EXPECT_NO_THROW(r.flag.check());
  }
}

// Bad splits: the offsets are clamped on the device; nothing is written past the capacity.
TEST_F(GpuFp8, DequantizeBadSplitsWriteNothingPastTheCapacity) {
  Rng rng;
  const int64_t G = 4, T = 300, K = 160;
  const HandRows rows(T, K, K, rng, kGpu);
  for (const std::vector<int64_t>& s :
       {std::vector<int64_t>{100, -50, 150, 10}, std::vector<int64_t>{200, 200, 0, 1}}) {
    Tensor splits = to_gpu(splits_tensor_for(s));
    Tensor offsets = Tensor::empty({G + 1}, DType::kInt64, kGpu);
    DeviceErrorFlag flag(kGpu);
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag);
    Tensor out = poisoned_gpu({T + 32, K}, DType::kBFloat16);
    dequantize_fp8(rows.view, groups, out.view().slice(0, T));
    const int64_t end = to_host(offsets).data_as<int64_t>()[G];
    EXPECT_LE(end, T);
    EXPECT_TRUE(tail_untouched(to_host(out), end)) << "rows past the clamped end were written";
    EXPECT_MOE_ERROR(flag.check(), ErrorCode::kDeviceReported, "splits");
  }
}

// The dequantizer's bandwidth (E4M3 read + output written, scales not counted) against a same-run
// copy (CopyReferencedBandwidth).
TEST_F(GpuFp8, DequantizeBandwidthIsReported) {
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const ExecContext ctx{stream, {}};
  CopyReferencedBandwidth bandwidth(stream, int64_t(1) << 30);
  const std::vector<int64_t> mixtral{1790, 1767, 1423, 1398,
                                     1881, 1748, 2553, 3824};  // 16384 tokens
  const int64_t T = std::accumulate(mixtral.begin(), mixtral.end(), int64_t(0));
  DualRouting r(mixtral, T);
  const std::pair<int64_t, DType> shapes[] = {
      {4096, DType::kBFloat16}, {28672, DType::kBFloat16}, {4096, DType::kFloat32}};
  for (const auto& [K, dt] : shapes) {
    Tensor x = Tensor::empty({T, K}, DType::kBFloat16, kGpu);
    fill_uniform(x, 3, -2.f, 2.f);
    OwnedRows rows(T, K, kGpu);
    quantize_fp8(x, r.gpu, rows.view(), {});
    Tensor out = Tensor::empty({T, K}, dt, kGpu);
    char what[96];
    std::snprintf(what, sizeof(what), "dequantize [%lld, %lld] to %s", (long long)T, (long long)K, dtype_name(dt));
    bandwidth.report(what, double(T * K) * (1.0 + double(dtype_size(dt))),
                     [&] { dequantize_fp8(rows.view(), r.gpu, out, ctx); });
  }
  EXPECT_NO_THROW(r.flag.check());
  CUDA_OK(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
}

// ---- CUDA graphs ----

class GpuFp8Graph : public GpuFp8 {};

// The quantizers captured once after an eager call, replayed with new routings (an empty one
// included): every replay equals an eager run and the CPU quantizer, bit for bit.
TEST_F(GpuFp8Graph, QuantizersReplayedWithNewRoutingsEqualEagerAndCpu) {
  Rng rng;
  const int64_t G = 16, T = 2048, K = 400;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Tensor x_host = mixed_tensor(T, K, DType::kBFloat16, rng);
  const Tensor x = to_gpu(x_host);
  Tensor splits = Tensor::empty({G}, DType::kInt64, kGpu), offsets = Tensor::empty({G + 1}, DType::kInt64, kGpu);
  OwnedRows rows(T, K, kGpu);
  OwnedColumns cols(T, G, K, kGpu);
  DeviceErrorFlag flag(kGpu);
  const ExecContext ctx{stream, {}};
  auto step = [&] {
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag, stream);
    quantize_fp8(x, groups, rows.view(), cols.view(), {true, 0.f}, ctx);
  };
  auto reset = [&] {
    for (const Tensor* t : {&rows.data, &rows.scales, &cols.data, &cols.scales, &cols.offsets})
      fill_bytes(*t, kPoison, stream);
  };
  copy_tensor(splits, splits_tensor_for(random_splits_within(rng, G, T)), stream);
  step();
  CUDA_OK(cudaStreamSynchronize(stream));
  CapturedGraph graph(stream, step);
  for (int replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE("routing " + std::to_string(replay));
    std::vector<int64_t> s = random_splits_within(rng, G, T);
    if (replay == 2) s.assign(size_t(G), 0), s[5] = T - 3;
    if (replay == 3) s.assign(size_t(G), 0);
    copy_tensor(splits, splits_tensor_for(s), stream);
    reset();
    graph.launch();
    const Tensor rd = to_host(rows.data), rs = to_host(rows.scales), cd = to_host(cols.data),
                 cs = to_host(cols.scales), co = to_host(cols.offsets);
    reset();
    step();
    CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_TRUE(bitwise_equal(to_host(rows.data), rd) && bitwise_equal(to_host(rows.scales), rs)) << "rows";
    EXPECT_TRUE(bitwise_equal(to_host(cols.data), cd) && bitwise_equal(to_host(cols.scales), cs) &&
                bitwise_equal(to_host(cols.offsets), co))
        << "columns";
    Routing cpu_routing(s, T);
    OwnedRows rows_cpu(T, K);
    OwnedColumns cols_cpu(T, G, K);
    quantize_fp8(x_host, cpu_routing.layout, rows_cpu.view(), cols_cpu.view(), {true, 0.f});
    EXPECT_TRUE(bitwise_equal(rd, rows_cpu.data) && bitwise_equal(rs, rows_cpu.scales)) << "rows vs the CPU";
    EXPECT_TRUE(bitwise_equal(cd, cols_cpu.data) && bitwise_equal(cs, cols_cpu.scales) &&
                bitwise_equal(co, cols_cpu.offsets))
        << "columns vs the CPU";
    EXPECT_NO_THROW(flag.check(stream));
  }
  cudaStreamDestroy(stream);
}

// The dequantizer captured once (with the offsets' computation) and replayed with new routings,
// one taking nearly every row and an empty one included: every replay equals an eager run and the
// CPU, bit for bit, rows past the routed ones untouched.
TEST_F(GpuFp8Graph, DequantizeReplayedWithNewRoutingsEqualsEagerAndCpu) {
  Rng rng;
  const int64_t G = 16, T = 2048, K = 400;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Routing every_row({T}, T);
  OwnedRows rows(T, K);
  quantize_fp8(mixed_tensor(T, K, DType::kBFloat16, rng), every_row.layout, rows.view(), {});
  const OwnedRows rows_d = rows.to(kGpu);
  Tensor splits = Tensor::empty({G}, DType::kInt64, kGpu),
         offsets = Tensor::empty({G + 1}, DType::kInt64, kGpu);
  Tensor out = poisoned_gpu({T, K}, DType::kBFloat16);
  DeviceErrorFlag flag(kGpu);
  const ExecContext ctx{stream, {}};
  auto step = [&] {
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag, stream);
    dequantize_fp8(rows_d.view(), groups, out, ctx);
  };
  copy_tensor(splits, splits_tensor_for(random_splits_within(rng, G, T)), stream);
  step();  // eager first: one-time setup outside the capture
  CUDA_OK(cudaStreamSynchronize(stream));
  CapturedGraph graph(stream, step);
  for (int replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE("routing " + std::to_string(replay));
    std::vector<int64_t> s = random_splits_within(rng, G, T);
    if (replay == 2) s.assign(size_t(G), 0), s[5] = T - 3;
    if (replay == 3) s.assign(size_t(G), 0);
    copy_tensor(splits, splits_tensor_for(s), stream);
    fill_bytes(out, kPoison, stream);
    graph.launch();
    const Tensor replayed = to_host(out);
    fill_bytes(out, kPoison, stream);
    step();
    CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_TRUE(bitwise_equal(to_host(out), replayed)) << "replay vs eager";
    Routing cpu_routing(s, T);
    Tensor want = poisoned({T, K}, DType::kBFloat16);
    dequantize_fp8(rows.view(), cpu_routing.layout, want);
    EXPECT_TRUE(bitwise_equal(replayed, want)) << "replay vs the CPU";
    EXPECT_TRUE(tail_untouched(replayed, cpu_routing.rows()))
        << "rows past sum(splits) were written";
    EXPECT_NO_THROW(flag.check(stream));
  }
  cudaStreamDestroy(stream);
}

// ---- the GEMMs (the Hopper FP8 kernel) ----

// Operands quantized on the GPU, and their host copies for the oracle.
struct GpuFp8Problem {
  DualRouting routing;
  Tensor x, w, dy;  // host, bf16
  Tensor xd, wd, dyd;
  OwnedRows x_rows, dy_rows;
  OwnedColumns x_cols, dy_cols;
  OwnedWeight weight;

  GpuFp8Problem(const Fp8Case& c, Rng& rng)
      : routing(c.splits, c.capacity),
        x(random_tensor({c.capacity, c.k}, DType::kBFloat16, rng)),
        w(random_tensor({int64_t(c.splits.size()), c.n, c.k}, DType::kBFloat16, rng, 1.0 / std::sqrt(double(c.k)))),
        dy(random_tensor({c.capacity, c.n}, DType::kBFloat16, rng)),
        xd(to_gpu(x)),
        wd(to_gpu(w)),
        dyd(to_gpu(dy)),
        x_rows(c.capacity, c.k, kGpu),
        dy_rows(c.capacity, c.n, kGpu),
        x_cols(c.capacity, int64_t(c.splits.size()), c.k, kGpu),
        dy_cols(c.capacity, int64_t(c.splits.size()), c.n, kGpu),
        weight(int64_t(c.splits.size()), c.n, c.k, kGpu) {
    quantize_fp8(xd, routing.gpu, x_rows.view(), x_cols.view());
    quantize_fp8(dyd, routing.gpu, dy_rows.view(), dy_cols.view());
    quantize_fp8_weight(GroupedParam::packed(wd), weight.view());
    synchronize(nullptr);
  }
  const oracle::Splits& splits() const { return routing.cpu.splits; }
  int64_t rows() const { return routing.cpu.rows(); }
};

// The tensor core sums each 128-long block with limited precision before the float32 promotion:
// the error bound grows with the square root of the number of blocks. bfloat16 outputs add their
// rounding, half an ulp of the largest value (up to 2^-8 of it: an ulp is 2^-7 of the value's power
// of two).
double gemm_bound(int64_t contraction, const oracle::Matrix& ref, DType out) {
  const double blocks = double(std::max<int64_t>(1, (contraction + 127) / 128));
  double bound = 2e-3 * std::sqrt(blocks);
  if (out == DType::kBFloat16) {
    double sq = 0, top = 0;
    for (double v : ref.data) sq += v * v, top = std::max(top, std::fabs(v));
    const double rms = std::sqrt(sq / double(std::max<size_t>(1, ref.data.size())));
    bound += std::ldexp(1.0, -8) * (rms > 0 ? top / rms : 0) * 1.01;
  }
  return bound;
}

// GPU result vs the oracle (bounded, and the measured error printed so that the bound can be
// tightened) and vs the bf16 GEMM of the original inputs (DeepGEMM's similarity).
void expect_gemm_close(const oracle::Matrix& got, const oracle::Matrix& oracle_ref, const oracle::Matrix& bf16_ref,
                       int64_t contraction, DType out, const std::string& what) {
  const double err = max_error_vs_rms(got, oracle_ref), bound = gemm_bound(contraction, oracle_ref, out);
  const double diff = similarity_diff(got, bf16_ref);
  std::printf("[ measure  ] %s: max |gpu - oracle| / rms = %.3g (bound %.3g), similarity diff vs bf16 = %.3g\n",
              what.c_str(), err, bound, diff);
  ::testing::Test::RecordProperty(what + " max_error_vs_rms", std::to_string(err));
  EXPECT_LE(err, bound) << what << " vs the oracle of the dequantized operands";
  EXPECT_LT(diff, 1e-3) << what << " vs the bf16 GEMM";
}

TEST_F(GpuFp8, ForwardVsOracleAndBf16EveryBiasModeAndOutputDtype) {
  MOE_SKIP_WITHOUT_HOPPER();
  Rng rng;
  for (const Fp8Case& c : gpu_fp8_cases()) {
    SCOPED_TRACE(c.name);
    GpuFp8Problem p(c, rng);
    const int64_t T = c.capacity, G = p.routing.cpu.num_groups();
    const Tensor b = random_tensor({G, c.n}, DType::kBFloat16, rng);
    const Tensor prob = uniform_tensor({T}, DType::kFloat32, rng, 0, 1);
    const Tensor bd = to_gpu(b), probd = to_gpu(prob);
    const OwnedRows x_rows = p.x_rows.to(Device::cpu());
    const OwnedWeight weight = p.weight.to(Device::cpu());
    for (int mode = 0; mode < 3; ++mode) {
      // The references once per bias mode (the float64 oracle is slow by design).
      const oracle::Matrix ref = oracle::fp8_linear_forward(
          x_rows.view(), weight.view(), p.splits(), mode ? oracle::to_matrix(b) : oracle::Matrix{},
          mode == 2 ? oracle::to_vector(prob) : oracle::Vector{});
      BiasEpilogue cpu_epi, epi;
      if (mode > 0) cpu_epi.bias = GroupedParam::packed(b), epi.bias = GroupedParam::packed(bd);
      if (mode == 2) cpu_epi.row_scale = prob, epi.row_scale = probd;
      Tensor y16 = poisoned({T, c.n}, DType::kFloat32);
      grouped_linear_forward(p.x, GroupedParam::packed(p.w), p.routing.cpu.layout, y16, cpu_epi);
      const oracle::Matrix bf16_ref = head(oracle::to_matrix(y16), p.rows());
      for (DType out : {DType::kFloat32, DType::kBFloat16}) {
        const std::string what = std::string(c.name) + " forward, " +
                                 (mode == 0 ? "no bias" : mode == 1 ? "bias" : "scale_bias") + ", y " + dtype_name(out);
        SCOPED_TRACE(what);
        Tensor y = poisoned_gpu({T, c.n}, out);
        grouped_linear_forward(p.x_rows.view(), p.weight.view(), p.routing.gpu, y, epi);
        const Tensor got = to_host(y);
        EXPECT_TRUE(tail_untouched(got, p.rows())) << "rows past sum(splits) were written";
        expect_gemm_close(head(oracle::to_matrix(got), p.rows()), ref, bf16_ref, c.k, out, what);
        if (mode > 0 && out == DType::kFloat32) {
          // A float32 bias (a float32 module's) is added after the GEMM: the same values give the
          // epilogue's bits.
          BiasEpilogue epi32 = epi;
          Tensor b32 = Tensor::empty({G, c.n}, DType::kFloat32);
          for (int64_t i = 0; i < b.numel(); ++i) b32.data_as<float>()[i] = float(b.data_as<BFloat16>()[i]);
          b32 = to_gpu(b32);
          epi32.bias = GroupedParam::packed(b32);
          Tensor y32 = poisoned_gpu({T, c.n}, out);
          grouped_linear_forward(p.x_rows.view(), p.weight.view(), p.routing.gpu, y32, epi32);
          EXPECT_TRUE(bitwise_equal(to_host(y32), got)) << "float32 bias vs the bfloat16 epilogue";
        }
      }
    }
    EXPECT_NO_THROW(p.routing.flag.check());
  }
}

TEST_F(GpuFp8, DgradVsOracleAndBf16) {
  MOE_SKIP_WITHOUT_HOPPER();
  Rng rng;
  for (const Fp8Case& c : gpu_fp8_cases()) {
    SCOPED_TRACE(c.name);
    GpuFp8Problem p(c, rng);
    const int64_t T = c.capacity;
    const OwnedRows dy_rows = p.dy_rows.to(Device::cpu());
    const OwnedWeight weight = p.weight.to(Device::cpu());
    const oracle::Matrix ref = oracle::fp8_linear_dgrad(dy_rows.view(), weight.view(), p.splits());
    Tensor dx16 = poisoned({T, c.k}, DType::kFloat32);
    grouped_linear_dgrad(p.dy, GroupedParam::packed(p.w), p.routing.cpu.layout, dx16);
    for (DType out : {DType::kFloat32, DType::kBFloat16}) {
      const std::string what = std::string(c.name) + " dgrad, dx " + dtype_name(out);
      Tensor dx = poisoned_gpu({T, c.k}, out);
      grouped_linear_dgrad(p.dy_rows.view(), p.weight.view(), p.routing.gpu, dx);
      const Tensor got = to_host(dx);
      EXPECT_TRUE(tail_untouched(got, p.rows())) << what << ": rows past sum(splits) were written";
      expect_gemm_close(head(oracle::to_matrix(got), p.rows()), ref, head(oracle::to_matrix(dx16), p.rows()), c.n,
                        out, what);
    }
  }
}

TEST_F(GpuFp8, WgradWriteAccumulateOverwriteVsOracleAndBf16) {
  MOE_SKIP_WITHOUT_HOPPER();
  Rng rng;
  for (const Fp8Case& c : gpu_fp8_cases()) {
    SCOPED_TRACE(c.name);
    GpuFp8Problem p(c, rng);
    const int64_t G = p.routing.cpu.num_groups();
    const OwnedColumns dy_cols = p.dy_cols.to(Device::cpu()), x_cols = p.x_cols.to(Device::cpu());
    const auto ref = oracle::fp8_linear_wgrad(dy_cols.view(), x_cols.view(), p.splits());
    Tensor dw16 = poisoned({G, c.n, c.k}, DType::kFloat32);
    grouped_linear_wgrad(p.dy, p.x, p.routing.cpu.layout, GroupedParam::packed(dw16), GradMode::kWrite);
    const oracle::Matrix bf16_ref = stacked(oracle::to_matrices(GroupedParam::packed(dw16)));
    // The longest expert's contraction sets the bound.
    const int64_t longest = *std::max_element(c.splits.begin(), c.splits.end());
    const std::pair<GradMode, DType> modes[] = {{GradMode::kWrite, DType::kFloat32},
                                                {GradMode::kWrite, DType::kBFloat16},
                                                {GradMode::kAccumulate, DType::kFloat32},
                                                {GradMode::kOverwrite, DType::kFloat32}};
    for (auto [mode, out] : modes) {
      const std::string what = std::string(c.name) + " wgrad, " + grad_mode_name(mode) + ", dW " + dtype_name(out);
      SCOPED_TRACE(what);
      const Tensor start = random_tensor({G, c.n, c.k}, out, rng);
      Tensor dw = to_gpu(start);
      grouped_linear_wgrad(p.dy_cols.view(), p.x_cols.view(), p.routing.gpu, GroupedParam::packed(dw), mode);
      const Tensor got = to_host(dw);
      auto expected = ref;
      oracle::Matrix expected_bf16 = bf16_ref;
      if (mode == GradMode::kAccumulate) {
        const auto before = oracle::to_matrices(GroupedParam::packed(start));
        for (size_t g = 0; g < expected.size(); ++g)
          for (size_t i = 0; i < expected[g].data.size(); ++i) expected[g].data[i] += before[g].data[i];
        const oracle::Matrix b = stacked(before);
        for (size_t i = 0; i < expected_bf16.data.size(); ++i) expected_bf16.data[i] += b.data[i];
      }
      expect_gemm_close(stacked(oracle::to_matrices(GroupedParam::packed(got))), stacked(expected), expected_bf16,
                        longest, out, what);
      // Empty experts: zeros when writing, untouched (bit for bit) when accumulating.
      for (int64_t g = 0; g < G; ++g)
        if (c.splits[size_t(g)] == 0) {
          if (mode == GradMode::kAccumulate)
            EXPECT_TRUE(bitwise_equal(got.view().select(g), start.view().select(g))) << "empty expert " << g;
          else
            for (double v : oracle::to_matrix(got.view().select(g)).data) ASSERT_EQ(v, 0.0) << "empty expert " << g;
        }
    }
  }
}

// Quantize (rows + columns) + forward + dgrad + wgrad (accumulate) captured once and replayed with
// new routings: every replay equals an eager run bit for bit.
TEST_F(GpuFp8Graph, QuantizeAndGemmsCapturedOnceReplayedEqualEager) {
  MOE_SKIP_WITHOUT_HOPPER();
  Rng rng;
  const int64_t G = 16, T = 2048, N = 272, K = 400;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Tensor x = to_gpu(random_tensor({T, K}, DType::kBFloat16, rng));
  const Tensor dy = to_gpu(random_tensor({T, N}, DType::kBFloat16, rng));
  const Tensor w = to_gpu(random_tensor({G, N, K}, DType::kBFloat16, rng, 0.05));
  const Tensor start = to_gpu(random_tensor({G, N, K}, DType::kFloat32, rng));
  Tensor splits = Tensor::empty({G}, DType::kInt64, kGpu), offsets = Tensor::empty({G + 1}, DType::kInt64, kGpu);
  OwnedRows x_rows(T, K, kGpu), dy_rows(T, N, kGpu);
  OwnedColumns x_cols(T, G, K, kGpu), dy_cols(T, G, N, kGpu);
  OwnedWeight weight(G, N, K, kGpu);
  quantize_fp8_weight(GroupedParam::packed(w), weight.view());
  Tensor y = poisoned_gpu({T, N}, DType::kBFloat16), dx = poisoned_gpu({T, K}, DType::kBFloat16), dw = to_gpu(start);
  DeviceErrorFlag flag(kGpu);
  const ExecContext ctx{stream, {}};
  auto step = [&] {
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag, stream);
    quantize_fp8(x, groups, x_rows.view(), x_cols.view(), {}, ctx);
    quantize_fp8(dy, groups, dy_rows.view(), dy_cols.view(), {}, ctx);
    grouped_linear_forward(x_rows.view(), weight.view(), groups, y, {}, ctx);
    grouped_linear_dgrad(dy_rows.view(), weight.view(), groups, dx, ctx);
    grouped_linear_wgrad(dy_cols.view(), x_cols.view(), groups, GroupedParam::packed(dw), GradMode::kAccumulate, ctx);
  };
  auto reset = [&] {
    fill_bytes(y, kPoison, stream);
    fill_bytes(dx, kPoison, stream);
    copy_tensor(dw, start, stream);
  };
  copy_tensor(splits, splits_tensor_for(random_splits_within(rng, G, T)), stream);
  step();  // eager first: one-time setup outside the capture
  CUDA_OK(cudaStreamSynchronize(stream));
  CapturedGraph graph(stream, step);
  for (int replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE("routing " + std::to_string(replay));
    std::vector<int64_t> s = random_splits_within(rng, G, T);
    if (replay == 2) s.assign(size_t(G), 0), s[5] = T - 3;
    copy_tensor(splits, splits_tensor_for(s), stream);
    reset();
    graph.launch();
    const Tensor y1 = to_host(y), dx1 = to_host(dx), dw1 = to_host(dw);
    reset();
    step();
    CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_TRUE(bitwise_equal(to_host(y), y1)) << "forward";
    EXPECT_TRUE(bitwise_equal(to_host(dx), dx1)) << "dgrad";
    EXPECT_TRUE(bitwise_equal(to_host(dw), dw1)) << "wgrad";
    Routing cpu_routing(s, T);
    EXPECT_TRUE(tail_untouched(y1, cpu_routing.rows()) && tail_untouched(dx1, cpu_routing.rows()));
    EXPECT_NO_THROW(flag.check(stream));
  }
  cudaStreamDestroy(stream);
}

// Bad splits through the GEMMs: nothing written past the clamped end, the error reported.
TEST_F(GpuFp8Graph, GemmsWithBadSplitsWriteNothingOutOfBounds) {
  MOE_SKIP_WITHOUT_HOPPER();
  Rng rng;
  const int64_t G = 6, T = 700, N = 128, K = 64;
  const Tensor x = to_gpu(random_tensor({T, K}, DType::kBFloat16, rng));
  const Tensor w = to_gpu(random_tensor({G, N, K}, DType::kBFloat16, rng, 0.1));
  OwnedWeight weight(G, N, K, kGpu);
  quantize_fp8_weight(GroupedParam::packed(w), weight.view());
  for (const std::vector<int64_t>& s : {std::vector<int64_t>{100, -50, 200, 30, 0, 10},
                                        std::vector<int64_t>{300, 300, 300, 300, 0, 1}}) {
    Tensor splits = to_gpu(splits_tensor_for(s));
    Tensor offsets = Tensor::empty({G + 1}, DType::kInt64, kGpu);
    DeviceErrorFlag flag(kGpu);
    const GroupLayout groups = GroupLayout::compute(splits, T, offsets, &flag);
    OwnedRows x_rows(T, K, kGpu);
    OwnedColumns x_cols(T, G, K, kGpu);
    quantize_fp8(x, groups, x_rows.view(), x_cols.view());
    Tensor y_big = poisoned_gpu({T + 64, N}, DType::kBFloat16);
    grouped_linear_forward(x_rows.view(), weight.view(), groups, y_big.view().slice(0, T));
    const int64_t end = to_host(offsets).data_as<int64_t>()[G];
    EXPECT_TRUE(tail_untouched(to_host(y_big), end)) << "rows past the clamped end were written";
    Tensor dw = poisoned_gpu({G, K, K}, DType::kFloat32);
    grouped_linear_wgrad(x_cols.view(), x_cols.view(), groups, GroupedParam::packed(dw), GradMode::kWrite);
    synchronize(nullptr);
    EXPECT_MOE_ERROR(flag.check(), ErrorCode::kDeviceReported, "splits");
  }
}

}  // namespace
}  // namespace moe::test
