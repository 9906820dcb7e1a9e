// The FP8 expert MLP (moe_engine/expert_mlp_fp8.hpp), composed from the FP8 quantizers and GEMMs
// and the activation ops: every step is an op of its own, so the composition runs on every device.
// FC1's width is fc1_width(spec.glu, F): 2F for a GLU, F for a non-gated activation.
// Everything the op reads is checked before the first step runs, so that bad input fails before
// any output or kept tensor is written.
#include "moe_engine/expert_mlp_fp8.hpp"

#include <string>
#include <utility>

#include "moe_engine/config.hpp"
#include "moe_engine/glu.hpp"
#include "moe_engine/grouped_linear.hpp"
#if MOE_ENGINE_WITH_CUDA
#include "cuda/backend.hpp"
#endif
#include "ops/validate.hpp"

namespace moe {
namespace {

int64_t blocks_of(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// The columnwise layout of T tokens over G experts can be more than twice the rows' bytes (every
// expert padded to whole 128-token blocks): many experts of few tokens. From the static shapes.
bool fp8_columns_mostly_padding(int64_t T, int64_t G) { return fp8_columns_capacity(T, G) > 2 * T; }

// Whether backward may take the one-pass step after FC2's dgrad (CUDA; the pass itself may still
// decline a layout, dtype or alignment): any fusion but kNone, and column blocks that are mostly
// tokens (its tiles are column blocks; with many small experts they are mostly padding, and the
// separate steps measured faster: docs/performance-log.md). From static shapes: the workspace
// reserves its buffers only where it may run.
bool one_pass_backward_may_run(const ExpertMlpSpec& spec, int64_t T, int64_t G) {
  return spec.fusion != MlpFusion::kNone && !fp8_columns_mostly_padding(T, G);
}

// CUDA: the device runs the FP8 GEMMs, checked with the arguments, before a step writes anything
// (the quantizers run on any GPU; the GEMMs need compute capability 9.0).
#if MOE_ENGINE_WITH_CUDA
void require_fp8_gemms_on_cuda(const ops::Validator& v) {
  std::string why;
  if (!cuda::fp8_gemms_supported(v.device().index, &why))
    v.fail(ErrorCode::kNotImplemented, "the FP8 GEMMs cannot run on this device: ", why);
}
#endif
void require_fp8_gemms(const ops::Validator& v) {
  ops::dispatch(v, [] {}, [&] { MOE_CUDA_ONLY(require_fp8_gemms_on_cuda(v)); });
}

// Scratch rows / columns of a [T, K] tensor.
Fp8Rows take_rows(ops::WorkspaceCarver& c, int64_t T, int64_t K) {
  return {c.take({T, K}, DType::kFloat8E4M3), c.take({blocks_of(K), fp8_scales_pitch(T)}, DType::kFloat32)};
}
Fp8Columns take_columns(ops::WorkspaceCarver& c, int64_t T, int64_t G, int64_t K) {
  const int64_t C = fp8_columns_capacity(T, G);
  return {c.take({K, C}, DType::kFloat8E4M3), c.take({C / kFp8Block, K}, DType::kFloat32),
          c.take({G + 1}, DType::kInt64)};
}

struct ForwardBuffers {
  Fp8Rows x_rows;    // FC1's operand
  TensorView h;      // the pre-activation, in x's dtype
  TensorView act;    // GLU(h) * p
  Fp8Rows act_rows;  // FC2's operand
};

ForwardBuffers forward_buffers(ops::WorkspaceCarver& c, int64_t T, int64_t H, int64_t F, DType dtype,
                               const ExpertMlpSpec& spec) {
  ForwardBuffers b;
  b.x_rows = take_rows(c, T, H);
  b.h = c.take({T, fc1_width(spec.glu, F)}, dtype);
  b.act = c.take({T, F}, dtype);
  b.act_rows = take_rows(c, T, F);
  return b;
}

// The activation's backward runs in place: d_fc1 over the dequantized h, the recomputed act over d_act.
// Two ways through backward share one workspace, chosen at run time (the one-pass backward may
// decline): FC2's phase (dy's copies, d_act, act's columns) first, then
// - one pass (one_pass_backward_may_run): dL/dh's FP8 copies right after FC2's phase, which it reads while
//   writing them (one_pass_d_fc1_*);
// - the separate steps: dL/dh in the activation dtype (h) after FC2's phase, and its FP8 copies,
//   made after FC2's weight gradient when FC2's phase is dead, over that memory (d_fc1_*).
// The workspace is the larger of the two; the one pass needs no h, so it is no larger than the
// separate steps' unless FC2's phase is larger than dL/dh's copies (then by their scales' bytes).
struct BackwardBuffers {
  TensorView h;              // the kept pre-activation dequantized, then dL/d(h)
  TensorView dprobs_shares;  // the fused passes' dprobs shares: per 128 features [T, ceil(F/128)] or per
                             // 128 columns of h (the one-pass backward's tiles), [T, ceil(W/128)]
  Fp8Rows dy_rows;           // FC2 dgrad's operand
  Fp8Columns dy_columns;     // FC2 wgrad's
  TensorView d_act;          // dL/d(act), then act recomputed (FC2 wgrad's other operand)
  Fp8Columns act_columns;
  Fp8Rows d_fc1_rows;        // FC1 dgrad's operand
  Fp8Columns d_fc1_columns;  // FC1 wgrad's
  Fp8Rows one_pass_d_fc1_rows;  // the same, written by the one-pass backward
  Fp8Columns one_pass_d_fc1_columns;
  TensorView x;              // x dequantized from its kept rows, then
  Fp8Columns x_columns;      // its columns (FC1 wgrad's), when forward kept the rows
};

BackwardBuffers backward_buffers(ops::WorkspaceCarver& c, int64_t T, int64_t G, int64_t H, int64_t F, DType dtype,
                                 const ExpertMlpSpec& spec, bool x_rows) {
  const int64_t W = fc1_width(spec.glu, F);
  const bool one_pass = one_pass_backward_may_run(spec, T, G);
  BackwardBuffers b;
  b.dprobs_shares = c.take({T, blocks_of(one_pass ? W : F)}, DType::kFloat32);
  const size_t fc2_phase = c.mark();
  b.dy_rows = take_rows(c, T, H);
  b.dy_columns = take_columns(c, T, G, H);
  b.d_act = c.take({T, F}, dtype);
  b.act_columns = take_columns(c, T, G, F);
  const size_t fc2_end = c.mark();
  size_t one_pass_end = fc2_end;
  if (one_pass) {
    b.one_pass_d_fc1_rows = take_rows(c, T, W);
    b.one_pass_d_fc1_columns = take_columns(c, T, G, W);
    one_pass_end = c.mark();
  }
  c.rewind(fc2_phase);
  b.d_fc1_rows = take_rows(c, T, W);
  b.d_fc1_columns = take_columns(c, T, G, W);
  c.skip_to(fc2_end);
  b.h = c.take({T, W}, dtype);
  if (x_rows) {
    c.skip_to(one_pass_end);
    b.x = c.take({T, H}, dtype);
    b.x_columns = take_columns(c, T, G, H);
  }
  return b;
}

// A quantized weight G x [n, k]: both copies when `transposed_too` (backward reads data_t).
void check_weight(const ops::Validator& v, const char* name, const Fp8Weight& w, int64_t n, int64_t k,
                  const char* dims, const char* dims_t, bool transposed_too) {
  const int64_t G = v.num_groups();
  const std::string p(name);
  v.contiguous((p + ".data").c_str(), w.data, {G, n, k}, DType::kFloat8E4M3, dims);
  v.contiguous((p + ".scales").c_str(), w.scales, {G, blocks_of(n), blocks_of(k)}, DType::kFloat32,
               "[G, ceil(N/128), ceil(K/128)]");
  if (!transposed_too) return;
  v.contiguous((p + ".data_t").c_str(), w.data_t, {G, k, n}, DType::kFloat8E4M3, dims_t);
  v.contiguous((p + ".scales_t").c_str(), w.scales_t, {G, blocks_of(k), blocks_of(n)}, DType::kFloat32,
               "[G, ceil(K/128), ceil(N/128)]");
}

// Weights, biases and the activation spec; returns {H, F}. The FC2 weight sets the sizes.
std::pair<int64_t, int64_t> check_weights(const ops::Validator& v, const ExpertMlpFp8Weights& w,
                                          const ExpertMlpSpec& spec, bool backward) {
  const TensorView& fc2 = w.fc2.data;
  if (!fc2.defined()) v.fail(ErrorCode::kInvalidArgument, "fc2.data: required tensor [G, H, F] is undefined");
  if (fc2.dim() != 3) v.fail(ErrorCode::kShape, "fc2.data: expected a 3-D [G, H, F] tensor, got ", fc2.describe());
  const int64_t H = fc2.size(1), F = fc2.size(2);
  v.multiple_of_16("H", H, "fc2.data's rows");
  v.multiple_of_16("F", F, "fc2.data's columns");
  v.glu_spec(spec.glu, F);
  const ops::Fc1Dims fc1 = ops::fc1_dims(spec.glu, F);
  check_weight(v, "fc2", w.fc2, H, F, "[G, H, F]", "[G, F, H]", backward);
  check_weight(v, "fc1", w.fc1, fc1.width, H, fc1.packed_weight, fc1.packed_weight_t, backward);
  if (w.fc1_bias.defined()) v.param("fc1_bias", w.fc1_bias, {fc1.width}, fc1.bias);
  if (w.fc2_bias.defined()) v.param("fc2_bias", w.fc2_bias, {H}, "[H]");
  return {H, F};
}

// An activation [T, K] of the MLP's dtype: bfloat16 or float32 (what the FP8 GEMMs write).
void check_activation(const ops::Validator& v, const char* name, const TensorView& t, int64_t K, const char* dims) {
  v.matrix(name, t, v.capacity(), K, dims);
  if (t.dtype() != DType::kBFloat16 && t.dtype() != DType::kFloat32)
    v.fail(ErrorCode::kDType, name, ": expected bfloat16 or float32, got ", dtype_name(t.dtype()));
}

void check_saved_rows(const ops::Validator& v, const Fp8Rows& rows, const ops::Fc1Dims& fc1) {
  v.fp8_matrix("saved.fc1_out.data", rows.data, v.capacity(), fc1.width, fc1.rows);
  v.scale_matrix("saved.fc1_out.scales", rows.scales, blocks_of(fc1.width), -1, fc1.row_scales);
  if (rows.scales.size(1) < v.capacity())
    v.fail(ErrorCode::kShape, "saved.fc1_out.scales: expected a pitch S >= T = ", v.capacity(), ", got ",
           rows.scales.describe());
}

void check_saved_x_rows(const ops::Validator& v, const Fp8Rows& rows, int64_t H) {
  v.fp8_matrix("saved.x_rows.data", rows.data, v.capacity(), H, "[T, H]");
  v.scale_matrix("saved.x_rows.scales", rows.scales, blocks_of(H), -1, "[ceil(H/128), S]");
  if (rows.scales.size(1) < v.capacity())
    v.fail(ErrorCode::kShape, "saved.x_rows.scales: expected a pitch S >= T = ", v.capacity(), ", got ",
           rows.scales.describe());
}

void check_saved_columns(const ops::Validator& v, const Fp8Columns& columns, int64_t H) {
  const int64_t C = fp8_columns_capacity(v.capacity(), v.num_groups());
  v.fp8_matrix("saved.x.data", columns.data, H, C, "[H, C]");
  v.scale_matrix("saved.x.scales", columns.scales, C / kFp8Block, H, "[C/128, H]");
  v.int64_vector("saved.x.offsets", columns.offsets, v.num_groups() + 1, "[G + 1]");
}

void check_param_grad(const ops::Validator& v, const char* name, const ParamGrad& pg, const Shape& shape,
                      const char* dims, bool has_param) {
  if (!pg.grad.defined()) return;
  if (!has_param)
    v.fail(ErrorCode::kInvalidArgument, name, ": a gradient is requested but the MLP has no ", name);
  v.param(name, pg.grad, shape, dims);
  v.grad_target(name, pg.grad, pg.mode);
}

}  // namespace

ExpertMlpFp8SavedShapes expert_mlp_fp8_saved_shapes(int64_t capacity, int64_t num_groups, int64_t hidden,
                                                    int64_t ffn, const ExpertMlpSpec& spec) {
  MOE_CHECK(hidden >= 0 && ffn >= 0, ErrorCode::kInvalidArgument,
            "expert_mlp_fp8_saved_shapes: expected H >= 0 and F >= 0, got H = ", hidden, ", F = ", ffn);
  const int64_t C = fp8_columns_capacity(capacity, num_groups), W = fc1_width(spec.glu, ffn);
  return {{hidden, C},
          {C / kFp8Block, hidden},
          {num_groups + 1},
          {capacity, W},
          {blocks_of(W), fp8_scales_pitch(capacity)},
          {capacity, hidden},
          {blocks_of(hidden), fp8_scales_pitch(capacity)}};
}

bool expert_mlp_fp8_keeps_x_rows(int64_t capacity, int64_t num_groups) {
  return fp8_columns_mostly_padding(capacity, num_groups);
}

size_t expert_mlp_fp8_forward_workspace_size(int64_t capacity, int64_t hidden, int64_t ffn, DType dtype,
                                             const ExpertMlpSpec& spec) {
  ops::WorkspaceCarver c;
  forward_buffers(c, capacity, hidden, ffn, dtype, spec);
  return c.used();
}

size_t expert_mlp_fp8_backward_workspace_size(int64_t capacity, int64_t num_groups, int64_t hidden, int64_t ffn,
                                              DType dtype, const ExpertMlpSpec& spec, bool x_rows) {
  ops::WorkspaceCarver c;
  backward_buffers(c, capacity, num_groups, hidden, ffn, dtype, spec, x_rows);
  return c.used();
}

void expert_mlp_forward(const TensorView& x, const TensorView& probs, const ExpertMlpFp8Weights& weights,
                        const GroupLayout& groups, const TensorView& y, const ExpertMlpFp8Saved& saved,
                        const ExpertMlpSpec& spec, const Fp8Recipe& recipe, const ExecContext& ctx, bool* ran_fused) {
  const ops::Validator v("expert_mlp_forward (fp8)", groups);
  const auto [H, F] = check_weights(v, weights, spec, /*backward=*/false);
  const int64_t T = v.capacity();
  check_activation(v, "x", x, H, "[T, H]");
  check_activation(v, "y", y, H, "[T, H]");
  v.same_dtype("y", y.dtype(), "x", x.dtype());
  v.no_overlap("y", y, "x", x);
  if (probs.defined()) v.row_scale("probs", probs);
  if (saved.fc1_out.data.defined() || saved.fc1_out.scales.defined())
    check_saved_rows(v, saved.fc1_out, ops::fc1_dims(spec.glu, F));
  if (saved.x.data.defined()) check_saved_columns(v, saved.x, H);
  if (saved.x_rows.data.defined()) {
    if (saved.x.data.defined())
      v.fail(ErrorCode::kInvalidArgument, "saved.x and saved.x_rows: expected at most one form of x, got both");
    check_saved_x_rows(v, saved.x_rows, H);
    v.no_overlap("saved.x_rows.data", saved.x_rows.data, "x", x);
  }
  const size_t ws_bytes = expert_mlp_fp8_forward_workspace_size(T, H, F, x.dtype(), spec);
  v.workspace(ctx.workspace, ws_bytes, "expert_mlp_fp8_forward_workspace_size");
  v.workspace_apart(ctx.workspace, ws_bytes,
                    {{"x", x}, {"probs", probs}, {"y", y}, {"saved.x.data", saved.x.data},
                     {"saved.x.scales", saved.x.scales}, {"saved.x.offsets", saved.x.offsets},
                     {"saved.fc1_out.data", saved.fc1_out.data}, {"saved.fc1_out.scales", saved.fc1_out.scales},
                     {"saved.x_rows.data", saved.x_rows.data}, {"saved.x_rows.scales", saved.x_rows.scales},
                     {"fc1.data", weights.fc1.data}, {"fc1.scales", weights.fc1.scales},
                     {"fc2.data", weights.fc2.data}, {"fc2.scales", weights.fc2.scales}},
                    {{"fc1_bias", &weights.fc1_bias}, {"fc2_bias", &weights.fc2_bias}});
  require_fp8_gemms(v);

  ops::WorkspaceCarver carver(ctx.workspace, v.device());
  const ForwardBuffers b = forward_buffers(carver, T, H, F, x.dtype(), spec);
  // x's rows: FC1's operand, written straight into what backward keeps when it keeps them.
  const Fp8Rows x_rows = saved.x_rows.data.defined() ? saved.x_rows : b.x_rows;
  quantize_fp8(x, groups, x_rows, saved.x.data.defined() ? saved.x : Fp8Columns{}, recipe, ctx);
  grouped_linear_forward(x_rows, weights.fc1, groups, b.h, {weights.fc1_bias, {}}, ctx);
  // h quantized, the activation and act quantized in one pass (CUDA, where it takes the activation
  // and layout: GLUs only).
  bool fused = false;
  ops::dispatch(
      v, [] {},
      [&] {
        if (spec.fusion != MlpFusion::kNone)
          MOE_CUDA_ONLY(fused = cuda::fp8_glu_quantize(b.h, probs, groups, saved.fc1_out, b.act_rows, spec.glu, recipe,
                                                       ctx.stream));
      });
  if (ran_fused) *ran_fused = fused;
  if (!fused) {
    if (saved.fc1_out.data.defined()) quantize_fp8(b.h, groups, saved.fc1_out, {}, recipe, ctx);
    glu_forward(b.h, probs, groups, b.act, spec.glu, ctx);
    quantize_fp8(b.act, groups, b.act_rows, {}, recipe, ctx);
  }
  const TensorView fc2_scale = weights.fc2_bias.defined() ? probs : TensorView{};
  grouped_linear_forward(b.act_rows, weights.fc2, groups, y, {weights.fc2_bias, fc2_scale}, ctx);
}

void expert_mlp_backward(const TensorView& dy, const ExpertMlpFp8Saved& saved, const TensorView& probs,
                         const ExpertMlpFp8Weights& weights, const GroupLayout& groups, const ExpertMlpGrads& grads,
                         const ExpertMlpSpec& spec, const Fp8Recipe& recipe, const ExecContext& ctx,
                         Fp8GluBackwardPath* ran) {
  const ops::Validator v("expert_mlp_backward (fp8)", groups);
  const auto [H, F] = check_weights(v, weights, spec, /*backward=*/true);
  const int64_t T = v.capacity(), G = v.num_groups();
  check_activation(v, "dy", dy, H, "[T, H]");
  const ops::Fc1Dims fc1 = ops::fc1_dims(spec.glu, F);
  check_saved_rows(v, saved.fc1_out, fc1);
  const bool fc1_wgrad = grads.fc1_weight.grad.defined(), fc2_wgrad = grads.fc2_weight.grad.defined();
  const bool x_from_rows = !saved.x.data.defined() && saved.x_rows.data.defined();
  if (fc1_wgrad) {
    if (!saved.x.data.defined() && !saved.x_rows.data.defined())
      v.fail(ErrorCode::kInvalidArgument,
             "saved.x: the FC1 weight gradient is requested but forward kept neither columns nor rows of x");
    if (saved.x.data.defined() && saved.x_rows.data.defined())
      v.fail(ErrorCode::kInvalidArgument, "saved.x and saved.x_rows: expected at most one form of x, got both");
    if (x_from_rows) check_saved_x_rows(v, saved.x_rows, H);
    else check_saved_columns(v, saved.x, H);
  }
  if (probs.defined()) v.row_scale("probs", probs);
  if (grads.d_fc1.defined())
    v.fail(ErrorCode::kInvalidArgument,
           "d_fc1: the FP8 backward keeps dL/d(fc1_out) in FP8 for FC1's GEMMs and does not write it out; "
           "expected no d_fc1");
  if (grads.act.defined())
    v.fail(ErrorCode::kInvalidArgument,
           "act: the FP8 backward makes FC2's input in FP8 for its weight gradient and does not write it out; "
           "expected no act");
  if (grads.dx.defined()) {
    check_activation(v, "dx", grads.dx, H, "[T, H]");
    v.same_dtype("dx", grads.dx.dtype(), "dy", dy.dtype());
    v.no_overlap("dx", grads.dx, "dy", dy);
  }
  if (grads.dprobs.defined()) {
    if (!probs.defined()) v.fail(ErrorCode::kInvalidArgument, "dprobs is requested but no probs were given");
    v.row_scale("dprobs", grads.dprobs);
  }
  check_param_grad(v, "fc1_weight", grads.fc1_weight, {fc1.width, H}, fc1.weight, true);
  check_param_grad(v, "fc2_weight", grads.fc2_weight, {H, F}, "[H, F]", true);
  check_param_grad(v, "fc1_bias", grads.fc1_bias, {fc1.width}, fc1.bias, weights.fc1_bias.defined());
  check_param_grad(v, "fc2_bias", grads.fc2_bias, {H}, "[H]", weights.fc2_bias.defined());
  const bool make_x_columns = fc1_wgrad && x_from_rows;
  const size_t ws_bytes = expert_mlp_fp8_backward_workspace_size(T, G, H, F, dy.dtype(), spec, make_x_columns);
  v.workspace(ctx.workspace, ws_bytes,
              make_x_columns ? "expert_mlp_fp8_backward_workspace_size(x_rows = true)"
                             : "expert_mlp_fp8_backward_workspace_size");
  v.workspace_apart(ctx.workspace, ws_bytes,
                    {{"dy", dy}, {"probs", probs}, {"saved.x.data", saved.x.data}, {"saved.x.scales", saved.x.scales},
                     {"saved.fc1_out.data", saved.fc1_out.data}, {"saved.fc1_out.scales", saved.fc1_out.scales},
                     {"saved.x_rows.data", saved.x_rows.data}, {"saved.x_rows.scales", saved.x_rows.scales},
                     {"fc1.data_t", weights.fc1.data_t}, {"fc2.data_t", weights.fc2.data_t}, {"dx", grads.dx},
                     {"dprobs", grads.dprobs}, {"d_fc1", grads.d_fc1}, {"act", grads.act}},
                    {{"the fc1_weight gradient", &grads.fc1_weight.grad}, {"the fc1_bias gradient", &grads.fc1_bias.grad},
                     {"the fc2_weight gradient", &grads.fc2_weight.grad},
                     {"the fc2_bias gradient", &grads.fc2_bias.grad}});
  require_fp8_gemms(v);

  ops::WorkspaceCarver carver(ctx.workspace, v.device());
  const BackwardBuffers b = backward_buffers(carver, T, G, H, F, dy.dtype(), spec, make_x_columns);
  quantize_fp8(dy, groups, b.dy_rows, fc2_wgrad ? b.dy_columns : Fp8Columns{}, recipe, ctx);
  grouped_linear_dgrad(b.dy_rows, weights.fc2, groups, b.d_act, ctx);
  // The step between FC2's dgrad and the weight gradients in one pass (one_pass_backward_may_run):
  // both weight gradients asked for (it writes both columnwise copies, on dy's column offsets), no
  // FC1 bias gradient (that reads dL/dh unquantized).
  bool fused = false;
  if (one_pass_backward_may_run(spec, T, G) && fc1_wgrad && fc2_wgrad && !grads.fc1_bias.grad.defined())
    ops::dispatch(
        v, [] {},
        [&] {
          MOE_CUDA_ONLY(fused = cuda::fp8_glu_backward_quantize(
                            saved.fc1_out, b.d_act, probs, groups, b.dy_columns.offsets,
                            grads.dx.defined() ? b.one_pass_d_fc1_rows : Fp8Rows{}, b.one_pass_d_fc1_columns,
                            b.act_columns, grads.dprobs, b.dprobs_shares, spec.glu, recipe, ctx.stream));
        });
  if (ran && fused) *ran = Fp8GluBackwardPath::kOnePass;
  const Fp8Rows& d_fc1_rows = fused ? b.one_pass_d_fc1_rows : b.d_fc1_rows;
  const Fp8Columns& d_fc1_columns = fused ? b.one_pass_d_fc1_columns : b.d_fc1_columns;
  if (!fused) {
    const TensorView act = fc2_wgrad ? b.d_act : TensorView{};
    // CUDA, any fusion but kNone: the GLU backward reads the kept FP8 h itself, with the separate
    // steps' bytes (dprobs added in another order); kNone keeps them.
    bool rows_fused = false;
    if (spec.fusion != MlpFusion::kNone)
      ops::dispatch(
          v, [] {},
          [&] {
            MOE_CUDA_ONLY(rows_fused = cuda::fp8_glu_backward_rows(saved.fc1_out, b.d_act, probs, groups, b.h, act,
                                                                    grads.dprobs, b.dprobs_shares, spec.glu,
                                                                    ctx.stream));
          });
    if (!rows_fused) {
      dequantize_fp8(saved.fc1_out, groups, b.h, ctx);
      glu_backward(b.h, probs, b.d_act, groups, {b.h, grads.dprobs, act}, spec.glu, ctx);
    }
    if (ran) *ran = rows_fused ? Fp8GluBackwardPath::kRows : Fp8GluBackwardPath::kSeparate;
    if (fc2_wgrad) quantize_fp8(act, groups, {}, b.act_columns, recipe, ctx);
  }
  const TensorView& d_fc1 = b.h;
  // y holds + p * b2, so dprobs also gets <b2_g, dy[r]>.
  if (grads.dprobs.defined() && weights.fc2_bias.defined())
    grouped_linear_dscales(dy, weights.fc2_bias, groups, grads.dprobs, /*accumulate=*/true, ctx);
  if (fc2_wgrad)
    grouped_linear_wgrad(b.dy_columns, b.act_columns, groups, grads.fc2_weight.grad, grads.fc2_weight.mode, ctx);
  if (grads.fc2_bias.grad.defined())
    grouped_linear_dbias(dy, groups, grads.fc2_bias.grad, grads.fc2_bias.mode, probs, ctx);
  if (grads.fc1_bias.grad.defined())
    grouped_linear_dbias(d_fc1, groups, grads.fc1_bias.grad, grads.fc1_bias.mode, {}, ctx);
  if (!grads.dx.defined() && !fc1_wgrad) return;
  if (!fused)
    quantize_fp8(d_fc1, groups, grads.dx.defined() ? d_fc1_rows : Fp8Rows{}, fc1_wgrad ? d_fc1_columns : Fp8Columns{},
                 recipe, ctx);
  if (make_x_columns) {
    dequantize_fp8(saved.x_rows, groups, b.x, ctx);
    quantize_fp8(b.x, groups, {}, b.x_columns, recipe, ctx);
  }
  if (fc1_wgrad)
    grouped_linear_wgrad(d_fc1_columns, make_x_columns ? b.x_columns : saved.x, groups, grads.fc1_weight.grad,
                         grads.fc1_weight.mode, ctx);
  if (grads.dx.defined()) grouped_linear_dgrad(d_fc1_rows, weights.fc1, groups, grads.dx, ctx);
}

}  // namespace moe
