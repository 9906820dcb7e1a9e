// The activation ops (GLUs and non-gated activations): validation, then dispatch by device.
#include "moe_engine/glu.hpp"

#include "cpu/backend.hpp"
#include "moe_engine/config.hpp"
#if MOE_ENGINE_WITH_CUDA
#include "cuda/backend.hpp"
#endif
#include "ops/validate.hpp"

namespace moe {

void glu_forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
                 const TensorView& out, const GluSpec& spec, [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("glu_forward", groups);
  v.matrix("h", h, v.capacity(), -1, "[T, W]");  // first: out is often made like h
  v.matrix("out", out, v.capacity(), -1, "[T, F]");
  const int64_t F = out.size(1);
  v.glu_spec(spec, F);
  const ops::Fc1Dims fc1 = ops::fc1_dims(spec, F);
  v.matrix("h", h, v.capacity(), fc1.width, fc1.rows);
  v.same_dtype("out", out.dtype(), "h", h.dtype());
  if (probs.defined()) v.row_scale("probs", probs);
  v.no_overlap("out", out, "h", h);
  ops::dispatch(
      v, [&] { cpu::glu_forward(h, probs, groups, out, spec); },
      [&] { MOE_CUDA_ONLY(cuda::glu_forward(h, probs, groups, out, spec, ctx.stream)); });
}

void glu_backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
                  const GroupLayout& groups, const GluBackwardOutputs& outputs, const GluSpec& spec,
                  [[maybe_unused]] const ExecContext& ctx) {
  const ops::Validator v("glu_backward", groups);
  v.matrix("d_out", d_out, v.capacity(), -1, "[T, F]");
  const int64_t F = d_out.size(1);
  v.glu_spec(spec, F);
  const ops::Fc1Dims fc1 = ops::fc1_dims(spec, F);
  v.matrix("h", h, v.capacity(), fc1.width, fc1.rows);
  v.same_dtype("d_out", d_out.dtype(), "h", h.dtype());
  v.matrix("dh", outputs.dh, v.capacity(), fc1.width, fc1.rows);
  v.same_dtype("dh", outputs.dh.dtype(), "h", h.dtype());
  if (probs.defined()) v.row_scale("probs", probs);
  if (outputs.dprobs.defined()) {
    if (!probs.defined())
      v.fail(ErrorCode::kInvalidArgument, "dprobs is requested but no probs were given");
    v.row_scale("dprobs", outputs.dprobs);
  }
  if (outputs.out.defined()) {
    v.matrix("out", outputs.out, v.capacity(), F, "[T, F]");
    v.same_dtype("out", outputs.out.dtype(), "h", h.dtype());
  }
  v.in_place_or_separate("dh", outputs.dh, "h", h);
  v.no_overlap("dh", outputs.dh, "d_out", d_out);
  if (outputs.out.defined()) {
    v.in_place_or_separate("out", outputs.out, "d_out", d_out);
    v.no_overlap("out", outputs.out, "h", h);
    v.no_overlap("out", outputs.out, "dh", outputs.dh);
  }
  ops::dispatch(
      v, [&] { cpu::glu_backward(h, probs, d_out, groups, outputs, spec); },
      [&] { MOE_CUDA_ONLY(cuda::glu_backward(h, probs, d_out, groups, outputs, spec, ctx.stream)); });
}

}  // namespace moe
