// The fused expert MLP's activation GEMMs: the grouped GEMM problems of FC1's forward and FC2's
// dgrad, run on the Hopper kernel with the activation epilogues (GLU or non-gated) when it can take
// them.
#include <algorithm>

#include "cuda/backend.hpp"
#include "cuda/gemm/grouped_gemm_problem.hpp"
#include "cuda/sm90/grouped_gemm.hpp"

namespace moe::cuda {

namespace {

sm90::GluEpilogueParams epilogue_for(const GluSpec& spec, int64_t ffn, const TensorView& probs) {
  sm90::GluEpilogueParams g;
  g.math = detail::GluMath<float>::from(spec);
  g.activation = spec.activation;
  g.probs = probs.defined() ? probs.data_as<float>() : nullptr;
  g.block = spec.gated() ? int32_t(std::min<int64_t>(spec.layout.block_size(ffn), int64_t(1) << 30)) : 1;
  while ((int64_t(1) << (g.block_shift + 1)) <= g.block) ++g.block_shift;
  return g;
}

}  // namespace

bool expert_mlp_fc1_glu(const TensorView& x, const GroupedParam& fc1_weight, const GroupedParam& fc1_bias,
                        const GroupLayout& groups,
                        const TensorView& probs, const GluSpec& spec, const TensorView& h,
                        const TensorView& act, Stream stream) {
  const char* op = "expert_mlp_forward";
  const int64_t F = act.size(1), width = fc1_width(spec, F);
  GroupedGemmProblem p = problem_for(Form::kForward, groups, x.dtype(), x.dtype());
  p.a = x.data();
  p.a_row_stride = x.stride(0);
  p.b = expert_address(op, "fc1_weight", fc1_weight);
  p.b_row_stride = fc1_weight.expert_shape()[1];
  // Without h the output map is never used for stores; it is encoded over act's memory.
  p.d = {h.defined() ? h.data() : act.data(), 0, nullptr};
  p.d_row_stride = h.defined() ? h.stride(0) : width;
  p.n = width;
  p.k = x.size(1);
  p.bias = expert_address(op, "fc1_bias", fc1_bias);
  if (fc1_bias.defined()) p.bias_dtype = fc1_bias.dtype();
  sm90::GluEpilogueParams g = epilogue_for(spec, F, probs);
  g.act = act.data();
  g.act_stride = act.stride(0);
  g.store_h = h.defined();
  if (!sm90::can_run_glu(p, g, nullptr)) return false;
  sm90::run_glu(p, g, stream);
  return true;
}

bool expert_mlp_fc2_dgrad_glu(const TensorView& dy, const GroupedParam& fc2_weight, const GroupLayout& groups,
                              const TensorView& h, const TensorView& probs, const GluSpec& spec,
                              const TensorView& dh, const TensorView& act, const TensorView& dprobs,
                              const TensorView& scratch, Stream stream) {
  const char* op = "expert_mlp_backward";
  const int64_t F = spec.gated() ? dh.size(1) / 2 : dh.size(1), T = groups.capacity();
  const int64_t tiles = (F + 255) / 256;
  if (dprobs.defined() && scratch.numel() * int64_t(dtype_size(scratch.dtype())) < T * tiles * 4) return false;
  GroupedGemmProblem p = problem_for(Form::kDgrad, groups, dy.dtype(), dy.dtype());
  p.a = dy.data();
  p.a_row_stride = dy.stride(0);
  p.b = expert_address(op, "fc2_weight", fc2_weight);
  p.b_row_stride = fc2_weight.expert_shape()[1];
  p.d = {dh.data(), 0, nullptr};  // the output map is never used for stores
  p.d_row_stride = dh.stride(0);
  p.n = dy.size(1);
  p.k = F;
  sm90::GluEpilogueParams g = epilogue_for(spec, F, probs);
  g.h = h.data();
  g.h_stride = h.stride(0);
  g.dh = dh.data();
  g.dh_stride = dh.stride(0);
  g.act = act.defined() ? act.data() : nullptr;
  g.act_stride = act.defined() ? act.stride(0) : 0;
  g.dprobs_partial = dprobs.defined() ? static_cast<float*>(scratch.data()) : nullptr;
  g.partial_stride = int32_t(tiles);
  if (!sm90::can_run_glu(p, g, nullptr)) return false;
  sm90::run_glu(p, g, stream);
  if (dprobs.defined()) glu_dprobs_reduce(g.dprobs_partial, tiles, tiles, groups, dprobs, stream);
  return true;
}

}  // namespace moe::cuda
