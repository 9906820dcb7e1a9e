// Naive float64 reference. Deliberately shares no code with src/cpu: plain triple loops, its own
// column mapping per GLU layout and its own activation formulas (GELU from its textbook tanh form,
// where the backends compute it through a sigmoid).
#include "oracle/oracle.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "moe_engine/error.hpp"

namespace moe::oracle {
namespace {

int64_t total_rows(const Splits& splits) {
  int64_t t = 0;
  for (int64_t s : splits) {
    MOE_CHECK(s >= 0, ErrorCode::kInvalidArgument, "oracle: negative split ", s);
    t += s;
  }
  return t;
}

// The expert that owns each of the sum(splits) rows.
std::vector<int64_t> expert_of_rows(const Splits& splits) {
  std::vector<int64_t> owner;
  for (size_t g = 0; g < splits.size(); ++g)
    owner.insert(owner.end(), size_t(splits[g]), int64_t(g));
  return owner;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct Columns {
  int64_t gate, linear;
};

Columns glu_columns(const GluLayout& layout, int64_t j, int64_t ffn) {
  switch (layout.kind()) {
    case GluLayout::Kind::kHalves:
      return {j, ffn + j};
    case GluLayout::Kind::kPairs:
      return {2 * j, 2 * j + 1};
    case GluLayout::Kind::kBlocks: {
      const int64_t s = layout.block(), block = j / s, within = j % s;
      return {block * 2 * s + within, block * 2 * s + s + within};
    }
  }
  throw_error(ErrorCode::kInternal, "oracle: unknown GLU layout");
}

double activation(const GluSpec& spec, double gate, double linear) {
  if (spec.activation == Activation::kSwiGLU) return gate * sigmoid(gate) * linear;
  const double limit = spec.limit;
  const double g = std::min(gate, limit);
  const double l = std::min(std::max(linear, -limit), limit) + spec.offset;
  return g * sigmoid(spec.alpha * g) * l;
}

// Partial derivatives of activation() w.r.t. gate and linear.
void activation_grad(const GluSpec& spec, double gate, double linear, double& d_gate,
                     double& d_linear) {
  if (spec.activation == Activation::kSwiGLU) {
    const double s = sigmoid(gate);
    d_gate = (s + gate * s * (1.0 - s)) * linear;
    d_linear = gate * s;
    return;
  }
  const double limit = spec.limit, alpha = spec.alpha;
  const double g = std::min(gate, limit);
  const double l = std::min(std::max(linear, -limit), limit) + spec.offset;
  const double s = sigmoid(alpha * g);
  d_gate = gate > limit ? 0.0 : (s + alpha * g * s * (1.0 - s)) * l;
  d_linear = std::abs(linear) > limit ? 0.0 : g * s;
}

// The non-gated activations and their derivatives (NaN stays NaN).
double elementwise(Activation act, double h) {
  if (act == Activation::kSReLU) return h < 0.0 ? 0.0 : h * h;
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * h * (1.0 + std::tanh(k * (h + 0.044715 * h * h * h)));
}

double elementwise_grad(Activation act, double h) {
  if (act == Activation::kSReLU) return h < 0.0 ? 0.0 : 2.0 * h;
  const double k = std::sqrt(2.0 / std::numbers::pi);
  const double t = std::tanh(k * (h + 0.044715 * h * h * h));
  return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * h * h);
}

double read(const TensorView& t, int64_t offset) {
  switch (t.dtype()) {
    case DType::kFloat64:
      return static_cast<const double*>(t.data())[offset];
    case DType::kFloat32:
      return static_cast<const float*>(t.data())[offset];
    case DType::kBFloat16:
      return double(float(static_cast<const BFloat16*>(t.data())[offset]));
    case DType::kFloat16:
      return double(float(static_cast<const Float16*>(t.data())[offset]));
    default:
      throw_error(ErrorCode::kDType, "oracle: cannot read ", dtype_name(t.dtype()));
  }
}

}  // namespace

Matrix to_matrix(const TensorView& t) {
  MOE_CHECK(t.defined() && t.device().is_cpu() && (t.dim() == 1 || t.dim() == 2), ErrorCode::kShape,
            "oracle::to_matrix: expected a 1-D or 2-D CPU tensor, got ", t.describe());
  const int64_t rows = t.size(0), cols = t.dim() == 2 ? t.size(1) : 1;
  const int64_t rs = t.stride(0), cs = t.dim() == 2 ? t.stride(1) : 0;
  Matrix m(rows, cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) m(r, c) = read(t, r * rs + c * cs);
  return m;
}

Vector to_vector(const TensorView& t) { return to_matrix(t).data; }

std::vector<Matrix> to_matrices(const GroupedParam& p) {
  std::vector<Matrix> out;
  for (int64_t g = 0; g < p.num_groups(); ++g) out.push_back(to_matrix(p.expert(g)));
  return out;
}

void assign(const TensorView& dst, const Vector& values) {
  MOE_CHECK(dst.defined() && dst.device().is_cpu() && dst.is_contiguous(), ErrorCode::kShape,
            "oracle::assign: expected a contiguous CPU tensor, got ", dst.describe());
  MOE_CHECK(int64_t(values.size()) == dst.numel(), ErrorCode::kShape,
            "oracle::assign: ", values.size(), " values for ", dst.describe());
  for (int64_t i = 0; i < dst.numel(); ++i) {
    const double v = values[size_t(i)];
    switch (dst.dtype()) {
      case DType::kFloat64:
        dst.data_as<double>()[i] = v;
        break;
      case DType::kFloat32:
        dst.data_as<float>()[i] = float(v);
        break;
      case DType::kBFloat16:
        dst.data_as<BFloat16>()[i] = BFloat16(float(v));
        break;
      case DType::kFloat16:
        dst.data_as<Float16>()[i] = Float16(float(v));
        break;
      default:
        throw_error(ErrorCode::kDType,
                    "oracle::assign: not a float dtype: ", dtype_name(dst.dtype()));
    }
  }
}

Matrix head(const Matrix& m, int64_t rows) {
  MOE_CHECK(rows >= 0 && rows <= m.rows, ErrorCode::kShape, "oracle::head: ", rows, " of ", m.rows,
            " rows");
  Matrix h(rows, m.cols);
  std::copy(m.data.begin(), m.data.begin() + rows * m.cols, h.data.begin());
  return h;
}

Vector head(const Vector& v, int64_t n) {
  MOE_CHECK(n >= 0 && n <= int64_t(v.size()), ErrorCode::kShape, "oracle::head: ", n, " of ",
            v.size(), " entries");
  return Vector(v.begin(), v.begin() + n);
}

double op_tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return 1e-12;
    case DType::kFloat32:
      return 2e-5;
    case DType::kBFloat16:
      return 1e-2;  // 2^-9 rounding per element, a few times over
    case DType::kFloat16:
      return 3e-3;
    default:
      return 0;
  }
}

double mlp_tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return 1e-10;
    case DType::kFloat32:
      return 1e-4;
    case DType::kBFloat16:
      return 1e-2;  // measured ~3.5e-3 on the tiny case
    case DType::kFloat16:
      return 6e-3;
    default:
      return 0;
  }
}

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

// ||out - ref|| / ||ref||; NaN/inf in `out` poison the result.
struct ErrorSum {
  double diff = 0, ref = 0;
  bool bad = false;
  void add(double o, double r) {
    if (!std::isfinite(o)) bad = true;
    diff += (o - r) * (o - r);
    ref += r * r;
  }
  double value() const {
    if (bad) return kInf;
    return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
  }
};

// 1 - 2 <out, ref> / (<out, out> + <ref, ref>); NaN/inf in `out` poison the result.
struct SimilaritySum {
  double xy = 0, xx = 0, yy = 0;
  bool bad = false;
  void add(double x, double y) {
    if (!std::isfinite(x)) bad = true;
    xy += x * y, xx += x * x, yy += y * y;
  }
  double value() const {
    if (bad) return kInf;
    return xx + yy > 0 ? 1.0 - 2.0 * xy / (xx + yy) : 0.0;
  }
};

// Feeds every (out, ref) pair over ref's extent into a Sum; inf when the shapes do not match.
template <class Sum>
double compare(const Matrix& out, const Matrix& ref) {
  if (out.cols != ref.cols || out.rows < ref.rows) return kInf;
  Sum s;
  for (int64_t r = 0; r < ref.rows; ++r)
    for (int64_t c = 0; c < ref.cols; ++c) s.add(out(r, c), ref(r, c));
  return s.value();
}

template <class Sum>
double compare(const Vector& out, const Vector& ref) {
  if (out.size() < ref.size()) return kInf;
  Sum s;
  for (size_t i = 0; i < ref.size(); ++i) s.add(out[i], ref[i]);
  return s.value();
}

template <class Sum>
double compare(const std::vector<Matrix>& out, const std::vector<Matrix>& ref) {
  if (out.size() != ref.size()) return kInf;
  Sum s;
  for (size_t g = 0; g < ref.size(); ++g) {
    if (out[g].rows != ref[g].rows || out[g].cols != ref[g].cols) return kInf;
    for (size_t i = 0; i < ref[g].data.size(); ++i) s.add(out[g].data[i], ref[g].data[i]);
  }
  return s.value();
}
}  // namespace

double rel_error(const Matrix& out, const Matrix& ref) { return compare<ErrorSum>(out, ref); }
double rel_error(const Vector& out, const Vector& ref) { return compare<ErrorSum>(out, ref); }
double rel_error(const std::vector<Matrix>& out, const std::vector<Matrix>& ref) {
  return compare<ErrorSum>(out, ref);
}
double similarity_diff(const Matrix& out, const Matrix& ref) { return compare<SimilaritySum>(out, ref); }
double similarity_diff(const Vector& out, const Vector& ref) { return compare<SimilaritySum>(out, ref); }
double similarity_diff(const std::vector<Matrix>& out, const std::vector<Matrix>& ref) {
  return compare<SimilaritySum>(out, ref);
}

Matrix linear_forward(const Matrix& x, const std::vector<Matrix>& w, const Splits& splits,
                      const Matrix& bias, const Vector& row_scale) {
  const int64_t rows = total_rows(splits);
  const auto owner = expert_of_rows(splits);
  const int64_t N = w.at(0).rows, K = x.cols;
  Matrix y(rows, N);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = owner[size_t(r)];
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += x(r, k) * w[size_t(g)](n, k);
      if (bias.rows > 0) acc += (row_scale.empty() ? 1.0 : row_scale[size_t(r)]) * bias(g, n);
      y(r, n) = acc;
    }
  }
  return y;
}

Matrix linear_dgrad(const Matrix& dy, const std::vector<Matrix>& w, const Splits& splits) {
  const int64_t rows = total_rows(splits);
  const auto owner = expert_of_rows(splits);
  const int64_t N = dy.cols, K = w.at(0).cols;
  Matrix dx(rows, K);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      double acc = 0;
      for (int64_t n = 0; n < N; ++n) acc += dy(r, n) * w[size_t(owner[size_t(r)])](n, k);
      dx(r, k) = acc;
    }
  return dx;
}

std::vector<Matrix> linear_wgrad(const Matrix& dy, const Matrix& x, const Splits& splits) {
  total_rows(splits);
  std::vector<Matrix> dw;
  int64_t begin = 0;
  for (int64_t count : splits) {
    Matrix m(dy.cols, x.cols);
    for (int64_t n = 0; n < dy.cols; ++n)
      for (int64_t k = 0; k < x.cols; ++k) {
        double acc = 0;
        for (int64_t r = begin; r < begin + count; ++r) acc += dy(r, n) * x(r, k);
        m(n, k) = acc;
      }
    dw.push_back(std::move(m));
    begin += count;
  }
  return dw;
}

Matrix linear_dbias(const Matrix& dy, const Splits& splits, const Vector& row_scale) {
  const int64_t rows = total_rows(splits);
  const auto owner = expert_of_rows(splits);
  Matrix db(int64_t(splits.size()), dy.cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < dy.cols; ++n)
      db(owner[size_t(r)], n) += (row_scale.empty() ? 1.0 : row_scale[size_t(r)]) * dy(r, n);
  return db;
}

Vector linear_dscales(const Matrix& dy, const Matrix& bias, const Splits& splits) {
  const int64_t rows = total_rows(splits);
  const auto owner = expert_of_rows(splits);
  Vector dp(size_t(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < dy.cols; ++n) dp[size_t(r)] += dy(r, n) * bias(owner[size_t(r)], n);
  return dp;
}

Matrix glu_forward(const Matrix& h, const Vector& probs, const GluSpec& spec) {
  const bool gated = is_gated(spec.activation);
  const int64_t F = gated ? h.cols / 2 : h.cols;
  Matrix out(h.rows, F);
  for (int64_t r = 0; r < h.rows; ++r)
    for (int64_t j = 0; j < F; ++j) {
      const double p = probs.empty() ? 1.0 : probs[size_t(r)];
      if (!gated) {
        out(r, j) = elementwise(spec.activation, h(r, j)) * p;
        continue;
      }
      const Columns c = glu_columns(spec.layout, j, F);
      out(r, j) = activation(spec, h(r, c.gate), h(r, c.linear)) * p;
    }
  return out;
}

GluGrads glu_backward(const Matrix& h, const Vector& probs, const Matrix& d_out,
                      const GluSpec& spec) {
  const bool gated = is_gated(spec.activation);
  const int64_t F = gated ? h.cols / 2 : h.cols;
  GluGrads g;
  g.dh = Matrix(d_out.rows, h.cols);
  if (!probs.empty()) g.dprobs.assign(size_t(d_out.rows), 0.0);
  for (int64_t r = 0; r < d_out.rows; ++r)
    for (int64_t j = 0; j < F; ++j) {
      const double p = probs.empty() ? 1.0 : probs[size_t(r)];
      double act = 0;
      if (gated) {
        const Columns c = glu_columns(spec.layout, j, F);
        double d_gate = 0, d_linear = 0;
        activation_grad(spec, h(r, c.gate), h(r, c.linear), d_gate, d_linear);
        g.dh(r, c.gate) = d_out(r, j) * p * d_gate;
        g.dh(r, c.linear) = d_out(r, j) * p * d_linear;
        act = activation(spec, h(r, c.gate), h(r, c.linear));
      } else {
        g.dh(r, j) = d_out(r, j) * p * elementwise_grad(spec.activation, h(r, j));
        act = elementwise(spec.activation, h(r, j));
      }
      if (!probs.empty()) g.dprobs[size_t(r)] += act * d_out(r, j);
    }
  return g;
}

MlpForward mlp_forward(const Matrix& x, const Vector& probs, const MlpParams& params,
                       const Splits& splits, const GluSpec& spec) {
  MlpForward f;
  f.h = linear_forward(x, params.w1, splits, params.b1, {});
  f.a = glu_forward(f.h, probs, spec);
  f.y = linear_forward(f.a, params.w2, splits, params.b2, probs);
  return f;
}

MlpGrads mlp_backward(const Matrix& dy, const Matrix& x, const Vector& probs,
                      const MlpParams& params, const Splits& splits, const GluSpec& spec) {
  const MlpForward f = mlp_forward(x, probs, params, splits, spec);
  MlpGrads g;
  const Matrix d_a = linear_dgrad(dy, params.w2, splits);
  GluGrads glu = glu_backward(f.h, probs, d_a, spec);
  g.dprobs = glu.dprobs;
  if (!probs.empty() && params.b2.rows > 0) {
    const Vector extra = linear_dscales(dy, params.b2, splits);
    for (size_t r = 0; r < extra.size(); ++r) g.dprobs[r] += extra[r];
  }
  g.dw2 = linear_wgrad(dy, f.a, splits);
  if (params.b2.rows > 0) g.db2 = linear_dbias(dy, splits, probs);
  if (params.b1.rows > 0) g.db1 = linear_dbias(glu.dh, splits, {});
  g.dw1 = linear_wgrad(glu.dh, x, splits);
  g.dx = linear_dgrad(glu.dh, params.w1, splits);
  return g;
}

}  // namespace moe::oracle
