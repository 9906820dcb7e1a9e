// Launcher and instantiations of the Hopper grouped GEMM with GLU epilogues (the fused expert
// MLP): a translation unit of its own so that it compiles beside the plain instances. The
// non-gated activations' instances are in grouped_gemm_act.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "cuda/sm90/grouped_gemm.hpp"
#include "cuda/sm90/heuristics.hpp"
#include "cuda/sm90/launch.cuh"
#include "cuda/sm90/tensor_maps.hpp"

namespace moe::cuda::sm90 {
bool can_run_glu(const GroupedGemmProblem& p, const GluEpilogueParams& g, std::string* why) {
  auto no = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  if (!can_run(p, why)) return false;
  if (p.out_dtype != p.in_dtype) return no("the activation epilogues write the input dtype");
  if (!is_gated(g.activation)) {  // non-gated: one column per feature, no layout
    if (p.form == Form::kForward) {
      if (p.row_scale != nullptr) return no("FC1 has no scaled bias");
      if (g.act == nullptr || !is_aligned(g.act, 16) || (g.act_stride * 2) % 16)
        return no("act must be 16-byte aligned rows");
      return true;
    }
    if (p.form == Form::kDgrad) {
      if (!is_aligned(g.h, 16) || (g.h_stride * 2) % 16) return no("h must be 16-byte aligned rows");
      if (!is_aligned(g.dh, 4) || g.dh_stride % 2) return no("dh must be 4-byte aligned rows");
      if (g.act != nullptr && (!is_aligned(g.act, 4) || g.act_stride % 2)) return no("act must be 4-byte aligned rows");
      return true;
    }
    return no("activation epilogues exist for FC1's forward and FC2's dgrad only");
  }
  const int32_t s = g.block;
  if (p.form == Form::kForward) {
    if (!(s == 1 || s == 8 || s == 16 || s == 32 || s == 64 || s == 128))
      return no("the fused FC1 epilogue needs the GLU layout pairs or blocks:s with s in 8..128 a power of two");
    if (p.row_scale != nullptr) return no("FC1 has no scaled bias");
    // act goes out by TMA: 16-byte aligned rows (F a multiple of 8 for a contiguous act).
    if (g.act == nullptr || !is_aligned(g.act, 16) || (g.act_stride * 2) % 16)
      return no("act must be 16-byte aligned rows");
    return true;
  }
  if (p.form == Form::kDgrad) {
    if (s < 1 || (s & (s - 1)) != 0)
      return no("the fused dGLU epilogue needs the GLU layout pairs or blocks of a power-of-two size");
    if (!is_aligned(g.h, 16) || (g.h_stride * 2) % 16) return no("h must be 16-byte aligned rows");
    if (!is_aligned(g.dh, 8) || g.dh_stride % 4) return no("dh must be 8-byte aligned rows");
    if (g.act != nullptr && (!is_aligned(g.act, 4) || g.act_stride % 2)) return no("act must be 4-byte aligned rows");
    return true;
  }
  return no("activation epilogues exist for FC1's forward and FC2's dgrad only");
}

void run_glu(const GroupedGemmProblem& pr, const GluEpilogueParams& glu, Stream stream) {
  std::string why;
  MOE_CHECK(can_run_glu(pr, glu, &why), ErrorCode::kInternal,
            "sm90 GLU GEMM called for a problem it cannot run: ", why);
  Prepared r = prepare(pr, activation_pipeline(pr.form, pr.capacity, pr.num_groups), stream);
  r.params.glu = glu;
  const bool gated = is_gated(glu.activation);
  if (pr.form == Form::kForward)  // act [T, F]: 64-row x 64-feature boxes, clipped at each group's end
    r.e = make_ragged_tensor_map(glu.act, pr.in_dtype, gated ? pr.n / 2 : pr.n, glu.act_stride, 64, 64);
  if (!gated) return launch_elementwise(pr, r, stream);
  launch_detail::launch_activation<Epilogue::kGluForward, Epilogue::kGluBackward>(pr, r, stream);
}

}  // namespace moe::cuda::sm90
