#include "mlp_problem.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "oracle/oracle.hpp"

namespace moe::tools {
namespace {

GroupedParam param(const Tensor& t) {
  return t.defined() ? GroupedParam::packed(t) : GroupedParam();
}

Tensor host_copy(const Tensor& t) { return t.defined() ? t.to(Device::cpu()) : Tensor(); }

}  // namespace

MlpProblem::MlpProblem(const Workload& w, const GluLayout& layout, DType dtype, Device device,
                       uint64_t seed, bool fp8)
    : workload_(w), dtype_(dtype), device_(device), routing_(w.tokens_per_expert, w.capacity, device) {
  spec_.glu.activation = parse_activation(w.activation);
  spec_.glu.layout = layout;
  const int64_t G = w.experts, H = w.hidden, F = w.ffn, T = w.capacity, W = w.fc1_rows();

  // Generated where the tensors live (fill_uniform: the same values on the CPU and on CUDA):
  // the suite's large cases hold billions of weights, minutes of work for a host generator.
  // Uniform in [-a, a) with a = sqrt(3) * std: the standard deviations of the usual inits.
  uint64_t key = seed * 16;
  auto random = [&](Shape shape, double std) {
    Tensor t = Tensor::empty(shape, dtype, device);
    const float a = float(std::sqrt(3.0) * std);
    fill_uniform(t, key++, -a, a);
    return t;
  };
  x_ = random({T, H}, 1.0);
  w1_ = random({G, W, H}, 1.0 / std::sqrt(double(H)));
  w2_ = random({G, H, F}, 1.0 / std::sqrt(double(F)));
  if (w.bias) {
    b1_ = random({G, W}, 0.1);
    b2_ = random({G, H}, 0.1);
  }
  probs_ = Tensor::empty({T}, DType::kFloat32, device);
  fill_uniform(probs_, key++, 0.f, 1.f);
  dy_ = random({T, H}, 1.0);

  y_ = Tensor::empty({T, H}, dtype, device);
  fc1_out_ = Tensor::empty({T, W}, dtype, device);
  dx_ = Tensor::empty({T, H}, dtype, device);
  dprobs_ = Tensor::empty({T}, DType::kFloat32, device);
  dw1_ = Tensor::empty({G, W, H}, dtype, device);
  dw2_ = Tensor::empty({G, H, F}, dtype, device);
  if (w.bias) {
    db1_ = Tensor::empty({G, W}, dtype, device);
    db2_ = Tensor::empty({G, H}, dtype, device);
  }
  // Sized for every mode (recompute and the fused backward need the larger scratch).
  forward_ws_ = Tensor::empty({int64_t(expert_mlp_forward_workspace_size(T, H, F, dtype, false, spec_))},
                              DType::kUInt8, device);
  backward_ws_ = Tensor::empty(
      {int64_t(expert_mlp_backward_workspace_size(T, H, F, dtype, true, {spec_.glu, MlpFusion::kForwardBackward}))},
      DType::kUInt8, device);
  if (!fp8) return;
  const auto empty = [&](Shape shape, DType t) { return Tensor::empty(shape, t, device); };
  const auto blocks = [](int64_t n) { return (n + kFp8Block - 1) / kFp8Block; };
  Fp8State s;
  s.w1 = empty({G, W, H}, DType::kFloat8E4M3);
  s.w1_scales = empty({G, blocks(W), blocks(H)}, DType::kFloat32);
  s.w1_t = empty({G, H, W}, DType::kFloat8E4M3);
  s.w1_scales_t = empty({G, blocks(H), blocks(W)}, DType::kFloat32);
  s.w2 = empty({G, H, F}, DType::kFloat8E4M3);
  s.w2_scales = empty({G, blocks(H), blocks(F)}, DType::kFloat32);
  s.w2_t = empty({G, F, H}, DType::kFloat8E4M3);
  s.w2_scales_t = empty({G, blocks(F), blocks(H)}, DType::kFloat32);
  const ExpertMlpFp8SavedShapes saved = expert_mlp_fp8_saved_shapes(T, G, H, F, spec_);
  const bool x_rows = expert_mlp_fp8_keeps_x_rows(T, G);
  if (x_rows) {
    s.x_rows = empty(saved.x_rows_data, DType::kFloat8E4M3);
    s.x_row_scales = empty(saved.x_rows_scales, DType::kFloat32);
  } else {
    s.x_columns = empty(saved.x_data, DType::kFloat8E4M3);
    s.x_column_scales = empty(saved.x_scales, DType::kFloat32);
    s.x_offsets = empty(saved.x_offsets, DType::kInt64);
  }
  s.h_rows = empty(saved.fc1_out_data, DType::kFloat8E4M3);
  s.h_scales = empty(saved.fc1_out_scales, DType::kFloat32);
  s.forward_ws = empty({int64_t(expert_mlp_fp8_forward_workspace_size(T, H, F, dtype, spec_))}, DType::kUInt8);
  // Sized for the largest fusion (set_fusion may pick any later), as the bf16 workspaces are.
  s.backward_ws = empty({int64_t(expert_mlp_fp8_backward_workspace_size(
                            T, G, H, F, dtype, {spec_.glu, MlpFusion::kForwardBackward}, x_rows))},
                        DType::kUInt8);
  fp8_ = std::move(s);
  quantize_weights();
  fp8_active_ = true;
}

ExpertMlpFp8Weights MlpProblem::fp8_weights() const {
  const Fp8State& s = *fp8_;
  return {{s.w1, s.w1_scales, s.w1_t, s.w1_scales_t}, {s.w2, s.w2_scales, s.w2_t, s.w2_scales_t}, param(b1_),
          param(b2_)};
}

ExpertMlpFp8Saved MlpProblem::fp8_saved() const {
  const Fp8State& s = *fp8_;
  if (s.x_rows.defined()) return {{}, {s.h_rows, s.h_scales}, {s.x_rows, s.x_row_scales}};
  return {{s.x_columns, s.x_column_scales, s.x_offsets}, {s.h_rows, s.h_scales}, {}};
}

void MlpProblem::quantize_weights(Stream stream) {
  MOE_CHECK(fp8_.has_value(), ErrorCode::kInvalidArgument, "bench: quantize_weights: not an FP8 problem");
  const ExpertMlpFp8Weights w = fp8_weights();
  const ExecContext ctx{stream, {}};
  quantize_fp8_weight(param(w1_), w.fc1, {}, ctx);
  quantize_fp8_weight(param(w2_), w.fc2, {}, ctx);
}

void MlpProblem::use_fp8(bool on) {
  MOE_CHECK(!on || fp8_.has_value(), ErrorCode::kInvalidArgument, "bench: use_fp8: not an FP8 problem");
  fp8_active_ = on;
}

int64_t MlpProblem::saved_bytes_per_token() const {
  const int64_t T = std::max<int64_t>(1, workload_.capacity);
  if (fp8_active_) {
    const Fp8State& s = *fp8_;
    int64_t bytes = 4 * T;  // probs
    for (const Tensor* t : {&s.x_columns, &s.x_column_scales, &s.x_offsets, &s.h_rows, &s.h_scales, &s.x_rows,
                            &s.x_row_scales})
      if (t->defined()) bytes += int64_t(t->nbytes());
    return (bytes + T - 1) / T;
  }
  return (workload_.hidden + (recompute_ ? 0 : workload_.fc1_rows())) * int64_t(dtype_size(dtype_)) + 4;
}

int64_t MlpProblem::bytes_needed(const Workload& w, DType dtype, bool fp8) {
  const int64_t G = w.experts, H = w.hidden, F = w.ffn, T = w.capacity, e = int64_t(dtype_size(dtype));
  const int64_t W = w.fc1_rows();
  const ExpertMlpSpec spec{GluSpec{parse_activation(w.activation)}, MlpFusion::kForwardBackward};
  const int64_t activations = 4 * T * H + T * W;          // x, y, dx, dy; the pre-activation
  const int64_t weights = 2 * (G * W * H + G * H * F);     // w1, w2 and their gradients
  const int64_t biases = w.bias ? 2 * (G * W + G * H) : 0;
  return e * (activations + weights + biases) + 2 * 4 * T +
         int64_t(expert_mlp_forward_workspace_size(T, H, F, dtype, false, spec)) +
         int64_t(expert_mlp_backward_workspace_size(T, H, F, dtype, true, spec)) +
         (fp8 ? 2 * (G * W * H + G * H * F) + T * (H + W) + 2 * w.experts * 128 * H +
                    int64_t(expert_mlp_fp8_forward_workspace_size(T, H, F, dtype, spec)) +
                    int64_t(expert_mlp_fp8_backward_workspace_size(T, G, H, F, dtype, spec, true))
              : 0);
}

void MlpProblem::forward(Stream stream) {
  if (fp8_active_) {
    const ExecContext ctx{stream, {fp8_->forward_ws.data(), fp8_->forward_ws.nbytes(), device_}};
    expert_mlp_forward(x_, probs_, fp8_weights(), routing_.layout(), y_, fp8_saved(), spec_, {}, ctx);
    forward_fused_ = false;
    return;
  }
  const ExpertMlpWeights weights{param(w1_), param(b1_), param(w2_), param(b2_)};
  const ExecContext ctx{stream, {forward_ws_.data(), forward_ws_.nbytes(), device_}};
  expert_mlp_forward(x_, probs_, weights, routing_.layout(), y_, recompute_ ? Tensor() : fc1_out_, spec_, ctx,
                     &forward_fused_);
}

void MlpProblem::backward(Stream stream) {
  const ExpertMlpWeights weights{param(w1_), param(b1_), param(w2_), param(b2_)};
  ExpertMlpGrads grads;
  grads.dx = dx_;
  grads.dprobs = dprobs_;
  grads.fc1_weight = {param(dw1_), GradMode::kWrite};
  grads.fc2_weight = {param(dw2_), GradMode::kWrite};
  grads.fc1_bias = {param(db1_), GradMode::kWrite};
  grads.fc2_bias = {param(db2_), GradMode::kWrite};
  if (fp8_active_) {
    const ExecContext ctx{stream, {fp8_->backward_ws.data(), fp8_->backward_ws.nbytes(), device_}};
    expert_mlp_backward(dy_, fp8_saved(), probs_, fp8_weights(), routing_.layout(), grads, spec_, {}, ctx);
    backward_fused_ = false;
    return;
  }
  const ExecContext ctx{stream, {backward_ws_.data(), backward_ws_.nbytes(), device_}};
  expert_mlp_backward(dy_, x_, probs_, weights, routing_.layout(), recompute_ ? Tensor() : fc1_out_, grads, spec_,
                      ctx, &backward_fused_);
}

std::string MlpProblem::fusion_ran() const {
  if (forward_fused_) return backward_fused_ ? "all" : "forward";
  return backward_fused_ ? "backward" : "none";
}

OracleCheck MlpProblem::check_against_oracle() const {
  const int64_t rows = workload_.routed_tokens();
  const auto& splits = workload_.tokens_per_expert;
  oracle::MlpParams params;
  params.w1 = oracle::to_matrices(param(host_copy(w1_)));
  params.w2 = oracle::to_matrices(param(host_copy(w2_)));
  if (b1_.defined()) params.b1 = oracle::to_matrix(host_copy(b1_));
  if (b2_.defined()) params.b2 = oracle::to_matrix(host_copy(b2_));
  const oracle::Matrix x = oracle::head(oracle::to_matrix(host_copy(x_)), rows);
  const oracle::Vector probs = oracle::head(oracle::to_vector(host_copy(probs_)), rows);
  const auto f = oracle::mlp_forward(x, probs, params, splits, spec_.glu);
  const auto g = oracle::mlp_backward(oracle::head(oracle::to_matrix(host_copy(dy_)), rows), x, probs,
                                      params, splits, spec_.glu);

  // FP8 results are within FP8's error of the unquantized MLP: DeepGEMM's metric, the FP8 MLP
  // tests' bound (tests/cpp/fp8_mlp_support.hpp).
  const auto error = [&](const auto& out, const auto& ref) {
    return fp8_active_ ? oracle::similarity_diff(out, ref) : oracle::rel_error(out, ref);
  };
  OracleCheck c;
  if (fp8_active_) c.metric = "similarity_diff";
  c.rel_error["y"] = error(oracle::to_matrix(host_copy(y_)), f.y);
  if (!recompute_ && !fp8_active_) c.rel_error["fc1_out"] = error(oracle::to_matrix(host_copy(fc1_out_)), f.h);
  c.rel_error["dx"] = error(oracle::to_matrix(host_copy(dx_)), g.dx);
  c.rel_error["dprobs"] = error(oracle::to_vector(host_copy(dprobs_)), g.dprobs);
  c.rel_error["dw1"] = error(oracle::to_matrices(param(host_copy(dw1_))), g.dw1);
  c.rel_error["dw2"] = error(oracle::to_matrices(param(host_copy(dw2_))), g.dw2);
  if (db1_.defined()) c.rel_error["db1"] = error(oracle::to_matrix(host_copy(db1_)), g.db1);
  if (db2_.defined()) c.rel_error["db2"] = error(oracle::to_matrix(host_copy(db2_)), g.db2);
  for (const auto& [name, err] : c.rel_error) c.max_rel_error = std::max(c.max_rel_error, err);
  c.tolerance = fp8_active_ ? 5e-3 : oracle::mlp_tolerance(dtype_);
  c.passed = c.max_rel_error <= c.tolerance;  // NaN/inf errors are inf: they fail
  return c;
}

}  // namespace moe::tools
