// The portable grouped GEMM (any NVIDIA GPU of compute capability 8.0+): plain CUDA, fp32
// accumulation, any alignment and strides, packed or per-expert tensors. Correct and graph safe;
// speed is secondary (the Hopper kernel is the fast path).
#pragma once

#include <string>

#include "cuda/gemm/grouped_gemm_problem.hpp"
#include "moe_engine/device.hpp"

namespace moe::cuda::portable {

bool can_run(const GroupedGemmProblem& problem, std::string* why);
void run(const GroupedGemmProblem& problem, Stream stream);

}  // namespace moe::cuda::portable
