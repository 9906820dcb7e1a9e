// Helpers of the MoE layer suites (CPU and GPU): layer cases, inputs whose routing every backend
// decides alike, and the layer's float64 reference built from the oracle's router, permute and MLP.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "moe_engine/moe_layer.hpp"
#include "oracle/permute_oracle.hpp"
#include "oracle/router_oracle.hpp"
#include "router_support.hpp"

namespace moe::test {

struct LayerCase {
  std::string name;
  int64_t T, H, F, E;
  RouterSpec spec;
  std::optional<double> capacity_factor;
  bool expert_bias = false;
  int64_t empty_expert = -1;  // an expert no token can choose (x >= 0, its weight row the minimum)
  Activation activation = Activation::kSwiGLU;
  bool mlp_bias = true;
};

inline RouterSpec layer_spec(RouterScore score, int64_t k, int64_t groups, int64_t topk_groups, bool norm,
                             float scaling, float aux, float z) {
  RouterSpec s;
  s.score = score;
  s.topk = k;
  s.num_groups = groups;
  s.topk_groups = topk_groups;
  s.norm_topk_prob = norm;
  s.scaling_factor = scaling;
  s.aux_loss_coeff = aux;
  s.z_loss_coeff = z;
  return s;
}

// Odd shapes: T off every tile; k = 1 and k > 1; E = 1; sigmoid with an expert bias and groups;
// a capacity factor that drops, with an expert no token chooses.
inline std::vector<LayerCase> layer_cases() {
  return {
      {"softmax_top2_empty_expert", 37, 24, 16, 6, layer_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f, 0.01f, 0.001f),
       std::nullopt, false, 5},
      {"top1_srelu", 29, 16, 12, 5, layer_spec(RouterScore::kSoftmax, 1, 1, 1, false, 1.f, 0.02f, 0.f), std::nullopt,
       false, -1, Activation::kSReLU, false},
      {"one_expert", 11, 8, 8, 1, layer_spec(RouterScore::kSoftmax, 1, 1, 1, true, 1.f, 0.01f, 0.01f), std::nullopt},
      {"sigmoid_bias_groups", 41, 24, 16, 8, layer_spec(RouterScore::kSigmoid, 3, 4, 2, true, 2.5f, 0.001f, 0.001f),
       std::nullopt, true},
      {"capacity_drops", 33, 16, 8, 4, layer_spec(RouterScore::kSoftmax, 2, 1, 1, true, 1.f, 0.01f, 0.001f), 0.6,
       false, 3, Activation::kGeluTanh},
  };
}

inline MoELayerOptions layer_options(const LayerCase& c, DType dtype, Device device = Device::cpu()) {
  MoELayerOptions o;
  o.router = c.spec;
  o.capacity_factor = c.capacity_factor;
  o.expert_bias = c.expert_bias;
  o.experts.dtype = dtype;
  o.experts.device = device;
  o.experts.glu = spec_of(c.activation);
  o.experts.bias = c.mlp_bias;
  o.experts.seed = 11;
  return o;
}

// FP8 experts (options.experts.fp8, all six GEMMs in FP8) need H and F multiples of 16: the case's
// shapes rounded up to them, and its options with the recipe.
inline LayerCase fp8_shapes(LayerCase c) {
  c.H = (c.H + 15) / 16 * 16;
  c.F = (c.F + 15) / 16 * 16;
  return c;
}
inline MoELayerOptions fp8_layer_options(const LayerCase& c, DType dtype, Device device = Device::cpu()) {
  MoELayerOptions o = layer_options(c, dtype, device);
  o.experts.fp8 = Fp8ModuleRecipe{};
  return o;
}

// The layer's parameters, read back on the host for the oracle.
struct LayerParams {
  oracle::Matrix router_weight;
  oracle::Vector expert_bias;  // empty without
  oracle::MlpParams mlp;
};

inline oracle::Matrix bias_rows(const GroupedParam& b) {  // G x [N] -> [G, N]
  const std::vector<oracle::Matrix> cols = oracle::to_matrices(b);
  oracle::Matrix m(int64_t(cols.size()), cols[0].rows);
  for (size_t g = 0; g < cols.size(); ++g)
    for (int64_t i = 0; i < cols[g].rows; ++i) m(int64_t(g), i) = cols[g].data[size_t(i)];
  return m;
}

inline Tensor host_copy(const TensorView& t) {
  Tensor h = Tensor::empty(t.shape(), t.dtype());
  copy_tensor(h, t);
  synchronize(nullptr);
  return h;
}

inline GroupedTensor host_copy(const GroupedTensor& g) {
  const GroupedParam& v = g.view();
  GroupedTensor h = GroupedTensor::zeros(v.num_groups(), v.expert_shape(), v.dtype(), Device::cpu(), g.layout());
  for (int64_t e = 0; e < v.num_groups(); ++e) copy_tensor(h.view().expert(e), v.expert(e));
  synchronize(nullptr);
  return h;
}

// A parameter gradient's experts (or the router's one matrix) on the host, for the oracle.
inline std::vector<oracle::Matrix> grad_matrices(const ParamGradResult& r) {
  return oracle::to_matrices(host_copy(r.grad).view());
}

inline LayerParams layer_params(MoELayer& layer) {
  LayerParams p;
  std::map<std::string, Tensor> sd = layer.state_dict();
  p.router_weight = oracle::to_matrix(host_copy(sd.at("router.weight")));
  if (layer.options().expert_bias) p.expert_bias = oracle::to_vector(host_copy(layer.expert_bias()));
  GroupedMLP& m = layer.experts();
  p.mlp.w1 = oracle::to_matrices(host_copy(m.fc1_weight().storage()).view());
  p.mlp.w2 = oracle::to_matrices(host_copy(m.fc2_weight().storage()).view());
  if (m.has_bias()) {
    p.mlp.b1 = bias_rows(host_copy(m.fc1_bias().storage()).view());
    p.mlp.b2 = bias_rows(host_copy(m.fc2_bias().storage()).view());
  }
  return p;
}

// The layer in float64 from the oracle's pieces.
struct LayerReference {
  oracle::Matrix y, dx, d_router_weight;
  double loss = 0;
  std::vector<oracle::Matrix> dw1, dw2;
  oracle::Matrix db1, db2;
  oracle::Choices indices;
  std::vector<int64_t> counts, splits, dropped;
  double min_margin = std::numeric_limits<double>::infinity();
};

inline LayerReference layer_reference(const LayerCase& c, const LayerParams& p, const oracle::Matrix& x,
                                      const oracle::Matrix& dy, double d_loss) {
  const int64_t T = x.rows, k = c.spec.topk, E = c.E;
  const GluSpec glu = spec_of(c.activation);
  LayerReference r;
  const oracle::RouterForward rf = oracle::router_forward(x, p.router_weight, p.expert_bias, c.spec);
  for (double m : rf.margin) r.min_margin = std::min(r.min_margin, m);
  r.indices = rf.indices;
  r.counts = rf.counts;
  r.loss = rf.aux_loss + rf.z_loss;
  std::vector<int64_t> flat;
  for (const auto& row : rf.indices) flat.insert(flat.end(), row.begin(), row.end());
  int64_t capacity = -1;
  if (c.capacity_factor)
    capacity = int64_t(std::min(std::ceil(double(T * k) / double(E) * *c.capacity_factor), double(T * k)));
  const oracle::PermutePlan plan = oracle::permute_plan(flat, T, k, E, capacity);
  r.splits = plan.splits;
  r.dropped = plan.dropped;
  const int64_t rows = plan.rows();
  const oracle::Matrix xs = oracle::permute(x, plan, rows);
  const oracle::Vector ps = oracle::permute_probs(rf.probs, plan, rows);
  const oracle::MlpForward mf = oracle::mlp_forward(xs, ps, p.mlp, plan.splits, glu);
  r.y = oracle::unpermute(mf.y, {}, plan);

  const oracle::Matrix dys = oracle::unpermute_backward(dy, mf.y, {}, plan, rows).d_out;
  const oracle::MlpGrads mg = oracle::mlp_backward(dys, xs, ps, p.mlp, plan.splits, glu);
  r.dw1 = mg.dw1;
  r.dw2 = mg.dw2;
  r.db1 = mg.db1;
  r.db2 = mg.db2;
  r.dx = oracle::unpermute(mg.dx, {}, plan);
  oracle::Matrix d_probs(T, k);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = plan.row_of[size_t(t * k + j)];
      d_probs(t, j) = row < 0 ? 0.0 : mg.dprobs[size_t(row)];
    }
  const oracle::RouterGrads rg = oracle::router_backward(x, p.router_weight, rf.indices, rf.aux_counts, d_probs,
                                                         d_loss, d_loss, c.spec);
  for (size_t i = 0; i < r.dx.data.size(); ++i) r.dx.data[i] += rg.dx.data[i];
  r.d_router_weight = rg.dweight;
  return r;
}

// Inputs in exact float32 arithmetic for the router (dyadic x and router weight: the logits are
// exact on every backend) with no token near a tie that rounding could decide otherwise: tokens
// the oracle finds close are drawn again.
struct LayerInputs {
  Tensor x, dy;  // host, the layer's dtype
  double d_loss = 0;
};

// FP8 experts (options.experts.fp8): y and every gradient against the float64 layer within FP8's
// error, by DeepGEMM's similarity difference: the FP8 MLP tests' bound, 5e-3 (a wrong scale, block or
// expert gives 1e-1 and more); the router weight's gradient, which carries dprobs through the scores'
// backward, 3e-2. Measured on the layer cases: y at most 9e-4, dx 2.4e-3, the weights 2e-3, the
// router 4.1e-3. Results on any device.
inline void expect_fp8_layer_close(const MoELayerForwardResult& f, const MoELayerBackwardResult& b,
                                   const LayerReference& ref, bool mlp_bias) {
  constexpr double kBound = 5e-3, kRouterBound = 3e-2;
  EXPECT_LE(oracle::similarity_diff(oracle::to_matrix(host_copy(f.y)), ref.y), kBound) << "y";
  EXPECT_LE(oracle::similarity_diff(oracle::to_matrix(host_copy(b.dx)), ref.dx), kBound) << "dx";
  EXPECT_LE(oracle::similarity_diff(grad_matrices(b.router_weight)[0], ref.d_router_weight), kRouterBound)
      << "router weight";
  EXPECT_LE(oracle::similarity_diff(grad_matrices(b.fc1_weight), ref.dw1), kBound) << "fc1 weight";
  EXPECT_LE(oracle::similarity_diff(grad_matrices(b.fc2_weight), ref.dw2), kBound) << "fc2 weight";
  if (mlp_bias) {
    EXPECT_LE(oracle::similarity_diff(bias_rows(host_copy(b.fc1_bias.grad).view()), ref.db1), kBound) << "fc1 bias";
    EXPECT_LE(oracle::similarity_diff(bias_rows(host_copy(b.fc2_bias.grad).view()), ref.db2), kBound) << "fc2 bias";
  }
}

inline LayerInputs layer_inputs(const LayerCase& c, MoELayer& layer, DType dtype, Rng& rng, double margin = 1e-4) {
  // The router weight and the expert bias, written through the state dict (it shares the storage).
  std::map<std::string, Tensor> sd = layer.state_dict();
  Tensor w = dyadic_tensor({c.E, c.H}, dtype, rng, 0.125);
  if (c.empty_expert >= 0)
    for (int64_t h = 0; h < c.H; ++h) {
      Tensor one = Tensor::empty({1}, dtype);
      oracle::assign(one, {-0.25});
      std::memcpy(static_cast<char*>(w.data()) + (c.empty_expert * c.H + h) * int64_t(w.view().element_size()),
                  one.data(), w.view().element_size());
    }
  copy_tensor(sd.at("router.weight"), w);
  if (c.expert_bias) copy_tensor(layer.expert_bias(), tier_bias(c.E, layer.expert_bias().dtype(), rng));
  synchronize(nullptr);
  const LayerParams p = layer_params(layer);
  LayerInputs in;
  oracle::Matrix x(c.T, c.H);
  auto draw_row = [&](int64_t t) {
    for (int64_t h = 0; h < c.H; ++h)
      x(t, h) = double(c.empty_expert >= 0 ? rng.integer(0, 2) : rng.integer(-2, 2)) * 0.25;
  };
  for (int64_t t = 0; t < c.T; ++t) draw_row(t);
  for (int attempt = 0; attempt < 50; ++attempt) {
    const oracle::RouterForward rf = oracle::router_forward(x, p.router_weight, p.expert_bias, c.spec);
    bool redrawn = false;
    for (int64_t t = 0; t < c.T; ++t)
      if (rf.margin[size_t(t)] < margin) {
        draw_row(t);
        redrawn = true;
      }
    if (!redrawn) break;
  }
  in.x = Tensor::empty({c.T, c.H}, dtype);
  oracle::assign(in.x, x.data);
  in.dy = random_tensor({c.T, c.H}, dtype, rng);
  in.d_loss = 0.75;
  return in;
}

}  // namespace moe::test
