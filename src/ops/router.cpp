// The router ops (moe_engine/router.hpp): validation, the workspace layout, then dispatch by
// device.
#include "moe_engine/router.hpp"

#include <algorithm>
#include <cmath>

#include "common/router_math.hpp"
#include "common/router_scratch.hpp"
#include "cpu/backend.hpp"
#include "moe_engine/config.hpp"
#if MOE_ENGINE_WITH_CUDA
#include "cuda/backend.hpp"
#endif
#include "ops/validate.hpp"

namespace moe {
namespace {

using detail::RouterBackwardScratch;
using detail::RouterForwardScratch;

// The router's float type: float32, or float64 for float64 inputs (CPU backend).
DType acc_dtype(DType x) { return x == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

// The CUDA forward's partial sums, one row per 64 tokens (kernels/router.cu), and the logits GEMM's
// one-group offsets {0, T} (on Hopper the logits run on the grouped GEMM).
RouterForwardScratch forward_scratch(ops::WorkspaceCarver& c, int64_t tokens, int64_t num_experts) {
  const int64_t chunks = (tokens + detail::kRouterChunkTokens - 1) / detail::kRouterChunkTokens;
  if (chunks == 0) return {};
  return {c.take({chunks, num_experts}, DType::kFloat32),
          c.take({chunks, num_experts}, DType::kInt32),
          c.take({chunks, num_experts}, DType::kInt32), c.take({chunks}, DType::kFloat32),
          c.take({2}, DType::kInt64)};
}

// The SIMT weight gradient's contraction over the T tokens runs in this many slices, each into its
// own float32 partial sums, added in slice order: its E x H outputs are few (a thread of the 16-bit
// kernel owns 8 x 8 of them, so 1024 columns x 8 experts per block: 4 to 32 blocks at the suite's
// shapes), and one slice would leave most of the GPU idle. About eight blocks per SM of an
// H100/H200, slices of at least 64 tokens, at most 32 MiB of partial sums (at the suite's shapes the
// fastest of 1-32 slices or within 10% of it, the partial sums' addition included:
// bench/experiments/router_schedules.cu).
int64_t wgrad_slices(int64_t tokens, int64_t num_experts, int64_t hidden) {
  const int64_t blocks = std::max<int64_t>(1, (hidden + 1023) / 1024) * ((num_experts + 7) / 8);
  const int64_t by_bytes = (int64_t(32) << 20) / std::max<int64_t>(1, num_experts * hidden * 4);
  return std::clamp<int64_t>(std::min({(1056 + blocks - 1) / blocks, tokens / 64, by_bytes}), 1, 32);
}

// The grouped GEMM's weight gradient: [3E, H] outputs a slice in 128 x 128 tiles, and a slice's
// tiles run the whole slice's tokens. Enough slices for two tiles per SM of an H100/H200 (264),
// slices of at least 256 tokens, at most 32 MiB of partial sums (but one slice always).
int64_t gemm_wgrad_slices(int64_t tokens, int64_t num_experts, int64_t hidden) {
  const int64_t rows = 3 * num_experts;
  const int64_t tiles = ((rows + 127) / 128) * ((hidden + 127) / 128);
  const int64_t by_bytes = (int64_t(32) << 20) / std::max<int64_t>(1, rows * hidden * 4);
  return std::clamp<int64_t>(std::min({(264 + tiles - 1) / tiles, tokens / 256, by_bytes}), 1, 32);
}

// The grouped GEMM takes the backward's products of bfloat16 x whose rows TMA can read.
bool gemm_backward_possible(int64_t hidden, DType dtype) {
  return dtype == DType::kBFloat16 && hidden > 0 && hidden % 8 == 0;
}

RouterBackwardScratch backward_scratch(ops::WorkspaceCarver& c, int64_t tokens, int64_t num_experts,
                                       int64_t hidden, DType dtype) {
  RouterBackwardScratch s;
  if (tokens == 0) return s;
  s.d_logits = c.take({tokens, num_experts}, acc_dtype(dtype));
  const size_t shared = c.mark();
  if (const int64_t slices = wgrad_slices(tokens, num_experts, hidden); slices > 1)
    s.wgrad_partials = c.take({slices, num_experts, hidden}, DType::kFloat32);
  if (!gemm_backward_possible(hidden, dtype)) return s;
  c.rewind(shared);
  const int64_t rows = 3 * num_experts, split_ld = (rows + 7) / 8 * 8;
  const TensorView split = c.take({tokens, split_ld}, DType::kBFloat16);
  if (split.defined())
    s.d_split = TensorView(split.data(), {tokens, rows}, {split_ld, 1}, DType::kBFloat16, split.device());
  s.weight_stack = c.take({rows, hidden}, DType::kBFloat16);
  const int64_t slices = gemm_wgrad_slices(tokens, num_experts, hidden);
  s.gemm_partials = c.take({slices, rows, hidden}, DType::kFloat32);
  s.gemm_offsets = c.take({slices + 3}, DType::kInt64);
  return s;
}

void check_sizes(const char* who, int64_t tokens, int64_t num_experts) {
  MOE_CHECK(tokens >= 0 && num_experts >= 1, ErrorCode::kInvalidArgument, who,
            ": expected tokens >= 0 and num_experts >= 1, got ", tokens, " and ", num_experts);
}

// x [T, H] and weight [E, H] in x's dtype, and the spec for E experts; returns {T, H, E}.
struct Dims {
  int64_t tokens, hidden, experts;
};
Dims check_inputs(const ops::Validator& v, const TensorView& x, const TensorView& weight,
                  const RouterSpec& spec, const char* op) {
  v.matrix("x", x, -1, -1, "[T, H]");
  v.matrix("weight", weight, -1, x.size(1), "[E, H]");
  v.same_dtype("weight", weight.dtype(), "x", x.dtype());
  check_router_spec(spec, weight.size(0), op);
  return {x.size(0), x.size(1), weight.size(0)};
}

// A float tensor of the router's float type, after its shape was checked.
void check_matrix(const ops::Validator& v, const char* name, const TensorView& t, int64_t rows,
                  int64_t cols, const char* dims, DType acc) {
  v.matrix(name, t, rows, cols, dims);
  v.dtype_is(name, t, acc);
}

}  // namespace

size_t router_forward_workspace_size(int64_t tokens, int64_t num_experts) {
  check_sizes("router_forward_workspace_size", tokens, num_experts);
  ops::WorkspaceCarver sizes;
  forward_scratch(sizes, tokens, num_experts);
  return sizes.used();
}

size_t router_backward_workspace_size(int64_t tokens, int64_t num_experts, int64_t hidden, DType dtype) {
  check_sizes("router_backward_workspace_size", tokens, num_experts);
  MOE_CHECK(hidden >= 0, ErrorCode::kInvalidArgument, "router_backward_workspace_size: expected hidden >= 0, got ",
            hidden);
  ops::WorkspaceCarver sizes;
  backward_scratch(sizes, tokens, num_experts, hidden, dtype);
  return sizes.used();
}

void router_forward(const TensorView& x, const TensorView& weight, const TensorView& expert_bias,
                    const RouterOutputs& out, const RouterSpec& spec,
                    [[maybe_unused]] const ExecContext& ctx) {
  if (!x.defined())
    throw_error(ErrorCode::kInvalidArgument,
                "router_forward: x: required tensor [T, H] is undefined");
  const ops::Validator v("router_forward", x.device(), /*num_groups (no per-expert parameters)=*/0,
                         "x's device");
  const auto [T, H, E] = check_inputs(v, x, weight, spec, "router_forward");
  const int64_t k = spec.topk;
  const DType acc = acc_dtype(x.dtype());
  if (expert_bias.defined()) {
    v.vector("expert_bias", expert_bias, E, "[E]");
    v.dtype_is("expert_bias", expert_bias, acc);
  }
  check_matrix(v, "out.logits", out.logits, T, E, "[T, E]", acc);
  v.index_matrix("out.indices", out.indices, T, k, "[T, k]");
  check_matrix(v, "out.probs", out.probs, T, k, "[T, k]", acc);
  v.int64_vector("out.counts", out.counts, E, "[E]");
  ops::check_pair(v, "out.aux_loss", out.aux_loss, "out.aux_loss_counts", out.aux_loss_counts);
  if (out.aux_loss.defined()) {
    v.scalar("out.aux_loss", out.aux_loss, acc);
    v.int64_vector("out.aux_loss_counts", out.aux_loss_counts, E, "[E]");
  }
  if (out.z_loss.defined()) v.scalar("out.z_loss", out.z_loss, acc);
  if (out.counts_total.defined()) v.int64_vector("out.counts_total", out.counts_total, E, "[E]");
  if (out.total_loss.defined()) v.scalar("out.total_loss", out.total_loss, acc);
  const ops::NamedTensor outputs[] = {
      {"out.logits", out.logits},     {"out.indices", out.indices},
      {"out.probs", out.probs},       {"out.counts", out.counts},
      {"out.aux_loss", out.aux_loss}, {"out.aux_loss_counts", out.aux_loss_counts},
      {"out.z_loss", out.z_loss},     {"out.counts_total", out.counts_total},
      {"out.total_loss", out.total_loss}};
  ops::check_outputs(v, outputs, {{"x", x}, {"weight", weight}, {"expert_bias", expert_bias}});
  v.workspace(ctx.workspace, router_forward_workspace_size(T, E), "router_forward_workspace_size");
  ops::dispatch(
      v, [&] { cpu::router_forward(x, weight, expert_bias, out, spec); },
      [&] {
        MOE_CUDA_ONLY({
          ops::WorkspaceCarver carver(ctx.workspace);
          cuda::router_forward(x, weight, expert_bias, out, spec, forward_scratch(carver, T, E), ctx.stream);
        });
      });
}

void router_backward(const RouterOutputGrads& d_out, const TensorView& x, const TensorView& weight,
                     const TensorView& logits, const TensorView& indices,
                     const TensorView& aux_loss_counts, const RouterGrads& grads,
                     const RouterSpec& spec, [[maybe_unused]] const ExecContext& ctx) {
  if (!x.defined())
    throw_error(ErrorCode::kInvalidArgument,
                "router_backward: x: required tensor [T, H] is undefined");
  const ops::Validator v("router_backward", x.device(), /*num_groups (no per-expert parameters)=*/0,
                         "x's device");
  const auto [T, H, E] = check_inputs(v, x, weight, spec, "router_backward");
  const int64_t k = spec.topk;
  const DType acc = acc_dtype(x.dtype());
  check_matrix(v, "logits", logits, T, E, "[T, E]", acc);
  v.index_matrix("indices", indices, T, k, "[T, k]");
  if (d_out.d_probs.defined()) check_matrix(v, "d_out.d_probs", d_out.d_probs, T, k, "[T, k]", acc);
  if (d_out.d_aux_loss.defined()) {
    v.scalar("d_out.d_aux_loss", d_out.d_aux_loss, acc);
    if (!aux_loss_counts.defined())
      v.fail(ErrorCode::kInvalidArgument,
             "aux_loss_counts: required with d_out.d_aux_loss (router_forward's "
             "out.aux_loss_counts), got an "
             "undefined tensor");
    v.int64_vector("aux_loss_counts", aux_loss_counts, E, "[E]");
  }
  if (d_out.d_z_loss.defined()) v.scalar("d_out.d_z_loss", d_out.d_z_loss, acc);
  if (!grads.dx.defined() && !grads.dweight.defined())
    v.fail(ErrorCode::kInvalidArgument,
           "neither grads.dx nor grads.dweight is requested: the call would do nothing");
  if (grads.dx.defined()) {
    v.matrix("grads.dx", grads.dx, T, H, "[T, H]");
    v.same_dtype("grads.dx", grads.dx.dtype(), "x", x.dtype());
  }
  if (grads.dweight.defined()) {
    v.matrix("grads.dweight", grads.dweight, E, H, "[E, H]");
    v.grad_target("grads.dweight", grads.dweight, grads.dweight_mode);
  }
  const ops::NamedTensor outputs[] = {{"grads.dx", grads.dx}, {"grads.dweight", grads.dweight}};
  ops::check_outputs(v, outputs,
                     {{"x", x},
                      {"weight", weight},
                      {"logits", logits},
                      {"indices", indices},
                      {"aux_loss_counts", aux_loss_counts},
                      {"d_out.d_probs", d_out.d_probs},
                      {"d_out.d_aux_loss", d_out.d_aux_loss},
                      {"d_out.d_z_loss", d_out.d_z_loss}});
  v.workspace(ctx.workspace, router_backward_workspace_size(T, E, x.size(1), x.dtype()),
              "router_backward_workspace_size");
  ops::WorkspaceCarver carver(ctx.workspace);
  const RouterBackwardScratch scratch = backward_scratch(carver, T, E, H, x.dtype());
  ops::dispatch(
      v,
      [&] {
        cpu::router_backward(d_out, x, weight, logits, indices, aux_loss_counts, grads, spec,
                             scratch.d_logits);
      },
      [&] {
        MOE_CUDA_ONLY(cuda::router_backward(d_out, x, weight, logits, indices, aux_loss_counts,
                                            grads, spec, scratch, ctx.stream));
      });
}

void router_update_expert_bias(const TensorView& expert_bias, const TensorView& counts, float rate,
                               [[maybe_unused]] const ExecContext& ctx) {
  constexpr const char* kOp = "router_update_expert_bias";
  if (!expert_bias.defined())
    throw_error(ErrorCode::kInvalidArgument, kOp,
                ": expert_bias: required tensor [E] is undefined");
  const ops::Validator v(kOp, expert_bias.device(), /*num_groups (no per-expert parameters)=*/0,
                         "expert_bias's device");
  if (expert_bias.dim() != 1)
    v.fail(ErrorCode::kShape, "expert_bias: expected a 1-D [E] tensor, got ",
           expert_bias.describe());
  const int64_t E = expert_bias.size(0);
  v.vector("expert_bias", expert_bias, E, "[E]");
  const bool f64_on_cpu = expert_bias.device().is_cpu() && expert_bias.dtype() == DType::kFloat64;
  if (expert_bias.dtype() != DType::kFloat32 && !f64_on_cpu)
    v.fail(ErrorCode::kDType, "expert_bias: expected float32",
           expert_bias.device().is_cpu() ? " (or float64)" : "", ", got ",
           dtype_name(expert_bias.dtype()));
  v.int64_vector("counts", counts, E, "[E]");
  if (!std::isfinite(rate) || rate < 0)
    v.fail(ErrorCode::kInvalidArgument, "rate: expected a finite value >= 0 (a negative rate moves the bias against "
           "the balance), got ", rate);
  v.no_overlap("expert_bias", expert_bias, "counts", counts);
  ops::dispatch(
      v, [&] { cpu::router_update_expert_bias(expert_bias, counts, rate); },
      [&] {
        MOE_CUDA_ONLY(cuda::router_update_expert_bias(expert_bias, counts, rate, ctx.stream));
      });
}

}  // namespace moe
