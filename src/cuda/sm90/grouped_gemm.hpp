// Host interface of the Hopper grouped GEMM kernel (sm_90a).
#pragma once

#include <string>

#include "cuda/gemm/grouped_gemm_problem.hpp"
#include "cuda/sm90/glu_params.hpp"
#include "moe_engine/device.hpp"

namespace moe::cuda::sm90 {

// Whether the kernel runs this problem on its device; if not, *why says what is missing.
bool can_run(const GroupedGemmProblem& problem, std::string* why);
void run(const GroupedGemmProblem& problem, Stream stream);

// FP8 block-scaled GEMMs (grouped_gemm_fp8.cu; the problem's FP8 fields): forward (dgrad as the
// forward over the transposed weight) and wgrad over the columns copies. fp8_device_supported:
// whether `device` runs them at all (compute capability 9.0), the first of can_run_fp8's checks.
bool fp8_device_supported(int device, std::string* why);
bool can_run_fp8(const GroupedGemmProblem& problem, std::string* why);
void run_fp8(const GroupedGemmProblem& problem, Stream stream);

// The fused expert MLP's GEMMs with a GLU epilogue (epilogue_glu.cuh): FC1's forward (the problem's
// output d is h [T, 2F], stored only if glu.store_h) or FC2's dgrad (d = d(act * p) [T, F], never
// stored). can_run_glu adds the epilogue's own needs to can_run's.
bool can_run_glu(const GroupedGemmProblem& problem, const GluEpilogueParams& glu, std::string* why);
void run_glu(const GroupedGemmProblem& problem, const GluEpilogueParams& glu, Stream stream);

}  // namespace moe::cuda::sm90
