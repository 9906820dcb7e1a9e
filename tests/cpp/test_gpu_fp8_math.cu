// The E4M3 conversion the CUDA quantizers use (common/fp8_math.hpp: the hardware conversion on
// sm_89+) against the software conversion, which the CPU suite checks against the format's
// definition, on every one of the 2^32 floats: the proof that the hardware path gives the CPU's
// bytes. Also the software path compiled for the device against a table computed on the host, and
// the tile multiplier and scale (two IEEE divisions) on the device against the host's.
#include <cuda_runtime_api.h>

#include <cstring>

#include "common/fp8_math.hpp"
#include "gpu_support.hpp"

namespace moe::test {
namespace {

struct Mismatch {
  unsigned long long count;
  uint32_t first_bits;
  uint32_t got, want;
};

// Thread t covers bit patterns t, t + stride, ...: the pair (v, next pattern) through the
// two-value conversion, each against the one-value software conversion.
__global__ void compare_all_floats(Mismatch* out) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x * 2;
  for (uint64_t u = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 2; u < (1ull << 32); u += stride) {
    const float a = detail::bits_float(uint32_t(u)), b = detail::bits_float(uint32_t(u + 1));
    const uint16_t pair = detail::e4m3x2_from_float(a, b);
    const uint16_t want = uint16_t(detail::e4m3_from_float(a) | detail::e4m3_from_float(b) << 8);
    if (pair != want) {
      if (atomicAdd(&out->count, 1ull) == 0) {
        out->first_bits = uint32_t(u);
        out->got = pair;
        out->want = want;
      }
    }
  }
}

// The device's software conversion of the floats with the given high 16 bits and low bits 0x1357:
// a sample of every exponent and sign, checked against the host's.
__global__ void software_sample(uint8_t* out) {
  const uint32_t hi = blockIdx.x * blockDim.x + threadIdx.x;
  if (hi < 65536) out[hi] = detail::e4m3_from_float(detail::bits_float(hi << 16 | 0x1357u));
}

TEST(GpuFp8Math, HardwareConversionEqualsSoftwareOnEveryFloat) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  Mismatch* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, sizeof(Mismatch)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d, 0, sizeof(Mismatch)), cudaSuccess);
  compare_all_floats<<<4096, 256>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  Mismatch m{};
  ASSERT_EQ(cudaMemcpy(&m, d, sizeof(m), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d);
  EXPECT_EQ(m.count, 0ull) << "first mismatch: float bits 0x" << std::hex << m.first_bits << ": pair 0x" << m.got
                           << ", software 0x" << m.want;
}

TEST(GpuFp8Math, DeviceSoftwareConversionEqualsHost) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  uint8_t* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 65536), cudaSuccess);
  software_sample<<<256, 256>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<uint8_t> got(65536);
  ASSERT_EQ(cudaMemcpy(got.data(), d, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d);
  int64_t wrong = 0;
  for (uint32_t hi = 0; hi < 65536; ++hi)
    wrong += got[hi] != detail::e4m3_from_float(detail::bits_float(hi << 16 | 0x1357u));
  EXPECT_EQ(wrong, 0);
}

// The multiplier and scale bits of amax bits (hi << 13 | 0x1abc): every exponent and sign of the
// top bits, with and without pow2, with epsilon 0 and 1e-3.
__global__ void tile_scale_sample(uint32_t* out) {
  const uint32_t hi = blockIdx.x * blockDim.x + threadIdx.x;
  if (hi >= (1u << 18)) return;
  const uint32_t amax = (hi << 13 | 0x1abcu) & 0x7fffffffu;
  for (int variant = 0; variant < 4; ++variant) {
    const detail::Fp8TileScale s = detail::fp8_tile_scale(amax, variant & 1, variant & 2 ? 1e-3f : 0.f);
    out[(size_t(hi) * 4 + variant) * 2] = detail::float_bits(s.multiplier);
    out[(size_t(hi) * 4 + variant) * 2 + 1] = detail::float_bits(s.scale);
  }
}

TEST(GpuFp8Math, DeviceTileScaleEqualsHost) {
  if (const std::string why = no_gpu_reason(); !why.empty()) GTEST_SKIP() << why;
  const size_t n = size_t(1) << 18, words = n * 8;
  uint32_t* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, words * 4), cudaSuccess);
  tile_scale_sample<<<unsigned(n / 256), 256>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<uint32_t> got(words);
  ASSERT_EQ(cudaMemcpy(got.data(), d, words * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d);
  int64_t wrong = 0;
  uint32_t first = 0;
  for (uint32_t hi = 0; hi < n; ++hi) {
    const uint32_t amax = (hi << 13 | 0x1abcu) & 0x7fffffffu;
    for (int variant = 0; variant < 4; ++variant) {
      const detail::Fp8TileScale s = detail::fp8_tile_scale(amax, variant & 1, variant & 2 ? 1e-3f : 0.f);
      const size_t at = (size_t(hi) * 4 + variant) * 2;
      // NaN tiles: any NaN bits.
      const bool nan = amax >= 0x7f800000u;
      const bool same = nan ? (got[at] & 0x7fffffffu) > 0x7f800000u && (got[at + 1] & 0x7fffffffu) > 0x7f800000u
                            : got[at] == detail::float_bits(s.multiplier) && got[at + 1] == detail::float_bits(s.scale);
      if (!same && wrong++ == 0) first = amax;
    }
  }
  EXPECT_EQ(wrong, 0) << "first amax bits 0x" << std::hex << first;
}

}  // namespace
}  // namespace moe::test
