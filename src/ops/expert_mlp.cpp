// The expert MLP, composed from the grouped-linear and activation ops (the "unfused" path), with
// the fused CUDA kernels (the activation in FC1's epilogue, its backward + dprobs in FC2 dgrad's)
// taking the steps they can: the same composition runs on every device. FC1's width W is
// fc1_width(spec.glu, F): 2F for a GLU, F for a non-gated activation.
#include "moe_engine/expert_mlp.hpp"

#include <utility>

#include "moe_engine/config.hpp"
#if MOE_ENGINE_WITH_CUDA
#include "cuda/backend.hpp"
#endif
#include "ops/validate.hpp"

namespace moe {
namespace {

struct ForwardBuffers {
  TensorView fc1_out;  // only when the caller does not keep it
  TensorView act;      // act(fc1_out) * p: the FC2 input
};

ForwardBuffers forward_buffers(ops::WorkspaceCarver& c, int64_t capacity, int64_t ffn, DType dtype,
                               bool save_fc1_out, const ExpertMlpSpec& spec) {
  ForwardBuffers b;
  if (!save_fc1_out) b.fc1_out = c.take({capacity, fc1_width(spec.glu, ffn)}, dtype);
  b.act = c.take({capacity, ffn}, dtype);
  return b;
}

// The activation's backward runs in place where it can (each element read, then written, by one
// thread), so the scratch is F + W per row (W more when FC1 is recomputed and the fused backward may
// run).
struct BackwardBuffers {
  TensorView fc1_out;         // recomputed pre-activation (recompute mode only)
  TensorView d_act;           // dL/d(act * p) = dy W2; the activation's backward writes act over it
  TensorView act;             // act * p recomputed: the FC2 wgrad input (d_act's memory)
  TensorView d_fc1;           // dL/d(fc1_out); over the recomputed fc1_out unless the backward is fused
  TensorView dprobs_partial;  // fused backward only: dprobs shares per 256-feature tile, [T, tiles] float32
};

// d_fc1_given: the caller's ExpertMlpGrads::d_fc1 takes d_fc1's place (b.d_fc1 stays undefined).
BackwardBuffers backward_buffers(ops::WorkspaceCarver& c, int64_t capacity, int64_t ffn,
                                 DType dtype, bool recompute_fc1, const ExpertMlpSpec& spec, bool d_fc1_given) {
  // The fused backward's epilogue is not made to run in place, so it keeps h and d_fc1 apart.
  const bool fused = spec.fusion == MlpFusion::kForwardBackward;
  const int64_t width = fc1_width(spec.glu, ffn);
  BackwardBuffers b;
  if (recompute_fc1) b.fc1_out = c.take({capacity, width}, dtype);
  b.act = b.d_act = c.take({capacity, ffn}, dtype);
  if (!d_fc1_given) b.d_fc1 = recompute_fc1 && !fused ? b.fc1_out : c.take({capacity, width}, dtype);
  if (fused) b.dprobs_partial = c.take({capacity, (ffn + 255) / 256}, DType::kFloat32);
  return b;
}

// Checks x (when given or required), probs, weights and spec; returns {H, F}.
std::pair<int64_t, int64_t> check_mlp(const ops::Validator& v, const TensorView& x, bool x_required,
                                      const TensorView& probs, const ExpertMlpWeights& w,
                                      const ExpertMlpSpec& spec) {
  if (!w.fc2_weight.defined())
    v.fail(ErrorCode::kInvalidArgument,
           "fc2_weight: required per-expert tensor [H, F] is undefined");
  if (w.fc2_weight.expert_shape().size() != 2)
    v.fail(ErrorCode::kShape, "fc2_weight: expected G x [H, F], got ", w.fc2_weight.describe());
  const int64_t H = w.fc2_weight.expert_shape()[0], F = w.fc2_weight.expert_shape()[1];
  v.glu_spec(spec.glu, F);
  const ops::Fc1Dims fc1 = ops::fc1_dims(spec.glu, F);
  v.param("fc2_weight", w.fc2_weight, {H, F}, "[H, F]");
  v.param("fc1_weight", w.fc1_weight, {fc1.width, H}, fc1.weight);
  v.same_dtype("fc1_weight", w.fc1_weight.dtype(), "fc2_weight", w.fc2_weight.dtype());
  if (x.defined() || x_required) {
    v.matrix("x", x, v.capacity(), H, "[T, H]");
    v.same_dtype("x", x.dtype(), "fc2_weight", w.fc2_weight.dtype());
  }
  if (w.fc1_bias.defined()) v.param("fc1_bias", w.fc1_bias, {fc1.width}, fc1.bias);
  if (w.fc2_bias.defined()) v.param("fc2_bias", w.fc2_bias, {H}, "[H]");
  if (probs.defined()) v.row_scale("probs", probs);
  return {H, F};
}

// A gradient of `param` (whose shape `dims` names), when requested.
void check_param_grad(const ops::Validator& v, const char* name, const ParamGrad& pg,
                      const GroupedParam& param, const char* dims) {
  if (!pg.grad.defined()) return;
  if (!param.defined())
    v.fail(ErrorCode::kInvalidArgument, name, ": a gradient is requested but the MLP has no ",
           name);
  v.param(name, pg.grad, param.expert_shape(), dims);
  v.grad_target(name, pg.grad, pg.mode);
}

}  // namespace

size_t expert_mlp_forward_workspace_size(int64_t capacity, int64_t /*hidden*/, int64_t ffn,
                                         DType dtype, bool save_fc1_out, const ExpertMlpSpec& spec) {
  ops::WorkspaceCarver c;
  forward_buffers(c, capacity, ffn, dtype, save_fc1_out, spec);
  return c.used();
}

size_t expert_mlp_backward_workspace_size(int64_t capacity, int64_t /*hidden*/, int64_t ffn,
                                          DType dtype, bool recompute_fc1, const ExpertMlpSpec& spec,
                                          bool d_fc1_given) {
  ops::WorkspaceCarver c;
  backward_buffers(c, capacity, ffn, dtype, recompute_fc1, spec, d_fc1_given);
  return c.used();
}

void expert_mlp_forward(const TensorView& x, const TensorView& probs,
                        const ExpertMlpWeights& weights, const GroupLayout& groups,
                        const TensorView& y, const TensorView& fc1_out, const ExpertMlpSpec& spec,
                        const ExecContext& ctx, bool* ran_fused) {
  const ops::Validator v("expert_mlp_forward", groups);
  // (Named variables, not a structured binding: the lambda below captures them, which clang
  // before 16 rejects for bindings.)
  const std::pair<int64_t, int64_t> dims = check_mlp(v, x, /*x_required=*/true, probs, weights, spec);
  const int64_t H = dims.first, F = dims.second;
  const int64_t T = v.capacity();
  v.matrix("y", y, T, H, "[T, H]");
  v.same_dtype("y", y.dtype(), "x", x.dtype());
  const ops::Fc1Dims fc1 = ops::fc1_dims(spec.glu, F);
  if (fc1_out.defined()) {
    v.matrix("fc1_out", fc1_out, T, fc1.width, fc1.rows);
    v.same_dtype("fc1_out", fc1_out.dtype(), "x", x.dtype());
  }
  const size_t ws_bytes = expert_mlp_forward_workspace_size(T, H, F, x.dtype(), fc1_out.defined(), spec);
  v.workspace(ctx.workspace, ws_bytes, "expert_mlp_forward_workspace_size");
  v.workspace_apart(ctx.workspace, ws_bytes, {{"x", x}, {"probs", probs}, {"y", y}, {"fc1_out", fc1_out}},
                    {{"fc1_weight", &weights.fc1_weight}, {"fc1_bias", &weights.fc1_bias},
                     {"fc2_weight", &weights.fc2_weight}, {"fc2_bias", &weights.fc2_bias}});
  // fc1_glu(act) runs FC1 + the activation fused into act (and fc1_out) and returns true, or does
  // nothing.
  const auto compose = [&](auto&& fc1_glu) {
    ops::WorkspaceCarver carver(ctx.workspace, v.device());
    const ForwardBuffers b = forward_buffers(carver, T, F, x.dtype(), fc1_out.defined(), spec);
    const bool fused = fc1_glu(b.act);
    if (ran_fused) *ran_fused = fused;
    if (!fused) {
      const TensorView h = fc1_out.defined() ? fc1_out : b.fc1_out;
      grouped_linear_forward(x, weights.fc1_weight, groups, h, {weights.fc1_bias, {}}, ctx);
      glu_forward(h, probs, groups, b.act, spec.glu, ctx);
    }
    const TensorView fc2_scale = weights.fc2_bias.defined() ? probs : TensorView{};
    grouped_linear_forward(b.act, weights.fc2_weight, groups, y, {weights.fc2_bias, fc2_scale},
                           ctx);
  };
  const auto unfused = [](const TensorView&) { return false; };
  ops::dispatch(
      v, [&] { compose(unfused); },
      [&] {
#if MOE_ENGINE_WITH_CUDA
        if (spec.fusion != MlpFusion::kNone)
          return compose([&](const TensorView& act) {
            return cuda::expert_mlp_fc1_glu(x, weights.fc1_weight, weights.fc1_bias, groups, probs, spec.glu, fc1_out, act, ctx.stream);
          });
#endif
        compose(unfused);
      });
}

void expert_mlp_backward(const TensorView& dy, const TensorView& x, const TensorView& probs,
                         const ExpertMlpWeights& weights, const GroupLayout& groups,
                         const TensorView& fc1_out, const ExpertMlpGrads& grads,
                         const ExpertMlpSpec& spec, const ExecContext& ctx, bool* ran_fused) {
  const ops::Validator v("expert_mlp_backward", groups);
  // x is needed to recompute the pre-activation and for the FC1 weight gradient, else optional.
  const bool x_required = !fc1_out.defined() || grads.fc1_weight.grad.defined();
  const std::pair<int64_t, int64_t> dims = check_mlp(v, x, x_required, probs, weights, spec);
  const int64_t H = dims.first, F = dims.second;
  const int64_t T = v.capacity();
  v.matrix("dy", dy, T, H, "[T, H]");
  v.same_dtype("dy", dy.dtype(), "fc2_weight", weights.fc2_weight.dtype());
  const ops::Fc1Dims fc1 = ops::fc1_dims(spec.glu, F);
  if (fc1_out.defined()) {
    v.matrix("fc1_out", fc1_out, T, fc1.width, fc1.rows);
    v.same_dtype("fc1_out", fc1_out.dtype(), "dy", dy.dtype());
  }
  if (grads.dx.defined()) {
    v.matrix("dx", grads.dx, T, H, "[T, H]");
    v.same_dtype("dx", grads.dx.dtype(), "dy", dy.dtype());
  }
  // The activations written out for the caller (d_fc1, act): [T, cols] in dy's dtype, apart from
  // the inputs and the other outputs.
  const auto written_out = [&](const char* name, const TensorView& t, int64_t cols, const char* dims) {
    if (!t.defined()) return;
    v.matrix(name, t, T, cols, dims);
    v.same_dtype(name, t.dtype(), "dy", dy.dtype());
    v.no_overlap(name, t, "dy", dy);
    if (fc1_out.defined()) v.no_overlap(name, t, "fc1_out", fc1_out);
    if (x.defined()) v.no_overlap(name, t, "x", x);
    if (grads.dx.defined()) v.distinct_outputs(name, t, "dx", grads.dx);
  };
  written_out("d_fc1", grads.d_fc1, fc1.width, fc1.rows);
  written_out("act", grads.act, F, "[T, F]");
  if (grads.d_fc1.defined() && grads.act.defined()) v.distinct_outputs("act", grads.act, "d_fc1", grads.d_fc1);
  if (grads.dprobs.defined()) {
    if (!probs.defined())
      v.fail(ErrorCode::kInvalidArgument, "dprobs is requested but no probs were given");
    v.row_scale("dprobs", grads.dprobs);
  }
  check_param_grad(v, "fc1_weight", grads.fc1_weight, weights.fc1_weight, fc1.weight);
  check_param_grad(v, "fc1_bias", grads.fc1_bias, weights.fc1_bias, fc1.bias);
  check_param_grad(v, "fc2_weight", grads.fc2_weight, weights.fc2_weight, "[H, F]");
  check_param_grad(v, "fc2_bias", grads.fc2_bias, weights.fc2_bias, "[H]");
  const bool recompute = !fc1_out.defined();
  const DType dtype = weights.fc2_weight.dtype();
  const bool d_fc1_given = grads.d_fc1.defined();
  const size_t ws_bytes = expert_mlp_backward_workspace_size(T, H, F, dtype, recompute, spec, d_fc1_given);
  v.workspace(ctx.workspace, ws_bytes, "expert_mlp_backward_workspace_size");
  v.workspace_apart(ctx.workspace, ws_bytes,
                    {{"dy", dy}, {"x", x}, {"probs", probs}, {"fc1_out", fc1_out}, {"dx", grads.dx},
                     {"dprobs", grads.dprobs}, {"d_fc1", grads.d_fc1}, {"act", grads.act}},
                    {{"fc1_weight", &weights.fc1_weight}, {"fc1_bias", &weights.fc1_bias},
                     {"fc2_weight", &weights.fc2_weight}, {"fc2_bias", &weights.fc2_bias},
                     {"the fc1_weight gradient", &grads.fc1_weight.grad}, {"the fc1_bias gradient", &grads.fc1_bias.grad},
                     {"the fc2_weight gradient", &grads.fc2_weight.grad}, {"the fc2_bias gradient", &grads.fc2_bias.grad}});
  // dgrad_glu(h, b, act) runs FC2's dgrad + the activation's backward fused (act: the recomputed
  // act * p, when FC2's weight gradient needs it or the caller asks for it) and returns true, or
  // does nothing.
  const auto compose = [&](auto&& dgrad_glu) {
    ops::WorkspaceCarver carver(ctx.workspace, v.device());
    BackwardBuffers b = backward_buffers(carver, T, F, dtype, recompute, spec, d_fc1_given);
    if (d_fc1_given) b.d_fc1 = grads.d_fc1;
    const TensorView h = recompute ? b.fc1_out : fc1_out;
    if (recompute)
      grouped_linear_forward(x, weights.fc1_weight, groups, h, {weights.fc1_bias, {}}, ctx);
    const bool need_act = grads.fc2_weight.grad.defined() || grads.act.defined();
    const TensorView act = grads.act.defined() ? grads.act : need_act ? b.act : TensorView{};
    const bool fused = dgrad_glu(h, b, act);
    if (ran_fused) *ran_fused = fused;
    if (!fused) {
      grouped_linear_dgrad(dy, weights.fc2_weight, groups, b.d_act, ctx);
      glu_backward(h, probs, b.d_act, groups, {b.d_fc1, grads.dprobs, act}, spec.glu, ctx);
    }
    // y holds + p * b2, so dprobs also gets <b2_g, dy[r]>.
    if (grads.dprobs.defined() && weights.fc2_bias.defined())
      grouped_linear_dscales(dy, weights.fc2_bias, groups, grads.dprobs, /*accumulate=*/true, ctx);
    if (grads.fc2_weight.grad.defined())
      grouped_linear_wgrad(dy, act, groups, grads.fc2_weight.grad, grads.fc2_weight.mode, ctx);
    if (grads.fc2_bias.grad.defined())
      grouped_linear_dbias(dy, groups, grads.fc2_bias.grad, grads.fc2_bias.mode, probs, ctx);
    if (grads.fc1_bias.grad.defined())
      grouped_linear_dbias(b.d_fc1, groups, grads.fc1_bias.grad, grads.fc1_bias.mode, {}, ctx);
    if (grads.fc1_weight.grad.defined())
      grouped_linear_wgrad(b.d_fc1, x, groups, grads.fc1_weight.grad, grads.fc1_weight.mode, ctx);
    if (grads.dx.defined())
      grouped_linear_dgrad(b.d_fc1, weights.fc1_weight, groups, grads.dx, ctx);
  };
  const auto unfused = [](const TensorView&, const BackwardBuffers&, const TensorView&) { return false; };
  ops::dispatch(
      v, [&] { compose(unfused); },
      [&] {
#if MOE_ENGINE_WITH_CUDA
        if (spec.fusion == MlpFusion::kForwardBackward)
          return compose([&](const TensorView& h, const BackwardBuffers& b, const TensorView& act) {
            return cuda::expert_mlp_fc2_dgrad_glu(dy, weights.fc2_weight, groups, h, probs, spec.glu, b.d_fc1, act,
                                                  grads.dprobs, b.dprobs_partial, ctx.stream);
          });
#endif
        compose(unfused);
      });
}

}  // namespace moe
