// The router's float64 oracle: every step from its definition in docs/design.md section 13 (and
// Megatron-LM's formulas), as plainly as possible. Choices come from sorting; gradients from the
// Jacobian of each step, multiplied out.
#include "oracle/router_oracle.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "moe_engine/error.hpp"

namespace moe::oracle {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEpsilon = 1e-20;  // added to the sums that normalize (Megatron-LM, DeepSeek-V3)

Vector row_of(const Matrix& m, int64_t r) {
  return Vector(m.data.begin() + r * m.cols, m.data.begin() + (r + 1) * m.cols);
}

Vector softmax(const Vector& l) {
  const double m = *std::max_element(l.begin(), l.end());
  Vector s(l.size());
  double sum = 0;
  for (size_t e = 0; e < l.size(); ++e) sum += s[e] = std::exp(l[e] - m);
  for (double& v : s) v /= sum;
  return s;
}

double logsumexp(const Vector& l) {
  const double m = *std::max_element(l.begin(), l.end());
  double sum = 0;
  for (double v : l) sum += std::exp(v - m);
  return m + std::log(sum);
}

Vector scores(const Vector& l, RouterScore score) {
  if (score == RouterScore::kSoftmax) return softmax(l);
  Vector s(l.size());
  for (size_t e = 0; e < l.size(); ++e) s[e] = 1 / (1 + std::exp(-l[e]));
  return s;
}

// The load-balancing loss's scores: the softmax, or the sigmoid scores over their sum.
Vector aux_scores(const Vector& s, RouterScore score) {
  if (score == RouterScore::kSoftmax) return s;
  const double total = std::accumulate(s.begin(), s.end(), 0.0) + kEpsilon;
  Vector q(s.size());
  for (size_t e = 0; e < s.size(); ++e) q[e] = s[e] / total;
  return q;
}

// `candidates` ordered by value, larger first, equal values by the lower index.
std::vector<int64_t> ranked(const Vector& value, std::vector<int64_t> candidates) {
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](int64_t a, int64_t b) { return value[size_t(a)] > value[size_t(b)]; });
  return candidates;
}

// 0, 1, ..., n - 1.
std::vector<int64_t> first_indices(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), int64_t(0));
  return v;
}

// How close two values whose order mattered came: equal values (equal inputs) are no risk.
double gap(double a, double b) { return a == b ? kInf : std::abs(a - b); }

// The first k of `order`, and the margin of that choice (and of its order when `ordered`).
std::vector<int64_t> take(const std::vector<int64_t>& order, const Vector& value, int64_t k,
                          bool ordered, double& margin) {
  for (int64_t j = 0; j + 1 < k && ordered; ++j)
    margin =
        std::min(margin, gap(value[size_t(order[size_t(j)])], value[size_t(order[size_t(j + 1)])]));
  if (int64_t(order.size()) > k)
    margin =
        std::min(margin, gap(value[size_t(order[size_t(k - 1)])], value[size_t(order[size_t(k)])]));
  return std::vector<int64_t>(order.begin(), order.begin() + k);
}

// The experts a token may choose from: all, or those of its topk_groups best groups (a group scored
// by the sum of its two best selection scores).
std::vector<int64_t> eligible_experts(const Vector& sel, const RouterSpec& spec, double& margin) {
  const int64_t E = int64_t(sel.size());
  if (spec.num_groups <= 1) return first_indices(E);
  const int64_t size = E / spec.num_groups;
  Vector group_score(size_t(spec.num_groups));
  for (int64_t g = 0; g < spec.num_groups; ++g) {
    Vector members(sel.begin() + g * size, sel.begin() + (g + 1) * size);
    std::sort(members.begin(), members.end(), std::greater<double>());
    group_score[size_t(g)] = members[0] + (size > 1 ? members[1] : 0.0);
  }
  const std::vector<int64_t> kept = take(ranked(group_score, first_indices(spec.num_groups)),
                                         group_score, spec.topk_groups, /*ordered=*/false, margin);
  std::vector<int64_t> experts;
  for (int64_t e = 0; e < E; ++e)
    if (std::find(kept.begin(), kept.end(), e / size) != kept.end()) experts.push_back(e);
  return experts;
}

Vector probs_of(const Vector& s, const std::vector<int64_t>& choice, const RouterSpec& spec) {
  Vector p(choice.size());
  double total = 0;
  for (size_t j = 0; j < choice.size(); ++j) total += p[j] = s[size_t(choice[j])];
  for (double& v : p) v = (spec.norm_topk_prob ? v / (total + kEpsilon) : v) * spec.scaling_factor;
  return p;
}

Matrix logits_of(const Matrix& x, const Matrix& weight) {
  Matrix l(x.rows, weight.rows);
  for (int64_t t = 0; t < x.rows; ++t)
    for (int64_t e = 0; e < weight.rows; ++e)
      for (int64_t h = 0; h < x.cols; ++h) l(t, e) += x(t, h) * weight(e, h);
  return l;
}

double aux_factor(const RouterSpec& spec, int64_t T, int64_t E) {
  return T == 0 ? 0.0
                : spec.aux_loss_coeff * double(E) / (double(spec.topk) * double(T) * double(T));
}

}  // namespace

RouterForward router_forward(const Matrix& x, const Matrix& weight, const Vector& bias,
                             const RouterSpec& spec) {
  MOE_CHECK(x.cols == weight.cols, ErrorCode::kShape, "oracle::router_forward: x has ", x.cols,
            " features, the weight ", weight.cols);
  const int64_t T = x.rows, E = weight.rows, k = spec.topk;
  RouterForward out;
  out.logits = logits_of(x, weight);
  out.probs = Matrix(T, k);
  out.counts.assign(size_t(E), 0);
  out.aux_counts.assign(size_t(E), 0);
  out.margin.assign(size_t(T), kInf);
  Vector score_sums(size_t(E), 0.0);
  double lse_squares = 0;
  for (int64_t t = 0; t < T; ++t) {
    const Vector l = row_of(out.logits, t);
    const Vector s = scores(l, spec.score);
    Vector sel = s;
    if (!bias.empty())
      for (int64_t e = 0; e < E; ++e) sel[size_t(e)] += bias[size_t(e)];
    double& margin = out.margin[size_t(t)];
    const std::vector<int64_t> choice =
        take(ranked(sel, eligible_experts(sel, spec, margin)), sel, k, /*ordered=*/true, margin);
    const Vector p = probs_of(s, choice, spec);
    for (int64_t j = 0; j < k; ++j) {
      out.probs(t, j) = p[size_t(j)];
      ++out.counts[size_t(choice[size_t(j)])];
    }
    out.indices.push_back(choice);
    const Vector q = aux_scores(s, spec.score);
    const std::vector<int64_t> aux_choice =
        take(ranked(q, first_indices(E)), q, k, /*ordered=*/false, margin);
    for (int64_t e : aux_choice) ++out.aux_counts[size_t(e)];
    out.aux_indices.push_back(aux_choice);
    for (int64_t e = 0; e < E; ++e) score_sums[size_t(e)] += q[size_t(e)];
    lse_squares += std::pow(logsumexp(l), 2);
  }
  for (int64_t e = 0; e < E; ++e)
    out.aux_loss += score_sums[size_t(e)] * double(out.aux_counts[size_t(e)]);
  out.aux_loss *= aux_factor(spec, T, E);
  out.z_loss = T == 0 ? 0.0 : spec.z_loss_coeff * lse_squares / double(T);
  return out;
}

Matrix router_probs(const Matrix& logits, const Choices& indices, const RouterSpec& spec) {
  Matrix p(logits.rows, spec.topk);
  for (int64_t t = 0; t < logits.rows; ++t) {
    const Vector pt = probs_of(scores(row_of(logits, t), spec.score), indices[size_t(t)], spec);
    for (int64_t j = 0; j < spec.topk; ++j) p(t, j) = pt[size_t(j)];
  }
  return p;
}

RouterGrads router_backward(const Matrix& x, const Matrix& weight, const Choices& indices,
                            const std::vector<int64_t>& aux_counts, const Matrix& d_probs,
                            double d_aux, double d_z, const RouterSpec& spec) {
  const int64_t T = x.rows, H = x.cols, E = weight.rows, k = spec.topk;
  const Matrix logits = logits_of(x, weight);
  Matrix d_logits(T, E);
  for (int64_t t = 0; t < T; ++t) {
    const Vector l = row_of(logits, t), s = scores(l, spec.score);
    const std::vector<int64_t>& c = indices[size_t(t)];
    Vector ds(size_t(E), 0.0);  // dL/ds
    if (d_probs.rows > 0) {     // p_j = scaling r_j / (R + eps) (or scaling r_j), r_j = s[c_j]
      double R = 0;
      for (int64_t j = 0; j < k; ++j) R += s[size_t(c[size_t(j)])];
      for (int64_t j = 0; j < k; ++j)
        for (int64_t i = 0; i < k; ++i) {  // dp_j / dr_i
          const double r_j = s[size_t(c[size_t(j)])];
          const double dp_dr =
              spec.norm_topk_prob
                  ? ((i == j ? 1.0 : 0.0) / (R + kEpsilon) - r_j / std::pow(R + kEpsilon, 2))
                  : (i == j ? 1.0 : 0.0);
          ds[size_t(c[size_t(i)])] += d_probs(t, j) * spec.scaling_factor * dp_dr;
        }
    }
    if (d_aux != 0) {  // aux = factor sum_e count_e sum_t q_te
      const double factor = aux_factor(spec, T, E);
      const double Q = std::accumulate(s.begin(), s.end(), 0.0) + kEpsilon;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t i = 0; i < E; ++i) {  // dq_e / ds_i
          const double dq_ds = spec.score == RouterScore::kSoftmax
                                   ? (e == i ? 1.0 : 0.0)
                                   : (e == i ? 1.0 : 0.0) / Q - s[size_t(e)] / (Q * Q);
          ds[size_t(i)] += d_aux * factor * double(aux_counts[size_t(e)]) * dq_ds;
        }
    }
    for (int64_t j = 0; j < E; ++j) {  // dl_j = sum_i ds_i ds_i/dl_j
      double v = 0;
      for (int64_t i = 0; i < E; ++i) {
        const double ds_dl = spec.score == RouterScore::kSoftmax
                                 ? s[size_t(i)] * ((i == j ? 1.0 : 0.0) - s[size_t(j)])
                                 : (i == j ? s[size_t(i)] * (1 - s[size_t(i)]) : 0.0);
        v += ds[size_t(i)] * ds_dl;
      }
      d_logits(t, j) = v;
    }
    if (d_z != 0) {  // z = coeff / T sum_t lse_t^2
      const Vector softmax_of_logits = softmax(l);
      const double lse = logsumexp(l);
      for (int64_t e = 0; e < E; ++e)
        d_logits(t, e) +=
            d_z * spec.z_loss_coeff / double(T) * 2 * lse * softmax_of_logits[size_t(e)];
    }
  }
  RouterGrads g{Matrix(T, H), Matrix(E, H)};
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t h = 0; h < H; ++h) {
        g.dx(t, h) += d_logits(t, e) * weight(e, h);
        g.dweight(e, h) += d_logits(t, e) * x(t, h);
      }
  return g;
}

}  // namespace moe::oracle
