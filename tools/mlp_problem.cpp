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
                       uint64_t seed)
    : workload_(w), dtype_(dtype), device_(device), routing_(w.tokens_per_expert, w.capacity, device) {
  spec_.glu.activation = parse_activation(w.activation);
  spec_.glu.layout = layout;
  const int64_t G = w.experts, H = w.hidden, F = w.ffn, T = w.capacity;

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
  w1_ = random({G, 2 * F, H}, 1.0 / std::sqrt(double(H)));
  w2_ = random({G, H, F}, 1.0 / std::sqrt(double(F)));
  if (w.bias) {
    b1_ = random({G, 2 * F}, 0.1);
    b2_ = random({G, H}, 0.1);
  }
  probs_ = Tensor::empty({T}, DType::kFloat32, device);
  fill_uniform(probs_, key++, 0.f, 1.f);
  dy_ = random({T, H}, 1.0);

  y_ = Tensor::empty({T, H}, dtype, device);
  fc1_out_ = Tensor::empty({T, 2 * F}, dtype, device);
  dx_ = Tensor::empty({T, H}, dtype, device);
  dprobs_ = Tensor::empty({T}, DType::kFloat32, device);
  dw1_ = Tensor::empty({G, 2 * F, H}, dtype, device);
  dw2_ = Tensor::empty({G, H, F}, dtype, device);
  if (w.bias) {
    db1_ = Tensor::empty({G, 2 * F}, dtype, device);
    db2_ = Tensor::empty({G, H}, dtype, device);
  }
  // Sized for every mode (recompute and the fused dGLU need the larger scratch).
  forward_ws_ = Tensor::empty({int64_t(expert_mlp_forward_workspace_size(T, H, F, dtype, false))},
                              DType::kUInt8, device);
  backward_ws_ = Tensor::empty({int64_t(expert_mlp_backward_workspace_size(T, H, F, dtype, true,
                                                                                MlpFusion::kForwardBackward))},
                               DType::kUInt8, device);
}

int64_t MlpProblem::bytes_needed(const Workload& w, DType dtype) {
  const int64_t G = w.experts, H = w.hidden, F = w.ffn, T = w.capacity, e = int64_t(dtype_size(dtype));
  const int64_t activations = 4 * T * H + T * 2 * F;          // x, y, dx, dy; the pre-activation
  const int64_t weights = 2 * (G * 2 * F * H + G * H * F);     // w1, w2 and their gradients
  const int64_t biases = w.bias ? 2 * (G * 2 * F + G * H) : 0;
  return e * (activations + weights + biases) + 2 * 4 * T +
         int64_t(expert_mlp_forward_workspace_size(T, H, F, dtype, false)) +
         int64_t(expert_mlp_backward_workspace_size(T, H, F, dtype, true, MlpFusion::kForwardBackward));
}

void MlpProblem::forward(Stream stream) {
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

  OracleCheck c;
  c.rel_error["y"] = oracle::rel_error(oracle::to_matrix(host_copy(y_)), f.y);
  if (!recompute_) c.rel_error["fc1_out"] = oracle::rel_error(oracle::to_matrix(host_copy(fc1_out_)), f.h);
  c.rel_error["dx"] = oracle::rel_error(oracle::to_matrix(host_copy(dx_)), g.dx);
  c.rel_error["dprobs"] = oracle::rel_error(oracle::to_vector(host_copy(dprobs_)), g.dprobs);
  c.rel_error["dw1"] = oracle::rel_error(oracle::to_matrices(param(host_copy(dw1_))), g.dw1);
  c.rel_error["dw2"] = oracle::rel_error(oracle::to_matrices(param(host_copy(dw2_))), g.dw2);
  if (db1_.defined())
    c.rel_error["db1"] = oracle::rel_error(oracle::to_matrix(host_copy(db1_)), g.db1);
  if (db2_.defined())
    c.rel_error["db2"] = oracle::rel_error(oracle::to_matrix(host_copy(db2_)), g.db2);
  for (const auto& [name, err] : c.rel_error) c.max_rel_error = std::max(c.max_rel_error, err);
  c.tolerance = oracle::mlp_tolerance(dtype_);
  c.passed = c.max_rel_error <= c.tolerance;  // NaN/inf errors are inf: they fail
  return c;
}

}  // namespace moe::tools
