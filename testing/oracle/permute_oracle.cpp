#include "oracle/permute_oracle.hpp"

#include "moe_engine/error.hpp"

namespace moe::oracle {

int64_t PermutePlan::rows() const {
  int64_t n = 0;
  for (int64_t s : splits) n += s;
  return n;
}

PermutePlan permute_plan(const std::vector<int64_t>& indices, int64_t tokens, int64_t topk,
                         int64_t num_experts, int64_t capacity) {
  MOE_CHECK(int64_t(indices.size()) == tokens * topk, ErrorCode::kShape, "oracle: ", indices.size(),
            " indices for T k = ", tokens * topk);
  PermutePlan plan;
  plan.tokens = tokens;
  plan.topk = topk;
  plan.row_of.assign(indices.size(), -1);
  int64_t next_row = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t seen = 0, kept = 0;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < topk; ++j) {
        if (indices[size_t(t * topk + j)] != e) continue;
        if (capacity < 0 || seen < capacity) {
          plan.row_of[size_t(t * topk + j)] = next_row++;
          ++kept;
        }
        ++seen;
      }
    plan.splits.push_back(kept);
    plan.dropped.push_back(seen - kept);
  }
  return plan;
}

Matrix permute(const Matrix& x, const PermutePlan& plan, int64_t rows) {
  Matrix sorted(rows, x.cols);
  for (int64_t t = 0; t < plan.tokens; ++t)
    for (int64_t j = 0; j < plan.topk; ++j) {
      const int64_t r = plan.row_of[size_t(t * plan.topk + j)];
      if (r < 0) continue;
      for (int64_t h = 0; h < x.cols; ++h) sorted(r, h) = x(t, h);
    }
  return sorted;
}

Vector permute_probs(const Matrix& probs, const PermutePlan& plan, int64_t rows) {
  Vector sorted(size_t(rows), 0.0);
  for (int64_t t = 0; t < plan.tokens; ++t)
    for (int64_t j = 0; j < plan.topk; ++j) {
      const int64_t r = plan.row_of[size_t(t * plan.topk + j)];
      if (r >= 0) sorted[size_t(r)] = probs(t, j);
    }
  return sorted;
}

Matrix unpermute(const Matrix& out, const Matrix& probs, const PermutePlan& plan) {
  Matrix y(plan.tokens, out.cols);
  for (int64_t t = 0; t < plan.tokens; ++t)
    for (int64_t j = 0; j < plan.topk; ++j) {
      const int64_t r = plan.row_of[size_t(t * plan.topk + j)];
      if (r < 0) continue;
      const double p = probs.rows ? probs(t, j) : 1.0;
      for (int64_t h = 0; h < out.cols; ++h) y(t, h) += p * out(r, h);
    }
  return y;
}

UnpermuteGrads unpermute_backward(const Matrix& dy, const Matrix& out, const Matrix& probs,
                                  const PermutePlan& plan, int64_t rows) {
  UnpermuteGrads g;
  g.d_out = Matrix(rows, dy.cols);
  if (probs.rows) g.d_probs = Matrix(plan.tokens, plan.topk);
  for (int64_t t = 0; t < plan.tokens; ++t)
    for (int64_t j = 0; j < plan.topk; ++j) {
      const int64_t r = plan.row_of[size_t(t * plan.topk + j)];
      if (r < 0) continue;
      const double p = probs.rows ? probs(t, j) : 1.0;
      double dot = 0;
      for (int64_t h = 0; h < dy.cols; ++h) {
        g.d_out(r, h) = p * dy(t, h);
        if (probs.rows) dot += dy(t, h) * out(r, h);
      }
      if (probs.rows) g.d_probs(t, j) = dot;
    }
  return g;
}

}  // namespace moe::oracle
