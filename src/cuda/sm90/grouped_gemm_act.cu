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
  launch_detail::launch_activation<Epilogue::kActForward, Epilogue::kActBackward>(pr, r, stream);
}

}  // namespace moe::cuda::sm90
