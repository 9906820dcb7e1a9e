// The three grouped GEMMs of a grouped linear layer (N output, K input features, T rows).
#pragma once

namespace moe::cuda {

enum class Form : int {
  kForward = 0,  // D[T, N]   = A[T, K] B_g^T, B_g = W_g [N, K]       (A, B K-major)
  kDgrad = 1,    // D[T, K]   = A[T, N] B_g,   B_g = W_g [N, K]       (A K-major, B MN-major)
  kWgrad = 2,    // D_g[N, K] = A_g^T B_g, A = dY [T, N], B = X [T, K] (A, B MN-major; K-grouped)
};

}  // namespace moe::cuda
