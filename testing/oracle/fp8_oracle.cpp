#include "oracle/fp8_oracle.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "moe_engine/error.hpp"

namespace moe::oracle {
namespace {

constexpr int64_t kBlock = 128;

uint8_t byte(const TensorView& t, int64_t offset) {
  MOE_CHECK(t.dtype() == DType::kFloat8E4M3 && t.device().is_cpu(), ErrorCode::kDType,
            "oracle: expected float8_e4m3 on the CPU, got ", t.describe());
  return static_cast<const uint8_t*>(t.data())[offset];
}

float scale(const TensorView& t, int64_t offset) {
  MOE_CHECK(t.dtype() == DType::kFloat32 && t.device().is_cpu(), ErrorCode::kDType,
            "oracle: expected float32 scales on the CPU, got ", t.describe());
  return static_cast<const float*>(t.data())[offset];
}

// The 127 finite non-negative magnitudes, codes 0x00 .. 0x7e, increasing.
const std::array<double, 127>& magnitudes() {
  static const std::array<double, 127> table = [] {
    std::array<double, 127> t{};
    for (int c = 0; c < 127; ++c) t[size_t(c)] = e4m3_value(uint8_t(c));
    return t;
  }();
  return table;
}

}  // namespace

double e4m3_value(uint8_t code) {
  if ((code & 0x7f) == 0x7f) return std::numeric_limits<double>::quiet_NaN();
  const int e = (code >> 3) & 15, m = code & 7;
  const double magnitude = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (code & 0x80) ? -magnitude : magnitude;
}

uint8_t e4m3_nearest(double v) {
  if (std::isnan(v)) return 0x7f;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const double a = std::fabs(v);
  const auto& t = magnitudes();
  // The first magnitude >= a, and the one below it: the nearer wins, a tie goes to the even code.
  const auto above = int(std::lower_bound(t.begin(), t.end(), a) - t.begin());
  if (above == 127) return uint8_t(sign | 0x7e);
  if (above == 0) return sign;
  const double up = t[size_t(above)] - a, down = a - t[size_t(above - 1)];
  const int code = up < down ? above : down < up ? above - 1 : (above % 2 == 0 ? above : above - 1);
  return uint8_t(sign | code);
}

Matrix dequantize_rows(const Fp8Rows& rows, int64_t num_rows) {
  const int64_t K = rows.data.size(1);
  Matrix m(num_rows, K);
  for (int64_t r = 0; r < num_rows; ++r)
    for (int64_t k = 0; k < K; ++k)
      m(r, k) = e4m3_value(byte(rows.data, r * rows.data.stride(0) + k)) *
                scale(rows.scales, (k / kBlock) * rows.scales.stride(0) + r);
  return m;
}

Matrix dequantize_columns(const Fp8Columns& columns, const Splits& splits) {
  const int64_t K = columns.data.size(0);
  int64_t total = 0;
  for (int64_t s : splits) total += s;
  Matrix m(total, K);
  int64_t row = 0, first_column = 0;  // the expert's first token and first column
  for (int64_t count : splits) {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t c = first_column + i;
        m(row + i, k) = e4m3_value(byte(columns.data, k * columns.data.stride(0) + c)) *
                        scale(columns.scales, (c / kBlock) * columns.scales.stride(0) + k);
      }
    row += count;
    first_column += (count + kBlock - 1) / kBlock * kBlock;
  }
  return m;
}

namespace {
std::vector<Matrix> dequantize_blocks(const TensorView& data, const TensorView& scales, bool transposed) {
  MOE_CHECK(data.dim() == 3 && data.is_contiguous() && scales.is_contiguous(), ErrorCode::kShape,
            "oracle: expected contiguous [G, rows, cols] weight blocks, got ", data.describe());
  const int64_t G = data.size(0), R = data.size(1), C = data.size(2);
  const int64_t row_blocks = scales.size(1), col_blocks = scales.size(2);
  std::vector<Matrix> out;
  for (int64_t g = 0; g < G; ++g) {
    Matrix m = transposed ? Matrix(C, R) : Matrix(R, C);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const double v = e4m3_value(byte(data, (g * R + r) * C + c)) *
                         scale(scales, (g * row_blocks + r / kBlock) * col_blocks + c / kBlock);
        if (transposed)
          m(c, r) = v;
        else
          m(r, c) = v;
      }
    out.push_back(std::move(m));
  }
  return out;
}
}  // namespace

std::vector<Matrix> dequantize_weight(const Fp8Weight& weight) {
  return dequantize_blocks(weight.data, weight.scales, false);
}

std::vector<Matrix> dequantize_weight_transposed(const Fp8Weight& weight) {
  return dequantize_blocks(weight.data_t, weight.scales_t, true);
}

Matrix fp8_linear_forward(const Fp8Rows& x, const Fp8Weight& weight, const Splits& splits, const Matrix& bias,
                          const Vector& row_scale) {
  int64_t rows = 0;
  for (int64_t s : splits) rows += s;
  return linear_forward(dequantize_rows(x, rows), dequantize_weight(weight), splits, bias, row_scale);
}

Matrix fp8_linear_dgrad(const Fp8Rows& dy, const Fp8Weight& weight, const Splits& splits) {
  int64_t rows = 0;
  for (int64_t s : splits) rows += s;
  return linear_dgrad(dequantize_rows(dy, rows), dequantize_weight_transposed(weight), splits);
}

std::vector<Matrix> fp8_linear_wgrad(const Fp8Columns& dy, const Fp8Columns& x, const Splits& splits) {
  return linear_wgrad(dequantize_columns(dy, splits), dequantize_columns(x, splits), splits);
}

}  // namespace moe::oracle
