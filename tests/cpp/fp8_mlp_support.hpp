// The FP8 expert MLP suites' common parts (CPU and GPU): a problem, one forward + backward on any
// device into poisoned outputs, and the comparison against the float64 oracle of the unquantized MLP.
#pragma once

#include <cmath>
#include <string>

#include "fp8_support.hpp"

namespace moe::test {

// Inputs on the CPU; weights and activations in `dt`.
struct Fp8MlpCase {
  int64_t T, G, H, F;  // FC1 has W() rows: 2F for a GLU, F for a non-gated activation
  DType dt;
  GluSpec glu;
  Tensor x, w1, b1, w2, b2, p, dy;  // b1/b2/p undefined when absent

  Fp8MlpCase(Rng& rng, int64_t T, int64_t G, int64_t H, int64_t F, DType dt, GluSpec glu, bool bias, bool probs)
      : T(T), G(G), H(H), F(F), dt(dt), glu(glu) {
    x = random_tensor({T, H}, dt, rng);
    w1 = random_tensor({G, W(), H}, dt, rng, 1.0 / std::sqrt(double(H)));
    w2 = random_tensor({G, H, F}, dt, rng, 1.0 / std::sqrt(double(F)));
    if (bias) {
      b1 = random_tensor({G, W()}, dt, rng, 0.5);
      b2 = random_tensor({G, H}, dt, rng, 0.5);
    }
    if (probs) p = uniform_tensor({T}, DType::kFloat32, rng, 0.05, 1.0);
    dy = random_tensor({T, H}, dt, rng);
  }
  int64_t W() const { return fc1_width(glu, F); }
};

// One forward + backward's results, on the device they were computed on.
struct Fp8MlpRun {
  Tensor y, dx, dprobs, dw1, dw2, db1, db2;
  OwnedRows saved_h;
  OwnedColumns saved_x;  // x's columns, or (x_rows) undefined
  OwnedRows saved_x_rows;  // x's rows when the buffers keep them instead
};

inline Tensor on(const Tensor& t, Device device) { return t.defined() ? t.to(device) : Tensor(); }

// The weights quantized on `device` (both copies), as a module does once per optimizer step.
struct Fp8MlpWeights {
  OwnedWeight fc1, fc2;
  Tensor b1, b2;
  Fp8MlpWeights(const Fp8MlpCase& c, Device device, Stream stream = nullptr)
      : fc1(c.G, c.W(), c.H, device), fc2(c.G, c.H, c.F, device), b1(on(c.b1, device)), b2(on(c.b2, device)) {
    const ExecContext ctx{stream, {}};
    quantize_fp8_weight(GroupedParam::packed(on(c.w1, device)), fc1.view(), {}, ctx);
    quantize_fp8_weight(GroupedParam::packed(on(c.w2, device)), fc2.view(), {}, ctx);
  }
  ExpertMlpFp8Weights view() const {
    ExpertMlpFp8Weights w{fc1.view(), fc2.view(), {}, {}};
    if (b1.defined()) w.fc1_bias = GroupedParam::packed(b1);
    if (b2.defined()) w.fc2_bias = GroupedParam::packed(b2);
    return w;
  }
};

// Buffers of one forward + backward on a device: outputs poisoned, gradients float32. x_rows:
// forward keeps x's rows (backward makes the columns) instead of its columns.
struct Fp8MlpBuffers {
  Fp8MlpRun out;
  Tensor x, p, dy, fws, bws;
  Fp8MlpBuffers(const Fp8MlpCase& c, Device device, bool x_rows = false)
      : x(on(c.x, device)), p(on(c.p, device)), dy(on(c.dy, device)) {
    out.y = poisoned_on({c.T, c.H}, c.dt, device);
    out.dx = poisoned_on({c.T, c.H}, c.dt, device);
    if (c.p.defined()) out.dprobs = poisoned_on({c.T}, DType::kFloat32, device);
    out.dw1 = poisoned_on({c.G, c.W(), c.H}, DType::kFloat32, device);
    out.dw2 = poisoned_on({c.G, c.H, c.F}, DType::kFloat32, device);
    if (c.b1.defined()) out.db1 = poisoned_on({c.G, c.W()}, DType::kFloat32, device);
    if (c.b2.defined()) out.db2 = poisoned_on({c.G, c.H}, DType::kFloat32, device);
    out.saved_h = OwnedRows(c.T, c.W(), device);
    if (x_rows) out.saved_x_rows = OwnedRows(c.T, c.H, device);
    else out.saved_x = OwnedColumns(c.T, c.G, c.H, device);
    fws = Tensor::empty({int64_t(expert_mlp_fp8_forward_workspace_size(c.T, c.H, c.F, c.dt, {c.glu}))}, DType::kUInt8,
                        device);
    // Sized for every fusion `step` may run (the fused backward pass needs the most).
    bws = Tensor::empty({int64_t(expert_mlp_fp8_backward_workspace_size(
                            c.T, c.G, c.H, c.F, c.dt, {c.glu, MlpFusion::kForwardBackward}, x_rows))},
                        DType::kUInt8, device);
  }
  ExpertMlpFp8Saved saved() const {
    ExpertMlpFp8Saved s{{}, out.saved_h.view(), {}};
    if (out.saved_x_rows.data.defined()) s.x_rows = out.saved_x_rows.view();
    else s.x = out.saved_x.view();
    return s;
  }
  // `mode` for the weight gradients; the bias gradients are written.
  ExpertMlpGrads grads(GradMode mode = GradMode::kWrite) const {
    ExpertMlpGrads g;
    g.dx = out.dx;
    g.dprobs = out.dprobs;
    g.fc1_weight = {GroupedParam::packed(out.dw1), mode};
    g.fc2_weight = {GroupedParam::packed(out.dw2), mode};
    if (out.db1.defined()) g.fc1_bias = {GroupedParam::packed(out.db1), GradMode::kWrite};
    if (out.db2.defined()) g.fc2_bias = {GroupedParam::packed(out.db2), GradMode::kWrite};
    return g;
  }
  // Forward then backward on `stream`.
  void step(const Fp8MlpCase& c, const Fp8MlpWeights& w, const GroupLayout& groups, Stream stream = nullptr,
            GradMode mode = GradMode::kWrite, MlpFusion fusion = MlpFusion::kForward,
            const Fp8Recipe& recipe = {}, bool* forward_fused = nullptr,
            Fp8GluBackwardPath* backward_path = nullptr) const {
    const Device device = fws.device();
    const ExpertMlpFp8Saved saved = this->saved();
    const ExpertMlpSpec spec{c.glu, fusion};
    expert_mlp_forward(x, p, w.view(), groups, out.y, saved, spec, recipe,
                       {stream, {fws.data(), fws.nbytes(), device}}, forward_fused);
    expert_mlp_backward(dy, saved, p, w.view(), groups, grads(mode), spec, recipe,
                        {stream, {bws.data(), bws.nbytes(), device}}, backward_path);
  }
};

// The float64 MLP of the unquantized inputs over the routing's rows.
inline oracle::MlpGrads fp8_mlp_oracle(const Fp8MlpCase& c, const Routing& r, oracle::Matrix& y) {
  oracle::MlpParams m;
  m.w1 = oracle::to_matrices(GroupedParam::packed(c.w1));
  m.w2 = oracle::to_matrices(GroupedParam::packed(c.w2));
  if (c.b1.defined()) m.b1 = oracle::to_matrix(c.b1);
  if (c.b2.defined()) m.b2 = oracle::to_matrix(c.b2);
  const int64_t rows = r.rows();
  const oracle::Vector probs = c.p.defined() ? oracle::head(oracle::to_vector(c.p), rows) : oracle::Vector{};
  const oracle::Matrix x = oracle::head(oracle::to_matrix(c.x), rows), dy = oracle::head(oracle::to_matrix(c.dy), rows);
  y = oracle::mlp_forward(x, probs, m, r.splits, c.glu).y;
  return oracle::mlp_backward(dy, x, probs, m, r.splits, c.glu);
}

// FP8's error on the MLP, measured as DeepGEMM's similarity difference against the float64 MLP of
// the unquantized inputs. E4M3 keeps 3 mantissa bits (a few % RMS per value), so one GEMM of two
// quantized operands shows about 6e-4, and the MLP's outputs, each the end of a chain of two to
// four quantized GEMMs and the GLU between, 1.5e-3 to 3e-3 (measured on the CPU backend over the
// suites' cases). A wrong scale, block, expert or operand gives 1e-1 and more.
inline constexpr double kFp8MlpSimilarityBound = 5e-3;

inline oracle::Matrix rows_of(const Tensor& t, int64_t rows) { return oracle::head(oracle::to_matrix(t), rows); }
inline oracle::Vector head_of(const Tensor& t, int64_t n) { return oracle::head(oracle::to_vector(t), n); }
inline std::vector<oracle::Matrix> experts_of(const Tensor& t) { return oracle::to_matrices(GroupedParam::packed(t)); }

// Host results vs the oracle: every output within FP8's error, rows past the routing untouched.
inline void expect_fp8_mlp_matches_oracle(const Fp8MlpCase& c, const Routing& r, const Fp8MlpRun& host,
                                          double bound = kFp8MlpSimilarityBound) {
  oracle::Matrix y;
  const oracle::MlpGrads g = fp8_mlp_oracle(c, r, y);
  const int64_t rows = r.rows();
  EXPECT_LE(oracle::similarity_diff(rows_of(host.y, rows), y), bound) << "y";
  EXPECT_LE(oracle::similarity_diff(rows_of(host.dx, rows), g.dx), bound) << "dx";
  EXPECT_LE(oracle::similarity_diff(experts_of(host.dw1), g.dw1), bound) << "dw1";
  EXPECT_LE(oracle::similarity_diff(experts_of(host.dw2), g.dw2), bound) << "dw2";
  if (c.p.defined()) EXPECT_LE(oracle::similarity_diff(head_of(host.dprobs, rows), g.dprobs), bound) << "dprobs";
  if (c.b1.defined()) EXPECT_LE(oracle::similarity_diff(oracle::to_matrix(host.db1), g.db1), bound) << "db1";
  if (c.b2.defined()) EXPECT_LE(oracle::similarity_diff(oracle::to_matrix(host.db2), g.db2), bound) << "db2";
  EXPECT_TRUE(tail_untouched(host.y, rows)) << "y past the routed rows";
  EXPECT_TRUE(tail_untouched(host.dx, rows)) << "dx past the routed rows";
  if (c.p.defined()) EXPECT_TRUE(tail_untouched(host.dprobs, rows)) << "dprobs past the routed rows";
  EXPECT_TRUE(tail_untouched(host.saved_h.data, rows)) << "saved h past the routed rows";
}

}  // namespace moe::test
