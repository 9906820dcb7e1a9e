// Host interface of the Hopper grouped GEMM kernel (sm_90a).
#pragma once

#include <string>

#include "cuda/grouped_gemm_problem.hpp"
#include "moe_engine/device.hpp"

namespace moe::cuda::sm90 {

// Whether the kernel runs this problem on its device; if not, *why says what is missing.
bool can_run(const GroupedGemmProblem& problem, std::string* why);
void run(const GroupedGemmProblem& problem, Stream stream);

}  // namespace moe::cuda::sm90
