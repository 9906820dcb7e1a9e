// The one matrix-product loop of the CPU backend: for every expert g, C_g = A_g B_g^T with both
// operands loaded tile by tile into accumulator-typed panels (rows of length L, the contraction).
// Forward, dgrad and wgrad differ only in how they load the panels and what they do with C.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/convert.hpp"

namespace moe::cpu {

inline constexpr int64_t kTile = 64;

struct GemmExtent {
  int64_t m, n, l;  // C is m x n, contraction length l
};

template <class Acc>
inline Acc dot(const Acc* a, const Acc* b, int64_t n) {
  Acc s[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) s[u] += a[i + u] * b[i + u];
  Acc t = 0;
  for (; i < n; ++i) t += a[i] * b[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + t;
}

// extent(g) -> GemmExtent; load_a(g, i0, ni, Acc* panel) fills panel[i * l + k] = A_g(i0 + i, k);
// load_b(g, j0, nj, Acc* panel) likewise for B_g; contract(g, i, j, const Acc* a, const Acc* b, l)
// returns C_g(i, j) from row i of A_g and row j of B_g; emit(g, i0, ni, j0, nj, const Acc* c)
// consumes c[i * kTile + j] = C_g(i0 + i, j0 + j). Tiles run in parallel; each C element has one
// owner.
template <class Acc, class Extent, class LoadA, class LoadB, class Contract, class Emit>
void grouped_gemm_tiles(int64_t num_groups, Extent extent, LoadA load_a, LoadB load_b, Contract contract,
                        Emit emit) {
  struct Task {
    int64_t g, i0, j0;
  };
  std::vector<Task> tasks;
  for (int64_t g = 0; g < num_groups; ++g) {
    const GemmExtent e = extent(g);
    for (int64_t i0 = 0; i0 < e.m; i0 += kTile)
      for (int64_t j0 = 0; j0 < e.n; j0 += kTile) tasks.push_back({g, i0, j0});
  }
  const int64_t num_tasks = int64_t(tasks.size());
#pragma omp parallel
  {
    std::vector<Acc> a, b, c(static_cast<size_t>(kTile * kTile));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tasks; ++t) {
      const Task task = tasks[size_t(t)];
      const GemmExtent e = extent(task.g);
      const int64_t ni = std::min(kTile, e.m - task.i0);
      const int64_t nj = std::min(kTile, e.n - task.j0);
      a.resize(size_t(ni * e.l));
      b.resize(size_t(nj * e.l));
      load_a(task.g, task.i0, ni, a.data());
      load_b(task.g, task.j0, nj, b.data());
      for (int64_t i = 0; i < ni; ++i)
        for (int64_t j = 0; j < nj; ++j)
          c[size_t(i * kTile + j)] =
              contract(task.g, task.i0 + i, task.j0 + j, a.data() + i * e.l, b.data() + j * e.l, e.l);
      emit(task.g, task.i0, ni, task.j0, nj, c.data());
    }
  }
}

// The plain product: C_g(i, j) = <row i of A_g, row j of B_g>.
template <class Acc, class Extent, class LoadA, class LoadB, class Emit>
void grouped_gemm_tiles(int64_t num_groups, Extent extent, LoadA load_a, LoadB load_b, Emit emit) {
  grouped_gemm_tiles<Acc>(
      num_groups, extent, load_a, load_b,
      [](int64_t, int64_t, int64_t, const Acc* a, const Acc* b, int64_t l) { return dot(a, b, l); }, emit);
}

// panel[i * l + k] = t(row0 + i, col0 + k) for i < nrows, k < l (rows of a 2-D view).
template <class Acc>
void load_rows(const TensorView& t, int64_t row0, int64_t nrows, int64_t col0, int64_t l,
               Acc* panel) {
  for (int64_t i = 0; i < nrows; ++i)
    load(element_ptr(t, row0 + i, col0), t.dtype(), l, 1, panel + i * l);
}

// panel[i * l + k] = t(row0 + k, col0 + i) for i < ncols, k < l: a column panel, read row by row.
template <class Acc>
void load_columns(const TensorView& t, int64_t row0, int64_t l, int64_t col0, int64_t ncols,
                  Acc* panel) {
  std::vector<Acc> row(static_cast<size_t>(ncols));
  for (int64_t k = 0; k < l; ++k) {
    load(element_ptr(t, row0 + k, col0), t.dtype(), ncols, 1, row.data());
    for (int64_t i = 0; i < ncols; ++i) panel[i * l + k] = row[size_t(i)];
  }
}

}  // namespace moe::cpu
