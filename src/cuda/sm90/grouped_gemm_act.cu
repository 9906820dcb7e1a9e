// Instantiations of the Hopper grouped GEMM with the non-gated activation epilogues (srelu,
// gelu_tanh in FC1's forward and FC2's dgrad; the activation is a uniform switch inside): a
// translation unit of its own so that it compiles beside the GLU instances (grouped_gemm_glu.cu,
// whose run_glu checks and prepares the problem).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/sm90/heuristics.hpp"
#include "cuda/sm90/launch.cuh"

namespace moe::cuda::sm90 {

void launch_elementwise(const GroupedGemmProblem& pr, const Prepared& r, Stream stream) {
  static_assert(glu_pipeline() == PipelineShape::kDeepRing, "the activation instances are built with DeepRing");
  using Pipe = DeepRing;
  const bool fp16 = pr.in_dtype == DType::kFloat16;
  if (pr.form == Form::kForward) {
    if (fp16)
      launch_detail::launch<Form::kForward, __half, __half, Epilogue::kActForward, Pipe>(pr, r, stream);
    else
      launch_detail::launch<Form::kForward, __nv_bfloat16, __nv_bfloat16, Epilogue::kActForward, Pipe>(pr, r, stream);
  } else {
    if (fp16)
      launch_detail::launch<Form::kDgrad, __half, __half, Epilogue::kActBackward, Pipe>(pr, r, stream);
    else
      launch_detail::launch<Form::kDgrad, __nv_bfloat16, __nv_bfloat16, Epilogue::kActBackward, Pipe>(pr, r, stream);
  }
}

}  // namespace moe::cuda::sm90
