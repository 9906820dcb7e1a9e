// Permute and unpermute on the CPU backend: the plan as a counting sort in token order, then one
// token at a time (rows of different tokens are disjoint, so threads split the tokens). The CUDA
// kernels give the same bits: copies are copies, and every float32 sum adds its terms in the order
// written here (common/permute_order.hpp for the row dot product).
#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "common/permute_order.hpp"
#include "cpu/backend.hpp"
#include "cpu/convert.hpp"

namespace moe::cpu {
namespace {

int64_t index_at(const TensorView& indices, int64_t i) {
  return indices.dtype() == DType::kInt32 ? int64_t(indices.data_as<int32_t>()[i])
                                          : indices.data_as<int64_t>()[i];
}

// Element i of a contiguous tensor of any float dtype.
template <class Acc>
Acc value_at(const TensorView& t, int64_t i) {
  Acc v;
  load(static_cast<const char*>(t.data()) + i * int64_t(t.element_size()), t.dtype(), 1, 1, &v);
  return v;
}

template <class Acc>
void store_at(const TensorView& t, int64_t i, Acc v) {
  store(&v, 1, static_cast<char*>(t.data()) + i * int64_t(t.element_size()), t.dtype());
}

// The row dot product in the lane order of common/permute_order.hpp, lanes of `vector` elements.
template <class Acc>
Acc lane_order_dot(const Acc* a, const Acc* b, int64_t n, int64_t vector) {
  std::array<Acc, detail::kDotLanes> lane{};
  for (int64_t v = 0; v * vector < n; ++v) {
    Acc& s = lane[size_t(v % detail::kDotLanes)];
    for (int64_t e = v * vector; e < std::min(n, v * vector + vector); ++e) {
      const Acc product = a[e] * b[e];  // rounded on its own, as the kernel's multiplication
      s += product;
    }
  }
  for (int m = detail::kDotWarpLanes / 2; m >= 1; m /= 2) {
    std::array<Acc, detail::kDotLanes> next;
    for (size_t l = 0; l < lane.size(); ++l) next[l] = lane[l] + lane[l ^ size_t(m)];
    lane = next;
  }
  Acc total = 0;
  for (size_t w = 0; w < lane.size(); w += detail::kDotWarpLanes) total += lane[w];
  return total;
}

}  // namespace

void permute_plan(const TensorView& indices, int64_t expert_capacity, const TensorView& row_of,
                  const TensorView& splits, const TensorView& dropped) {
  const int64_t n = indices.numel(), E = splits.size(0);
  std::vector<int64_t> count(size_t(E), 0), next_rank(size_t(E), 0), first_row(size_t(E), 0);
  for (int64_t i = 0; i < n; ++i) ++count[size_t(index_at(indices, i))];
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t kept = std::min(count[size_t(e)], expert_capacity);
    first_row[size_t(e)] = row;
    row += kept;
    splits.data_as<int64_t>()[e] = kept;
    if (dropped.defined()) dropped.data_as<int64_t>()[e] = count[size_t(e)] - kept;
  }
  auto* rows = row_of.data_as<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    const auto e = size_t(index_at(indices, i));
    const int64_t rank = next_rank[e]++;
    rows[i] = rank < expert_capacity ? int32_t(first_row[e] + rank) : -1;
  }
}

void send_plan(const TensorView& indices, const TensorView& row_of_expert, int64_t local_experts, int64_t capacity,
               const TensorView& row_send, const TensorView& ids, const TensorView& splits, const TensorView& dropped) {
  const int64_t n = indices.numel(), P = splits.size(0), L = local_experts;
  std::vector<int64_t> count(size_t(P), 0);
  auto* rows = row_send.data_as<int32_t>();
  auto* id = ids.data_as<int32_t>();
  std::fill(id, id + P * capacity, int32_t(L));
  const int32_t* kept = row_of_expert.defined() ? row_of_expert.data_as<const int32_t>() : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = -1;
    if (kept != nullptr && kept[i] < 0) continue;  // the layer dropped it already
    const int64_t e = index_at(indices, i), d = e / L;
    const int64_t rank = count[size_t(d)]++;
    if (rank >= capacity) continue;
    rows[i] = int32_t(d * capacity + rank);
    id[d * capacity + rank] = int32_t(e - d * L);
  }
  for (int64_t d = 0; d < P; ++d) {
    splits.data_as<int64_t>()[d] = capacity;
    if (dropped.defined()) dropped.data_as<int64_t>()[d] = std::max<int64_t>(count[size_t(d)] - capacity, 0);
  }
}

void permute(const TensorView& x, const TensorView& probs, const TensorView& row_of,
             const GroupLayout& /*groups*/, const TensorView& x_sorted,
             const TensorView& probs_sorted) {
  const int64_t T = x.size(0), k = row_of.size(1);
  const size_t row_bytes = size_t(x.size(1)) * x.element_size(),
               prob_bytes = probs.defined() ? probs.element_size() : 0;
  const auto* rows = row_of.data_as<const int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = rows[t * k + j];
      if (row < 0) continue;
      std::memcpy(element_ptr(x_sorted, row, 0), element_ptr(x, t, 0), row_bytes);
      if (probs.defined())
        std::memcpy(static_cast<char*>(probs_sorted.data()) + size_t(row) * prob_bytes,
                    static_cast<const char*>(probs.data()) + size_t(t * k + j) * prob_bytes,
                    prob_bytes);
    }
}

void unpermute(const TensorView& out, const TensorView& probs, const TensorView& row_of,
               const GroupLayout& /*groups*/, const TensorView& y, const TensorView& sorted_probs,
               const TensorView& gathered) {
  const int64_t T = y.size(0), H = y.size(1), k = row_of.size(1);
  const size_t prob_bytes = gathered.defined() ? gathered.element_size() : 0;
  const auto* rows = row_of.data_as<const int32_t>();
  with_accumulator(out.dtype(), [&](auto acc) {
    using Acc = decltype(acc);
#pragma omp parallel
    {
      std::vector<Acc> sum(static_cast<size_t>(H)), term(static_cast<size_t>(H));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        std::fill(sum.begin(), sum.end(), Acc(0));
        for (int64_t j = 0; j < k; ++j) {
          const int64_t row = rows[t * k + j];
          if (row < 0) continue;  // dropped: no term
          const Acc p = probs.defined() ? value_at<Acc>(probs, t * k + j) : Acc(1);
          load(element_ptr(out, row, 0), out.dtype(), H, 1, term.data());
          for (int64_t h = 0; h < H; ++h) {
            const Acc weighted = p * term[size_t(h)];  // rounded before the addition, as on the GPU
            sum[size_t(h)] += weighted;
          }
        }
        store(sum.data(), H, element_ptr(y, t, 0), y.dtype());
        if (gathered.defined())
          for (int64_t j = 0; j < k; ++j) {
            const int64_t row = rows[t * k + j];
            char* dst = static_cast<char*>(gathered.data()) + size_t(t * k + j) * prob_bytes;
            if (row < 0)
              std::memset(dst, 0, prob_bytes);  // +0 in float32 and float64
            else
              std::memcpy(dst,
                          static_cast<const char*>(sorted_probs.data()) + size_t(row) * prob_bytes,
                          prob_bytes);
          }
      }
    }
  });
}

void unpermute_backward(const TensorView& dy, const TensorView& out, const TensorView& probs,
                        const TensorView& row_of, const GroupLayout& /*groups*/,
                        const TensorView& d_out, const TensorView& d_probs) {
  const int64_t T = dy.size(0), H = dy.size(1), k = row_of.size(1);
  const int64_t vector = 16 / int64_t(dy.element_size());
  const auto* rows = row_of.data_as<const int32_t>();
  with_accumulator(dy.dtype(), [&](auto acc) {
    using Acc = decltype(acc);
#pragma omp parallel
    {
      std::vector<Acc> g(static_cast<size_t>(H)), scaled(static_cast<size_t>(H)),
          o(static_cast<size_t>(H));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        load(element_ptr(dy, t, 0), dy.dtype(), H, 1, g.data());
        for (int64_t j = 0; j < k; ++j) {
          const int64_t row = rows[t * k + j];
          if (row < 0) {
            if (d_probs.defined()) store_at(d_probs, t * k + j, Acc(0));
            continue;
          }
          if (probs.defined()) {
            const Acc p = value_at<Acc>(probs, t * k + j);
            for (int64_t h = 0; h < H; ++h) scaled[size_t(h)] = p * g[size_t(h)];
            store(scaled.data(), H, element_ptr(d_out, row, 0), d_out.dtype());
          } else {
            std::memcpy(element_ptr(d_out, row, 0), element_ptr(dy, t, 0),
                        size_t(H) * dy.element_size());
          }
          if (d_probs.defined()) {
            load(element_ptr(out, row, 0), out.dtype(), H, 1, o.data());
            store_at(d_probs, t * k + j, lane_order_dot(g.data(), o.data(), H, vector));
          }
        }
      }
    }
  });
}

}  // namespace moe::cpu
