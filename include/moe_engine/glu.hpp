// The expert MLP's activation step (docs/design.md section 3) over FC1's output h, scaled per row by
// the router prob: a GLU maps h [T, 2F] (F "gate" and F "linear" columns in one of three column
// layouts) to [T, F]; a non-gated activation (srelu, gelu_tanh) maps h [T, F] elementwise.
#pragma once

#include "moe_engine/export.hpp"
#include "moe_engine/glu_spec.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

namespace moe {

// out[r, j] = act(gate_j(h[r]), linear_j(h[r])) * p[r] (gated), or f(h[r, j]) * p[r] (non-gated),
// for rows r < offsets[G]. h [T, fc1_width(spec, F)]; probs [T] float32 (undefined: p = 1); out [T, F].
MOE_API void glu_forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
                         const TensorView& out, const GluSpec& spec, const ExecContext& ctx = {});

// From d_out = dL/d(out): dh and, optionally, dprobs and the recomputed out. In place is allowed:
// dh may be h itself and out may be d_out itself (each element is read before it is written);
// any other overlap between outputs and inputs is an error.
// clamped_qgeglu's gradient w.r.t. gate is 0 where gate > limit, w.r.t. linear where |linear| > limit.
MOE_API void glu_backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
                          const GroupLayout& groups, const GluBackwardOutputs& outputs,
                          const GluSpec& spec, const ExecContext& ctx = {});

}  // namespace moe
