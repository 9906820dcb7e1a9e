// The float64 oracle of the router (moe_engine/router.hpp, docs/design.md section 13), written from
// the definitions and sharing nothing with the backends: the choices by sorting, the gradients by
// chaining explicit Jacobian matrices. It also says how close each token came to a tie that would
// change its choice: a float32 backend may decide such a token otherwise, and tests skip it.
#pragma once

#include <cstdint>
#include <vector>

#include "moe_engine/router_spec.hpp"
#include "oracle/oracle.hpp"

namespace moe::oracle {

using Choices = std::vector<std::vector<int64_t>>;  // [T][k] experts, best first

struct RouterForward {
  Matrix logits;  // [T, E]
  Choices indices;
  Matrix probs;  // [T, k]
  std::vector<int64_t> counts;
  Choices aux_indices;  // the load-balancing loss's top-k (Megatron's routing map for it)
  std::vector<int64_t> aux_counts;
  double aux_loss = 0, z_loss = 0;
  // Per token, the smallest gap between two values whose order decided its choices (the kept
  // groups, its experts and their order, its load-balancing top-k); ties of equal inputs, which
  // every backend breaks by index, do not count. Infinity when nothing was close.
  std::vector<double> margin;
};

// bias: [E] or empty.
RouterForward router_forward(const Matrix& x, const Matrix& weight, const Vector& bias,
                             const RouterSpec& spec);

// The probabilities of given choices: [T, k].
Matrix router_probs(const Matrix& logits, const Choices& indices, const RouterSpec& spec);

struct RouterGrads {
  Matrix dx;       // [T, H]
  Matrix dweight;  // [E, H]
};
// d_probs [T, k] (empty: zero); d_aux, d_z the gradients of the two losses.
RouterGrads router_backward(const Matrix& x, const Matrix& weight, const Choices& indices,
                            const std::vector<int64_t>& aux_counts, const Matrix& d_probs,
                            double d_aux, double d_z, const RouterSpec& spec);

}  // namespace moe::oracle
