#include <vector>

#include "cpu/backend.hpp"
#include "cpu/epilogue.hpp"
#include "cpu/tiled_gemm.hpp"

namespace moe::cpu {
namespace {

const int64_t* offsets_of(const GroupLayout& groups) { return groups.offsets().data_as<int64_t>(); }

int64_t rows_of(const GroupLayout& groups, int64_t g) {
  const int64_t* off = offsets_of(groups);
  return off[g + 1] - off[g];
}

template <class Acc>
void forward(const TensorView& x, const GroupedParam& weight, const GroupLayout& groups,
             const TensorView& y, const BiasEpilogue& epi) {
  const int64_t* off = offsets_of(groups);
  const int64_t K = x.size(1), N = y.size(1);
  grouped_gemm_tiles<Acc>(
      groups.num_groups(),
      [&](int64_t g) {
        return GemmExtent{rows_of(groups, g), N, K};
      },
      [&](int64_t g, int64_t i0, int64_t ni, Acc* p) { load_rows(x, off[g] + i0, ni, 0, K, p); },
      [&](int64_t g, int64_t j0, int64_t nj, Acc* p) {
        load_rows(weight.expert(g), j0, nj, 0, K, p);
      },
      [&](int64_t g, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const Acc* c) {
        emit_forward_tile(y, epi, g, off[g] + i0, ni, j0, nj, c);
      });
}

template <class Acc>
void dgrad(const TensorView& dy, const GroupedParam& weight, const GroupLayout& groups,
           const TensorView& dx) {
  const int64_t* off = offsets_of(groups);
  const int64_t N = dy.size(1), K = dx.size(1);
  grouped_gemm_tiles<Acc>(
      groups.num_groups(),
      [&](int64_t g) {
        return GemmExtent{rows_of(groups, g), K, N};
      },
      [&](int64_t g, int64_t i0, int64_t ni, Acc* p) { load_rows(dy, off[g] + i0, ni, 0, N, p); },
      [&](int64_t g, int64_t j0, int64_t nj, Acc* p) {
        load_columns(weight.expert(g), 0, N, j0, nj, p);
      },
      [&](int64_t g, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const Acc* c) {
        for (int64_t i = 0; i < ni; ++i)
          store(c + i * kTile, nj, element_ptr(dx, off[g] + i0 + i, j0), dx.dtype());
      });
}

template <class Acc>
void wgrad(const TensorView& dy, const TensorView& x, const GroupLayout& groups,
           const GroupedParam& dweight, GradMode mode) {
  const int64_t* off = offsets_of(groups);
  const int64_t N = dy.size(1), K = x.size(1);
  grouped_gemm_tiles<Acc>(
      groups.num_groups(),
      [&](int64_t g) {
        return GemmExtent{N, K, rows_of(groups, g)};
      },
      [&](int64_t g, int64_t i0, int64_t ni, Acc* p) {
        load_columns(dy, off[g], rows_of(groups, g), i0, ni, p);
      },
      [&](int64_t g, int64_t j0, int64_t nj, Acc* p) {
        load_columns(x, off[g], rows_of(groups, g), j0, nj, p);
      },
      [&](int64_t g, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const Acc* c) {
        emit_wgrad_tile(dweight, mode, g, rows_of(groups, g) == 0, i0, ni, j0, nj, c);
      });
}

template <class Acc>
void dbias(const TensorView& dy, const GroupLayout& groups, const GroupedParam& db, GradMode mode,
           const TensorView& row_scale) {
  const int64_t* off = offsets_of(groups);
  const int64_t N = dy.size(1), G = groups.num_groups();
#pragma omp parallel
  {
    const auto n = static_cast<size_t>(N);
    std::vector<Acc> sum(n), row(n), scratch(n);
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < G; ++g) {
      if (mode == GradMode::kAccumulate && off[g + 1] == off[g]) continue;
      std::fill(sum.begin(), sum.end(), Acc(0));
      for (int64_t r = off[g]; r < off[g + 1]; ++r) {
        load(element_ptr(dy, r, 0), dy.dtype(), N, 1, row.data());
        const Acc s = row_scale.defined() ? load_at<Acc>(row_scale, r) : Acc(1);
        for (int64_t n = 0; n < N; ++n) sum[size_t(n)] += s * row[size_t(n)];
      }
      emit_grad(sum.data(), N, db.expert(g).data(), db.dtype(), mode, scratch.data());
    }
  }
}

template <class Acc>
void dscales(const TensorView& dy, const GroupedParam& bias, const GroupLayout& groups,
             const TensorView& out, bool accumulate) {
  const int64_t* off = offsets_of(groups);
  const int64_t N = dy.size(1), G = groups.num_groups();
#pragma omp parallel
  {
    std::vector<Acc> b(static_cast<size_t>(N)), row(static_cast<size_t>(N));
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < G; ++g) {
      if (off[g + 1] == off[g]) continue;
      load(bias.expert(g).data(), bias.dtype(), N, 1, b.data());
      for (int64_t r = off[g]; r < off[g + 1]; ++r) {
        load(element_ptr(dy, r, 0), dy.dtype(), N, 1, row.data());
        Acc v = dot(row.data(), b.data(), N);
        if (accumulate) v = load_at<Acc>(out, r) + v;
        store(&v, 1, element_ptr_1d(out, r), out.dtype());
      }
    }
  }
}

// float64 inputs accumulate in float64, everything else in float32.

}  // namespace

void grouped_linear_forward(const TensorView& x, const GroupedParam& weight,
                            const GroupLayout& groups, const TensorView& y,
                            const BiasEpilogue& bias) {
  with_accumulator(x.dtype(),
                   [&](auto acc) { forward<decltype(acc)>(x, weight, groups, y, bias); });
}

void grouped_linear_dgrad(const TensorView& dy, const GroupedParam& weight,
                          const GroupLayout& groups, const TensorView& dx) {
  with_accumulator(dy.dtype(), [&](auto acc) { dgrad<decltype(acc)>(dy, weight, groups, dx); });
}

void grouped_linear_wgrad(const TensorView& dy, const TensorView& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode) {
  with_accumulator(x.dtype(),
                   [&](auto acc) { wgrad<decltype(acc)>(dy, x, groups, dweight, mode); });
}

void grouped_linear_dbias(const TensorView& dy, const GroupLayout& groups, const GroupedParam& db,
                          GradMode mode, const TensorView& row_scale) {
  with_accumulator(dy.dtype(),
                   [&](auto acc) { dbias<decltype(acc)>(dy, groups, db, mode, row_scale); });
}

void grouped_linear_dscales(const TensorView& dy, const GroupedParam& bias,
                            const GroupLayout& groups, const TensorView& out, bool accumulate) {
  with_accumulator(dy.dtype(),
                   [&](auto acc) { dscales<decltype(acc)>(dy, bias, groups, out, accumulate); });
}

}  // namespace moe::cpu
