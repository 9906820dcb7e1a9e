// The float64 oracle: a deliberately naive implementation of the ops of docs/design.md, written
// independently of the CPU backend (plain loops over doubles, its own GLU column mapping, no
// intermediate rounding). Tests, `moe-engine check` and `moe-engine bench` measure every backend
// against it. Slow by design: use small problems.
#pragma once

#include <cstdint>
#include <vector>

#include "moe_engine/export.hpp"
#include "moe_engine/glu.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/tensor.hpp"

namespace moe::oracle {

struct Matrix {  // row-major
  int64_t rows = 0, cols = 0;
  std::vector<double> data;

  Matrix() = default;
  Matrix(int64_t r, int64_t c) : rows(r), cols(c), data(size_t(r * c), 0.0) {}
  double& operator()(int64_t r, int64_t c) { return data[size_t(r * cols + c)]; }
  double operator()(int64_t r, int64_t c) const { return data[size_t(r * cols + c)]; }
};
using Vector = std::vector<double>;
using Splits =
    std::vector<int64_t>;  // host copy of the routing; every output covers sum(splits) rows

// Conversions from tensors on the CPU (any float dtype; 1-D tensors become one column).
Matrix to_matrix(const TensorView& t);
Vector to_vector(const TensorView& t);
std::vector<Matrix> to_matrices(const GroupedParam& p);  // one per expert (1-D: a column)
// Writes values (row-major, one per element) into a contiguous CPU tensor of any float dtype,
// rounding to nearest even: how tests and benchmarks build inputs from float64 draws.
void assign(const TensorView& dst, const Vector& values);
// The first `rows` rows of a matrix (entries of a vector): the part that belongs to experts.
Matrix head(const Matrix& m, int64_t rows);
Vector head(const Vector& v, int64_t n);

// The rel_error a result rounded to `dtype` may show against this oracle: one op (only its
// output is rounded), or the expert MLP (its pre-activation and activation are rounded too).
double op_tolerance(DType dtype);
double mlp_tolerance(DType dtype);

// ||out - ref|| / ||ref|| over the first ref.rows rows (inf if shapes differ or out has NaN/inf).
double rel_error(const Matrix& out, const Matrix& ref);
double rel_error(const Vector& out, const Vector& ref);
double rel_error(const std::vector<Matrix>& out, const std::vector<Matrix>& ref);

// DeepGEMM's similarity difference 1 - 2 <out, ref> / (<out, out> + <ref, ref>) over ref's rows: 0
// when equal, about rel_error^2 / 2 for small errors; the FP8 results' metric (inf as rel_error's).
double similarity_diff(const Matrix& out, const Matrix& ref);
double similarity_diff(const Vector& out, const Vector& ref);
double similarity_diff(const std::vector<Matrix>& out, const std::vector<Matrix>& ref);

// ---- grouped linear (section 2); bias is [G, N] (row g = b_g), empty = none ----
Matrix linear_forward(const Matrix& x, const std::vector<Matrix>& w, const Splits& splits,
                              const Matrix& bias, const Vector& row_scale);
Matrix linear_dgrad(const Matrix& dy, const std::vector<Matrix>& w, const Splits& splits);
std::vector<Matrix> linear_wgrad(const Matrix& dy, const Matrix& x, const Splits& splits);
Matrix linear_dbias(const Matrix& dy, const Splits& splits, const Vector& row_scale);
Vector linear_dscales(const Matrix& dy, const Matrix& bias, const Splits& splits);

// ---- activations (section 3): GLUs on h [rows, 2F], non-gated ones on h [rows, F]; probs empty = 1 ----
Matrix glu_forward(const Matrix& h, const Vector& probs, const GluSpec& spec);
struct GluGrads {
  Matrix dh;
  Vector dprobs;  // empty when probs is empty
};
GluGrads glu_backward(const Matrix& h, const Vector& probs, const Matrix& d_out,
                              const GluSpec& spec);

// ---- expert MLP (section 3) ----
struct MlpParams {
  std::vector<Matrix> w1, w2;  // [2F, H] ([F, H] non-gated) and [H, F] per expert
  Matrix b1, b2;               // [G, 2F] ([G, F] non-gated) and [G, H]; empty = no bias
};
struct MlpForward {
  Matrix h;  // FC1 output incl. b1 (pre-activation)
  Matrix a;  // act(h) * p
  Matrix y;
};
struct MlpGrads {
  Matrix dx;
  Vector dprobs;  // empty when probs is empty
  std::vector<Matrix> dw1, dw2;
  Matrix db1, db2;  // empty when the bias is absent
};
MlpForward mlp_forward(const Matrix& x, const Vector& probs, const MlpParams& params,
                               const Splits& splits, const GluSpec& spec);
MlpGrads mlp_backward(const Matrix& dy, const Matrix& x, const Vector& probs,
                              const MlpParams& params, const Splits& splits, const GluSpec& spec);

}  // namespace moe::oracle
