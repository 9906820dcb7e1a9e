// Helpers of the permute suites (CPU and GPU): router-like choices and the CPU plan with the
// oracle's beside it.
#pragma once

#include <algorithm>
#include <optional>
#include <vector>

#include "oracle/permute_oracle.hpp"
#include "test_support.hpp"

namespace moe::test {

// k experts for each of T tokens: distinct per token (a router's top-k), skewed towards the low
// experts so that some are hot and some empty.
inline std::vector<int64_t> random_choices(Rng& rng, int64_t T, int64_t k, int64_t E) {
  std::vector<int64_t> indices;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> chosen;
    while (int64_t(chosen.size()) < k) {
      const double u = rng.uniform(0, 1);
      const int64_t e = std::min(E - 1, int64_t(double(E) * u * u));
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    indices.insert(indices.end(), chosen.begin(), chosen.end());
  }
  return indices;
}

inline Tensor index_tensor(const std::vector<int64_t>& values, int64_t T, int64_t k,
                           DType dtype = DType::kInt64) {
  Tensor t = Tensor::empty({T, k}, dtype);
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kInt32)
      t.data_as<int32_t>()[i] = int32_t(values[i]);
    else
      t.data_as<int64_t>()[i] = values[i];
  }
  return t;
}

// The plan of `indices` [T, k] over E experts on the CPU, and the oracle's.
struct Plan {
  int64_t T, k, E;
  Tensor indices, row_of, splits, offsets, dropped;
  GroupLayout layout;
  oracle::PermutePlan expected;

  Plan(const std::vector<int64_t>& idx, int64_t tokens, int64_t topk, int64_t experts,
       std::optional<double> capacity_factor = std::nullopt, DType index_dtype = DType::kInt64)
      : T(tokens), k(topk), E(experts) {
    indices = index_tensor(idx, T, k, index_dtype);
    row_of = Tensor::empty({T, k}, DType::kInt32);
    splits = Tensor::empty({E}, DType::kInt64);
    offsets = Tensor::empty({E + 1}, DType::kInt64);
    dropped = Tensor::empty({E}, DType::kInt64);
    layout = permute_plan(indices, {row_of, splits, offsets, dropped}, capacity_factor, nullptr);
    const int64_t capacity = capacity_factor ? expert_capacity(T, k, E, *capacity_factor) : -1;
    expected = oracle::permute_plan(idx, T, k, E, capacity);
  }
  int64_t R() const { return layout.capacity(); }
  int64_t routed() const { return offsets.data_as<int64_t>()[E]; }
  int64_t row(int64_t t, int64_t j) const { return row_of.data_as<int32_t>()[t * k + j]; }
};

// The expert-parallel send plan of indices [T, k] (experts [0, P L)) on `device`, into poisoned
// outputs; `kept` ([T, k], -1 = the layer dropped it) optional. And what it must be: destination d
// = e / L takes its first C assignments in token order, then j order, at rows d C + 0, 1, ...
struct SendPlanRun {
  Tensor row_send, ids, splits, offsets, dropped;
  GroupLayout groups;
  SendPlanRun(const Tensor& indices, const Tensor& kept, int64_t P, int64_t L, int64_t C, Device device,
              DeviceErrorFlag* flag) {
    const int64_t T = indices.size(0), k = indices.size(1);
    auto on = [&](Shape shape, DType dtype) {
      Tensor t = poisoned(shape, dtype);
      if (device.is_cpu()) return t;
      Tensor d = Tensor::empty(shape, dtype, device);
      copy_tensor(d, t);
      synchronize(nullptr);
      return d;
    };
    row_send = on({T, k}, DType::kInt32);
    ids = on({P * C, 1}, DType::kInt32);
    splits = on({P}, DType::kInt64);
    offsets = on({P + 1}, DType::kInt64);
    dropped = on({P}, DType::kInt64);
    groups = send_plan(indices, kept, L, C, {row_send, ids, splits, offsets, dropped}, flag);
    synchronize(nullptr);
  }
};

struct ExpectedSendPlan {
  std::vector<int32_t> row_send, ids;
  std::vector<int64_t> dropped;
};

inline ExpectedSendPlan expected_send_plan(const std::vector<int64_t>& indices, const std::vector<int32_t>& kept,
                                           int64_t P, int64_t L, int64_t C) {
  ExpectedSendPlan want{std::vector<int32_t>(indices.size(), -1), std::vector<int32_t>(size_t(P * C), int32_t(L)),
                        std::vector<int64_t>(size_t(P), 0)};
  for (int64_t d = 0; d < P; ++d) {
    int64_t n = 0;  // d's assignments so far, in (t, j) order
    for (size_t i = 0; i < indices.size(); ++i) {
      if (indices[i] / L != d || (!kept.empty() && kept[i] < 0)) continue;
      if (n < C) {
        want.row_send[i] = int32_t(d * C + n);
        want.ids[size_t(d * C + n)] = int32_t(indices[i] % L);
      } else {
        ++want.dropped[size_t(d)];
      }
      ++n;
    }
  }
  return want;
}

}  // namespace moe::test
