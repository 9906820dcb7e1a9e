// Core types: dtypes and conversions, devices, tensors, grouped params, the CPU group layout.
#include <cmath>
#include <limits>

#include "test_support.hpp"

namespace moe::test {
namespace {

TEST(DType, SizesNamesAndAliases) {
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kInt64), 8u);
  for (DType d :
       {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3,
        DType::kFloat8E5M2, DType::kInt64, DType::kInt32, DType::kUInt8})
    EXPECT_EQ(dtype_from_name(dtype_name(d)), d);
  EXPECT_EQ(dtype_from_name("bf16"), DType::kBFloat16);
  EXPECT_EQ(dtype_from_name("fp16"), DType::kFloat16);
  EXPECT_TRUE(is_floating(DType::kBFloat16));
  EXPECT_FALSE(is_floating(DType::kFloat8E4M3));
  EXPECT_FALSE(is_floating(DType::kInt32));
}

// Exhaustive checks of the bit tricks in dtype.hpp: every pattern round-trips, and values at,
// just below and just above the midpoint of two neighbours round to the right one.
template <class T>
void check_round_trip_and_rounding() {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // Every 16-bit pattern: to float and back is the identity (NaNs stay NaN).
  for (uint32_t b = 0; b < 65536; ++b) {
    const T v = T::from_bits(uint16_t(b));
    const float f = float(v);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(float(T(f))));
      continue;
    }
    ASSERT_EQ(T(f).bits, uint16_t(b)) << "bits 0x" << std::hex << b;
  }
  // Midpoints between neighbours round to the even one; points just off them round to the nearer.
  for (uint32_t b = 0; b < 0x7bff; b += 7) {
    const T lo = T::from_bits(uint16_t(b)), hi = T::from_bits(uint16_t(b + 1));
    const double a = double(float(lo)), c = double(float(hi));
    if (!std::isfinite(a) || !std::isfinite(c)) continue;
    const double mid = (a + c) / 2;
    if (double(float(mid)) != mid) continue;  // midpoint not representable in float
    const uint16_t even = (b % 2 == 0) ? uint16_t(b) : uint16_t(b + 1);
    EXPECT_EQ(T(float(mid)).bits, even) << "bits 0x" << std::hex << b;
    EXPECT_EQ(T(std::nextafter(float(mid), -kInf)).bits, b) << "bits 0x" << std::hex << b;
    EXPECT_EQ(T(std::nextafter(float(mid), kInf)).bits, b + 1) << "bits 0x" << std::hex << b;
  }
}

TEST(DType, BFloat16ConversionIsExactAndRoundsToNearestEven) {
  check_round_trip_and_rounding<BFloat16>();
  EXPECT_EQ(BFloat16(1.0f).bits, 0x3f80);
  EXPECT_EQ(BFloat16(std::numeric_limits<float>::infinity()).bits, 0x7f80);
  EXPECT_EQ(BFloat16(3.4e38f).bits, 0x7f80);  // rounds past the largest bf16 to inf
}

TEST(DType, Float16ConversionIsExactAndRoundsToNearestEven) {
  check_round_trip_and_rounding<Float16>();
  EXPECT_EQ(Float16(1.0f).bits, 0x3c00);
  EXPECT_EQ(Float16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(Float16(65519.0f).bits, 0x7bff);
  EXPECT_EQ(Float16(65520.0f).bits, 0x7c00);                  // ties to even: inf
  EXPECT_EQ(Float16(5.9604644775390625e-08f).bits, 0x0001);   // smallest subnormal
  EXPECT_EQ(Float16(2.98023223876953125e-08f).bits, 0x0000);  // half of it: ties to even (0)
  EXPECT_EQ(Float16(-0.0f).bits, 0x8000);
}

TEST(Device, NamesRoundTrip) {
  EXPECT_EQ(to_string(Device::cpu()), "cpu");
  EXPECT_EQ(to_string(Device::cuda(3)), "cuda:3");
  EXPECT_EQ(parse_device("cuda:3"), Device::cuda(3));
  EXPECT_EQ(parse_device("cuda"), Device::cuda(0));
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_MOE_ERROR(parse_device("gpu"), ErrorCode::kInvalidArgument,
                   "expected cpu, cuda or cuda:N");
  EXPECT_MOE_ERROR(parse_device("cuda:x"), ErrorCode::kInvalidArgument, "unknown device 'cuda:x'");
}

TEST(Tensor, ViewsSelectSliceReshape) {
  Tensor t = Tensor::empty({4, 6}, DType::kFloat32);
  for (int64_t i = 0; i < 24; ++i) t.data_as<float>()[i] = float(i);
  const TensorView v = t;
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.nbytes(), 96u);
  EXPECT_EQ(v.select(2).data_as<float>()[1], 13.0f);
  const TensorView s = v.slice(1, 3);
  EXPECT_EQ(s.shape(), Shape({2, 6}));
  EXPECT_EQ(s.data_as<float>()[0], 6.0f);
  EXPECT_EQ(v.reshape({3, 8}).shape(), Shape({3, 8}));
  EXPECT_EQ(v.describe(), "float32[4, 6] on cpu");
  // A strided view of columns 0..2 of every row.
  const TensorView cols(t.data(), {4, 3}, {6, 1}, DType::kFloat32, Device::cpu());
  EXPECT_FALSE(cols.is_contiguous());
  EXPECT_NE(cols.describe().find("strides [6, 1]"), std::string::npos);
  EXPECT_MOE_ERROR(cols.reshape({12}), ErrorCode::kShape, "needs a contiguous tensor");
  EXPECT_MOE_ERROR(v.slice(3, 5), ErrorCode::kShape, "out of range");
  EXPECT_MOE_ERROR(v.select(4), ErrorCode::kShape, "out of range");
  EXPECT_MOE_ERROR(TensorView(nullptr, {2}, DType::kFloat32), ErrorCode::kInvalidArgument,
                   "null data pointer");
  EXPECT_FALSE(TensorView().defined());
}

TEST(Tensor, OwningCopiesAndZeros) {
  Rng rng;
  Tensor a = random_tensor({5, 7}, DType::kBFloat16, rng);
  Tensor b = a.to(Device::cpu());
  EXPECT_NE(a.data(), b.data());
  EXPECT_TRUE(bitwise_equal(a, b));
  Tensor z = Tensor::zeros({3}, DType::kFloat64);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(z.data_as<double>()[i], 0.0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(Tensor::empty({3}, DType::kUInt8).data()) % 64, 0u);
  EXPECT_MOE_ERROR(copy_tensor(a, z), ErrorCode::kShape, "differ in shape or dtype");
}

TEST(GroupedParam, PackedAndPerExpertViews) {
  Rng rng;
  Tensor w = random_tensor({3, 4, 5}, DType::kFloat32, rng);
  OwnedParam packed(w, false), split(w, true);
  EXPECT_TRUE(packed.param.is_packed());
  EXPECT_FALSE(split.param.is_packed());
  EXPECT_EQ(packed.param.expert_shape(), Shape({4, 5}));
  EXPECT_EQ(split.param.num_groups(), 3);
  EXPECT_TRUE(bitwise_equal(packed.param, split.param));
  EXPECT_EQ(packed.param.describe(), "packed float32[3, 4, 5] on cpu");
  EXPECT_EQ(split.param.describe(), "3 x float32[4, 5] on cpu");
  Tensor other = Tensor::empty({4, 6}, DType::kFloat32);
  EXPECT_MOE_ERROR(GroupedParam::per_expert({split.experts[0], other}), ErrorCode::kShape,
                   "tensor 1 has shape [4, 6], expected [4, 5]");
  Tensor half = Tensor::empty({4, 5}, DType::kFloat16);
  EXPECT_MOE_ERROR(GroupedParam::per_expert({split.experts[0], half}), ErrorCode::kDType,
                   "tensor 1 is float16, expected float32");
  EXPECT_MOE_ERROR(GroupedParam::per_expert({}), ErrorCode::kInvalidArgument, "expected G >= 1");
  const TensorView strided(w.data(), {4, 3}, {5, 1}, DType::kFloat32, Device::cpu());
  EXPECT_MOE_ERROR(GroupedParam::per_expert({strided}), ErrorCode::kShape, "is not contiguous");
  EXPECT_MOE_ERROR(GroupedParam::packed(w.view().select(0).select(0)), ErrorCode::kShape,
                   "rank >= 2");
  EXPECT_MOE_ERROR(packed.param.expert(3), ErrorCode::kInvalidArgument, "out of range");
}

TEST(GroupLayout, CpuOffsetsAreTheExclusivePrefixSum) {
  Routing r({3, 0, 1, 7, 0}, 16);
  const auto* off = r.offsets_tensor.data_as<int64_t>();
  const int64_t expected[] = {0, 3, 3, 4, 11, 11};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(off[i], expected[i]);
  EXPECT_EQ(r.layout.num_groups(), 5);
  EXPECT_EQ(r.layout.capacity(), 16);

  // int32 splits too.
  Tensor s32 = Tensor::empty({3}, DType::kInt32);
  const int32_t v[] = {2, 5, 0};
  std::memcpy(s32.data(), v, sizeof(v));
  Tensor off32 = Tensor::empty({4}, DType::kInt64);
  GroupLayout::compute(s32, 7, off32);
  EXPECT_EQ(off32.data_as<int64_t>()[3], 7);
}

// Rows past sum(splits) become zeros; the routed rows and other dtypes' byte counts are kept.
TEST(GroupLayout, ZeroUnroutedRowsClearsOnlyTheTail) {
  Routing r({3, 0, 2}, 9);
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    Tensor t = poisoned({9, 5}, dtype);
    zero_unrouted_rows(t, r.layout);
    const auto* bytes = static_cast<const uint8_t*>(t.data());
    const size_t row = 5 * dtype_size(dtype);
    for (size_t i = 0; i < 9 * row; ++i) ASSERT_EQ(bytes[i], i < 5 * row ? kPoison : 0) << i;
  }
  Tensor full = poisoned({5}, DType::kFloat32);  // sum(splits) == T: nothing to clear
  zero_unrouted_rows(full, Routing({3, 2}, 5).layout);
  EXPECT_TRUE(tail_untouched(full, 0));
  EXPECT_MOE_ERROR(zero_unrouted_rows(poisoned({8, 5}, DType::kFloat32), r.layout), ErrorCode::kShape,
                   "expected a [T = 9, ...] tensor");
}

// Several tensors of one routing at once: each tail cleared, undefined views skipped, and a bad
// tensor anywhere in the list refused before any is written.
TEST(GroupLayout, ZeroUnroutedRowsOfSeveralTensors) {
  Routing r({3, 0, 2}, 9);
  Tensor a = poisoned({9, 5}, DType::kBFloat16), b = poisoned({9}, DType::kFloat32),
         c = poisoned({9, 2, 3}, DType::kUInt8);
  const TensorView list[] = {a, TensorView(), b, c};
  zero_unrouted_rows(list, r.layout);
  for (const Tensor* t : {&a, &b, &c}) {
    const auto* bytes = static_cast<const uint8_t*>(t->data());
    const size_t row = t->nbytes() / 9;
    for (size_t i = 0; i < 9 * row; ++i) ASSERT_EQ(bytes[i], i < 5 * row ? kPoison : 0) << TensorView(*t).describe() << " " << i;
  }
  Tensor good = poisoned({9, 5}, DType::kFloat32);
  const TensorView bad_list[] = {good, poisoned({8, 5}, DType::kFloat32)};
  EXPECT_MOE_ERROR(zero_unrouted_rows(bad_list, r.layout), ErrorCode::kShape, "expected a [T = 9, ...] tensor");
  EXPECT_TRUE(tail_untouched(good, 0));
  EXPECT_MOE_ERROR(zero_unrouted_rows(TensorView(), r.layout), ErrorCode::kShape, "got an undefined one");
}

TEST(GroupLayout, BadSplitsAndArgumentsAreClearErrors) {
  auto make = [](std::vector<int64_t> s, int64_t cap) { Routing r(std::move(s), cap); };
  EXPECT_MOE_ERROR(make({2, -3, 1}, 10), ErrorCode::kInvalidArgument, "splits[1] = -3 is negative");
  EXPECT_MOE_ERROR(make({4, 4, 4}, 10), ErrorCode::kInvalidArgument,
                   "sum(splits) exceeds the buffer capacity T = 10 at expert 2");
  Tensor fsplits = Tensor::empty({2}, DType::kFloat32);
  Tensor off = Tensor::empty({3}, DType::kInt64);
  EXPECT_MOE_ERROR(GroupLayout::compute(fsplits, 4, off), ErrorCode::kDType,
                   "splits: expected int64 or int32, got float32");
  Tensor splits = Tensor::zeros({2}, DType::kInt64);
  Tensor short_off = Tensor::empty({2}, DType::kInt64);
  EXPECT_MOE_ERROR(GroupLayout::compute(splits, 4, short_off), ErrorCode::kShape,
                   "offsets: expected a 1-D [G+1] = [3] tensor");
  Tensor none = Tensor::empty({0}, DType::kInt64);
  EXPECT_MOE_ERROR(GroupLayout::compute(none, 4, Tensor::empty({1}, DType::kInt64)),
                   ErrorCode::kShape, "expected G >= 1 experts");
  EXPECT_MOE_ERROR(GroupLayout::compute(splits, -1, off), ErrorCode::kInvalidArgument,
                   "capacity T = -1 is negative");
  const TensorView cuda_off(reinterpret_cast<void*>(0x1000), {3}, DType::kInt64, Device::cuda(0));
  EXPECT_MOE_ERROR(GroupLayout::compute(splits, 4, cuda_off), ErrorCode::kDevice,
                   "offsets are on cuda:0 but splits on cpu");
}

TEST(DeviceErrorFlag, CpuRecordDescribesAndClears) {
  DeviceErrorFlag flag;
  EXPECT_NO_THROW(flag.check());
  *flag.record() = DeviceErrorRecord{kNegativeSplit | kSplitsExceedCapacity, 4, -2, 130, 128};
  EXPECT_MOE_ERROR(flag.check(), ErrorCode::kDeviceReported, "splits[4] = -2 is negative");
  EXPECT_NO_THROW(flag.check());  // cleared by the first check
  const std::string text = describe_device_errors({kSplitsExceedCapacity, -1, 0, 130, 128});
  EXPECT_NE(text.find("sum(splits) = 130 exceeds the buffer capacity T = 128"), std::string::npos);
}

TEST(DeviceErrorFlag, DescribesBadRoutingEntries) {
  DeviceErrorRecord r{};
  r.bits = kExpertIndexOutOfRange | kRowOutOfRange;
  r.index = {3, 1, 300, 256};
  r.row = {7, 0, 4096, 1000};
  const std::string text = describe_device_errors(r);
  EXPECT_NE(text.find("indices[3, 1] = 300 is not an expert in [0, E = 256)"), std::string::npos)
      << text;
  EXPECT_NE(
      text.find("row_of[7, 0] = 4096 is neither -1 nor a routed row in [0, offsets[G] = 1000)"),
      std::string::npos)
      << text;
}

TEST(Runtime, BuildInfoAndGpuQueryNeverThrow) {
  const BuildInfo b = build_info();
  EXPECT_EQ(b.version, MOE_ENGINE_VERSION);
  EXPECT_EQ(b.with_cuda, bool(MOE_ENGINE_WITH_CUDA));
  const GpuInventory inv = query_gpus();
  if (inv.gpus.empty()) EXPECT_FALSE(inv.note.empty());
}

// Host code that synchronizes or asks about the default stream runs unchanged on a machine without
// a GPU (a CUDA build there used to throw the runtime's no-driver error).
TEST(Runtime, TheDefaultStreamWorksWithOrWithoutAGpu) {
  EXPECT_NO_THROW(synchronize(nullptr));
  EXPECT_FALSE(stream_is_capturing(nullptr));
}

}  // namespace
}  // namespace moe::test
