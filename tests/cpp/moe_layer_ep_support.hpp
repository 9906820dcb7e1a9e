// The expert-parallel MoE layer against the layer without expert parallelism: P ranks (threads of
// this process over ThreadCommunicator), each with its own tokens; rank r's outputs, input
// gradient, loss and router weight gradient must be the full layer's on rank r's tokens alone, and
// its experts' weight gradients the full layer's summed over every rank's tokens.
#pragma once

#include <algorithm>
#include <cmath>
#include <exception>
#include <optional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "moe_layer_support.hpp"
#include "thread_communicator.hpp"

namespace moe::test {

struct EpCase {
  LayerCase layer;
  int ranks;
  std::vector<int64_t> tokens;  // per rank, summing to layer.T (uneven, some 0; equal with a capacity)
  // The fixed-capacity exchange's factor (none: dropless). At >= ranks nothing is dropped and the
  // results are the reference's; below, only the accounting is checked (drops_expected).
  std::optional<double> exchange_capacity;
  bool drops_expected = false;
  // FP8 experts (options.experts.fp8): outputs, dx and the router's gradient as in 16 bits (rows are
  // quantized one by one); the experts' weight gradients within FP8's error, since their 128-token
  // column blocks hold every rank's rows of an expert together here and each rank's apart in the
  // reference.
  bool fp8 = false;
};

inline LayerCase with_tokens(LayerCase c, int64_t T, const std::string& suffix) {
  c.T = T;
  c.name += suffix;
  return c;
}

inline std::vector<EpCase> ep_cases() {
  const std::vector<LayerCase> c = layer_cases();
  return {
      {c[0], 2, {30, 7}},         // E 6, top-2, an expert no token picks
      {c[0], 3, {0, 25, 12}},     // a rank without tokens
      {c[3], 4, {20, 0, 16, 5}},  // E 8, sigmoid, groups, expert bias
      {c[4], 2, {16, 17}},        // the layer's capacity drops (per rank, on its own tokens)
      {c[4], 4, {10, 1, 22, 0}},
      {c[1], 1, {29}},            // one rank: the plain layer's results
      // The fixed-capacity exchange (equal T on every rank): a factor of P never drops.
      {with_tokens(c[0], 36, "_fixed"), 2, {18, 18}, 2.0},
      {with_tokens(c[3], 40, "_fixed"), 4, {10, 10, 10, 10}, 4.0},
      {with_tokens(c[4], 32, "_fixed"), 2, {16, 16}, 2.0},  // the layer's capacity drops are not sent
      {with_tokens(c[1], 29, "_fixed"), 1, {29}, 1.0},
      {with_tokens(c[3], 40, "_fixed_drops"), 4, {10, 10, 10, 10}, 0.5, true},
      {with_tokens(c[0], 36, "_fixed_drops"), 2, {18, 18}, 0.3, true},
  };
}

// FP8 experts under expert parallelism (the layer cases with H and F multiples of 16).
inline std::vector<EpCase> ep_fp8_cases() {
  const std::vector<LayerCase> c = layer_cases();
  auto fp8_shape = [](const LayerCase& l) {
    LayerCase f = fp8_shapes(l);
    f.name += "_fp8";
    return f;
  };
  return {
      {fp8_shape(c[0]), 2, {30, 7}, std::nullopt, false, true},
      {fp8_shape(c[3]), 4, {20, 0, 16, 5}, std::nullopt, false, true},
      {fp8_shape(with_tokens(c[4], 32, "_fixed")), 2, {16, 16}, 2.0, false, true},
  };
}

// The parameterized suites' test names: "<case>_<P>ranks_<dtype>".
inline std::string ep_param_name(const ::testing::TestParamInfo<std::tuple<EpCase, DType>>& info) {
  const EpCase& e = std::get<0>(info.param);
  return e.layer.name + "_" + std::to_string(e.ranks) + "ranks_" + dtype_name(std::get<1>(info.param));
}

// Rows [lo, lo + n) of t, copied onto `device`.
inline Tensor rows_of(const TensorView& t, int64_t lo, int64_t n, Device device) {
  Shape shape = t.shape();
  shape[0] = n;
  Tensor out = Tensor::empty(shape, t.dtype(), device);
  if (n > 0) copy_tensor(out, t.slice(lo, lo + n));
  synchronize(nullptr);
  return out;
}

// The state of rank r's layer: the router whole, experts [lo, lo + L) of the packed expert tensors.
inline std::map<std::string, Tensor> rank_state(const std::map<std::string, Tensor>& full, int64_t lo, int64_t L,
                                                Device device) {
  std::map<std::string, Tensor> out;
  for (const auto& [key, t] : full)
    out[key] = key.starts_with("experts.") ? rows_of(t, lo, L, device) : rows_of(t, 0, t.size(0), device);
  return out;
}

inline void add_into(std::vector<oracle::Matrix>& sum, const std::vector<oracle::Matrix>& m) {
  if (sum.empty()) {
    sum = m;
    return;
  }
  for (size_t g = 0; g < m.size(); ++g)
    for (size_t i = 0; i < m[g].data.size(); ++i) sum[g].data[i] += m[g].data[i];
}

struct EpRankResult {
  oracle::Matrix y, dx, d_router;
  double loss = 0;
  std::vector<oracle::Matrix> dw1, dw2, db1, db2;  // the rank's experts (biases: one row each)
  std::vector<int64_t> local_splits;
  std::vector<int64_t> dropped;  // fixed capacity: per destination
  bool finite = true;
};

// streams: one per rank (nullptr on the CPU).
inline void check_expert_parallel(const EpCase& e, DType dtype, Device device, const std::vector<Stream>& streams,
                                  double tol) {
  const LayerCase& c = e.layer;
  const int P = e.ranks;
  const int64_t L = c.E / P;
  const auto options = [&](Device d) { return e.fp8 ? fp8_layer_options(c, dtype, d) : layer_options(c, dtype, d); };
  // FP8: measured up to 3.6% apart in norm (the column blocks differ, few tokens an expert); a
  // wrong expert, block or scale is O(1).
  const double weight_tol = e.fp8 ? std::max(tol, 1e-1) : tol;
  Rng rng;
  MoELayer cpu(c.E, c.H, c.F, options(Device::cpu()));
  const LayerInputs in = layer_inputs(c, cpu, dtype, rng);
  std::map<std::string, Tensor> state;
  for (const auto& [key, t] : cpu.state_dict()) state[key] = host_copy(t);
  MoELayer full(c.E, c.H, c.F, options(device));
  full.load_state_dict(rank_state(state, 0, c.E, device));

  std::vector<int64_t> first(size_t(P) + 1, 0);
  for (int r = 0; r < P; ++r) first[size_t(r) + 1] = first[size_t(r)] + e.tokens[size_t(r)];
  ASSERT_EQ(first[size_t(P)], c.T);
  // The reference: the full layer on each rank's tokens alone.
  std::vector<EpRankResult> ref(static_cast<size_t>(P));
  std::vector<oracle::Matrix> dw1, dw2, db1, db2;
  std::vector<int64_t> splits_sum(size_t(c.E), 0);
  for (int r = 0; r < P; ++r) {
    const int64_t lo = first[size_t(r)], n = e.tokens[size_t(r)];
    MoELayerForwardResult f = full.forward(rows_of(in.x, lo, n, device));
    const MoELayerBackwardResult b = full.backward(f.ctx, rows_of(in.dy, lo, n, device), in.d_loss);
    EpRankResult& out = ref[size_t(r)];
    out.y = oracle::to_matrix(host_copy(f.y));
    out.dx = oracle::to_matrix(host_copy(b.dx));
    out.loss = scalar_value(host_copy(f.loss));
    out.d_router = grad_matrices(b.router_weight)[0];
    add_into(dw1, grad_matrices(b.fc1_weight));
    add_into(dw2, grad_matrices(b.fc2_weight));
    if (c.mlp_bias) {
      add_into(db1, grad_matrices(b.fc1_bias));
      add_into(db2, grad_matrices(b.fc2_bias));
    }
    const Tensor s = host_copy(f.splits);
    for (int64_t x = 0; x < c.E; ++x) splits_sum[size_t(x)] += s.data_as<int64_t>()[x];
  }

  // The expert-parallel layers, one thread per rank.
  auto group = std::make_shared<ThreadGroup>(P);
  std::vector<EpRankResult> got(static_cast<size_t>(P));
  std::vector<std::string> failures(static_cast<size_t>(P));
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      try {
        MoELayerOptions o = options(device);
        o.expert_parallel = std::make_shared<ThreadCommunicator>(group, r);
        o.expert_parallel_capacity_factor = e.exchange_capacity;
        MoELayer ep(c.E, c.H, c.F, o);
        ep.load_state_dict(rank_state(state, r * L, L, device));
        const ExecContext exec{streams[size_t(r)], {}};
        const int64_t lo = first[size_t(r)], n = e.tokens[size_t(r)];
        MoELayerForwardResult f = ep.forward(rows_of(in.x, lo, n, device), true, exec);
        const MoELayerBackwardResult b = ep.backward(f.ctx, rows_of(in.dy, lo, n, device), in.d_loss, exec);
        synchronize(exec.stream);
        ep.check_errors(exec.stream);
        EpRankResult& out = got[size_t(r)];
        out.y = oracle::to_matrix(host_copy(f.y));
        out.dx = oracle::to_matrix(host_copy(b.dx));
        out.loss = scalar_value(host_copy(f.loss));
        out.d_router = grad_matrices(b.router_weight)[0];
        out.dw1 = grad_matrices(b.fc1_weight);
        out.dw2 = grad_matrices(b.fc2_weight);
        if (c.mlp_bias) {
          out.db1 = grad_matrices(b.fc1_bias);
          out.db2 = grad_matrices(b.fc2_bias);
        }
        const Tensor s = host_copy(f.local_splits);
        out.local_splits.assign(s.data_as<int64_t>(), s.data_as<int64_t>() + s.numel());
        if (e.exchange_capacity) {
          const Tensor d = host_copy(f.dropped);
          out.dropped.assign(d.data_as<int64_t>(), d.data_as<int64_t>() + d.numel());
          out.finite = std::isfinite(out.loss);
          for (const oracle::Matrix* m : {&out.y, &out.dx})
            for (double v : m->data) out.finite = out.finite && std::isfinite(v);
        }
        if (ep.local_experts() != L || ep.first_local_expert() != r * L) failures[size_t(r)] = "local experts";
      } catch (const std::exception& ex) {
        failures[size_t(r)] = ex.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();

  if (e.drops_expected) {
    // Every kept assignment is computed where it went or counted as dropped by its source; y, dx and
    // the loss stay finite (dropped rows add nothing).
    int64_t computed = 0, dropped = 0, kept = 0;
    for (int r = 0; r < P; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(P));
      ASSERT_EQ(failures[size_t(r)], "");
      for (int64_t n : got[size_t(r)].local_splits) computed += n;
      for (int64_t n : got[size_t(r)].dropped) dropped += n;
      EXPECT_TRUE(got[size_t(r)].finite);
    }
    for (int64_t n : splits_sum) kept += n;
    EXPECT_GT(dropped, 0) << "the case is meant to drop";
    EXPECT_EQ(computed + dropped, kept);
    return;
  }
  for (int r = 0; r < P; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(P));
    ASSERT_EQ(failures[size_t(r)], "");
    if (e.exchange_capacity)
      EXPECT_EQ(got[size_t(r)].dropped, std::vector<int64_t>(size_t(P), 0)) << "a factor of P never drops";
    const EpRankResult& g = got[size_t(r)];
    const EpRankResult& w = ref[size_t(r)];
    if (e.tokens[size_t(r)] > 0) {
      EXPECT_LE(oracle::rel_error(g.y, w.y), tol);
      EXPECT_LE(oracle::rel_error(g.dx, w.dx), tol);
    }
    EXPECT_NEAR(g.loss, w.loss, 1e-5 * std::abs(w.loss) + 1e-12);
    EXPECT_LE(oracle::rel_error(g.d_router, w.d_router), tol);
    const auto slice = [&](const std::vector<oracle::Matrix>& m) {
      return std::vector<oracle::Matrix>(m.begin() + r * L, m.begin() + (r + 1) * L);
    };
    EXPECT_LE(oracle::rel_error(g.dw1, slice(dw1)), weight_tol);
    EXPECT_LE(oracle::rel_error(g.dw2, slice(dw2)), weight_tol);
    if (c.mlp_bias) {
      EXPECT_LE(oracle::rel_error(g.db1, slice(db1)), tol);
      EXPECT_LE(oracle::rel_error(g.db2, slice(db2)), tol);
    }
    EXPECT_EQ(g.local_splits, std::vector<int64_t>(splits_sum.begin() + r * L, splits_sum.begin() + (r + 1) * L));
  }
}

}  // namespace moe::test
