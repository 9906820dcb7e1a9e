// The float64 oracle of permute and unpermute (moe_engine/permute.hpp, docs/design.md section 14):
// the routing as host vectors, the plan walked expert by expert (where the backends count and
// scan), the row moves and sums in float64. Shares nothing with the backends.
#pragma once

#include <cstdint>
#include <vector>

#include "oracle/oracle.hpp"

namespace moe::oracle {

// indices [T, k] row-major: token t's j-th expert at t * k + j.
struct PermutePlan {
  int64_t tokens = 0, topk = 0;
  std::vector<int64_t> row_of;   // [T * k]: the row of assignment (t, j), -1 if dropped
  Splits splits;                 // [E]: kept assignments per expert
  std::vector<int64_t> dropped;  // [E]
  int64_t rows() const;          // sum(splits): the routed rows
};

// Each expert in turn takes its assignments in token order (then j order), keeping the first
// `capacity` (all with capacity < 0), onto the rows after the previous experts'.
PermutePlan permute_plan(const std::vector<int64_t>& indices, int64_t tokens, int64_t topk,
                         int64_t num_experts, int64_t capacity = -1);

// x_sorted [rows, H]: row_of(t, j) holds x[t]; rows no assignment holds are zeros.
Matrix permute(const Matrix& x, const PermutePlan& plan, int64_t rows);
// y [T, H] = sum_j p[t, j] out[row(t, j)] over the kept assignments; probs [T, k], empty = 1.
Matrix unpermute(const Matrix& out, const Matrix& probs, const PermutePlan& plan);
// probs_sorted [rows]: p[t, j] at row(t, j), zeros elsewhere.
Vector permute_probs(const Matrix& probs, const PermutePlan& plan, int64_t rows);

// unpermute's gradients from dy [T, H]: d_out [rows, H] (p[t, j] dy[t] at row(t, j), zeros
// elsewhere) and d_probs [T, k] (<dy[t], out[row(t, j)]>, 0 dropped; empty when probs is empty).
struct UnpermuteGrads {
  Matrix d_out, d_probs;
};
UnpermuteGrads unpermute_backward(const Matrix& dy, const Matrix& out, const Matrix& probs,
                                  const PermutePlan& plan, int64_t rows);

}  // namespace moe::oracle
