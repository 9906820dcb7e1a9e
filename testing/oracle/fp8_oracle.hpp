// The float64 oracle of the FP8 ops (moe_engine/fp8.hpp): the E4M3 format from its definition,
// dequantization of the three layouts (q * s in float64, reading the routing from host splits) and
// the grouped GEMMs of the dequantized operands (oracle.hpp's naive loops). Shares nothing with the
// backends: no bit tricks, no code of src/.
#pragma once

#include <cstdint>
#include <vector>

#include "moe_engine/fp8.hpp"
#include "oracle/oracle.hpp"

namespace moe::oracle {

// The value of an E4M3 code: sign, exponent e (4 bits, bias 7), mantissa m (3 bits):
// (1 + m/8) 2^(e-7), or m 2^-9 for e = 0; 0x7f and 0xff are NaN.
double e4m3_value(uint8_t code);
// The E4M3 code nearest to v: ties to the even code, magnitudes above 448 saturated to 448 (the
// largest finite value; infinities too), NaN -> 0x7f.
uint8_t e4m3_nearest(double v);

// Dequantized operands, for the rows that belong to experts (sum(splits)):
Matrix dequantize_rows(const Fp8Rows& rows, int64_t num_rows);                     // [num_rows, K]
Matrix dequantize_columns(const Fp8Columns& columns, const Splits& splits);         // [sum(splits), K]
std::vector<Matrix> dequantize_weight(const Fp8Weight& weight);                     // G x [N, K], data
std::vector<Matrix> dequantize_weight_transposed(const Fp8Weight& weight);          // G x [N, K], data_t

// The grouped GEMMs of section 2 over the dequantized operands (bias: [G, N], empty = none).
Matrix fp8_linear_forward(const Fp8Rows& x, const Fp8Weight& weight, const Splits& splits, const Matrix& bias,
                          const Vector& row_scale);
Matrix fp8_linear_dgrad(const Fp8Rows& dy, const Fp8Weight& weight, const Splits& splits);
std::vector<Matrix> fp8_linear_wgrad(const Fp8Columns& dy, const Fp8Columns& x, const Splits& splits);

}  // namespace moe::oracle
