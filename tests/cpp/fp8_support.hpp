// Owned FP8 operands for the FP8 suites (CPU and GPU): the three layouts of moe_engine/fp8.hpp in
// buffers poisoned with kPoison, so that bytes an op must not write can be checked.
#pragma once

#include "test_support.hpp"

namespace moe::test {

inline int64_t blocks_of(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

inline Tensor poisoned_on(Shape shape, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  fill_bytes(t, kPoison);
  if (device.is_cuda()) synchronize(nullptr);
  return t;
}

// Rows of a [T, K] tensor: data [T, K], scales [ceil(K/128), pitch] (default fp8_scales_pitch(T)).
struct OwnedRows {
  Tensor data, scales;
  OwnedRows() = default;
  OwnedRows(int64_t T, int64_t K, Device device = Device::cpu(), int64_t pitch = -1)
      : data(poisoned_on({T, K}, DType::kFloat8E4M3, device)),
        scales(poisoned_on({blocks_of(K), pitch < 0 ? fp8_scales_pitch(T) : pitch}, DType::kFloat32, device)) {}
  Fp8Rows view() const { return {data, scales}; }
  OwnedRows to(Device device) const {
    OwnedRows o;
    o.data = data.to(device);
    o.scales = scales.to(device);
    return o;
  }
};

// Columns of a [T, K] tensor routed to G experts: data [K, C], scales [C/128, K], offsets [G + 1].
struct OwnedColumns {
  Tensor data, scales, offsets;
  OwnedColumns() = default;
  OwnedColumns(int64_t T, int64_t G, int64_t K, Device device = Device::cpu())
      : data(poisoned_on({K, fp8_columns_capacity(T, G)}, DType::kFloat8E4M3, device)),
        scales(poisoned_on({fp8_columns_capacity(T, G) / kFp8Block, K}, DType::kFloat32, device)),
        offsets(poisoned_on({G + 1}, DType::kInt64, device)) {}
  Fp8Columns view() const { return {data, scales, offsets}; }
  OwnedColumns to(Device device) const {
    OwnedColumns o;
    o.data = data.to(device);
    o.scales = scales.to(device);
    o.offsets = offsets.to(device);
    return o;
  }
};

// A G x [N, K] weight: data and scales, and the transposed pair.
struct OwnedWeight {
  Tensor data, scales, data_t, scales_t;
  OwnedWeight() = default;
  OwnedWeight(int64_t G, int64_t N, int64_t K, Device device = Device::cpu())
      : data(poisoned_on({G, N, K}, DType::kFloat8E4M3, device)),
        scales(poisoned_on({G, blocks_of(N), blocks_of(K)}, DType::kFloat32, device)),
        data_t(poisoned_on({G, K, N}, DType::kFloat8E4M3, device)),
        scales_t(poisoned_on({G, blocks_of(K), blocks_of(N)}, DType::kFloat32, device)) {}
  Fp8Weight view() const { return {data, scales, data_t, scales_t}; }
  OwnedWeight to(Device device) const {
    OwnedWeight o;
    o.data = data.to(device);
    o.scales = scales.to(device);
    o.data_t = data_t.to(device);
    o.scales_t = scales_t.to(device);
    return o;
  }
};

// DeepGEMM's similarity difference of two results: oracle::similarity_diff (found by argument type).

// max |out - ref| / rms(ref) over ref's rows: an error relative to the output's scale.
inline double max_error_vs_rms(const oracle::Matrix& out, const oracle::Matrix& ref) {
  double sq = 0, worst = 0;
  for (int64_t r = 0; r < ref.rows; ++r)
    for (int64_t c = 0; c < ref.cols; ++c) {
      sq += ref(r, c) * ref(r, c);
      const double d = std::fabs(out(r, c) - ref(r, c));
      worst = std::isnan(d) ? INFINITY : std::max(worst, d);
    }
  const double rms = std::sqrt(sq / double(std::max<int64_t>(1, ref.rows * ref.cols)));
  return rms > 0 ? worst / rms : worst;
}

// A [G, N, K] packed tensor's experts as one [G * N, K] matrix.
inline oracle::Matrix stacked(const std::vector<oracle::Matrix>& experts) {
  oracle::Matrix m(0, experts.empty() ? 0 : experts[0].cols);
  for (const auto& e : experts) {
    m.data.insert(m.data.end(), e.data.begin(), e.data.end());
    m.rows += e.rows;
  }
  return m;
}

}  // namespace moe::test
