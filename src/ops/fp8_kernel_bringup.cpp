// Temporary: the FP8 GEMM ops straight to the CUDA backend, without validation, until src/ops/fp8.cpp
// (validation, CPU backend) lands. Not part of any release.
#include "moe_engine/config.hpp"
#include "moe_engine/error.hpp"
#include "moe_engine/fp8.hpp"
#if MOE_ENGINE_WITH_CUDA
#include "cuda/backend.hpp"
#endif

namespace moe {

int64_t fp8_columns_capacity(int64_t capacity, int64_t num_groups) {
  return (capacity + 127 * num_groups + 127) / 128 * 128;
}
int64_t fp8_scales_pitch(int64_t capacity) { return capacity < 4 ? 4 : (capacity + 3) / 4 * 4; }

#if MOE_ENGINE_WITH_CUDA
void grouped_linear_forward(const Fp8Rows& x, const Fp8Weight& weight, const GroupLayout& groups, const TensorView& y,
                            const BiasEpilogue& bias, const ExecContext& ctx) {
  cuda::grouped_linear_forward(x, weight, groups, y, bias, ctx.stream);
}
void grouped_linear_dgrad(const Fp8Rows& dy, const Fp8Weight& weight, const GroupLayout& groups, const TensorView& dx,
                          const ExecContext& ctx) {
  cuda::grouped_linear_dgrad(dy, weight, groups, dx, ctx.stream);
}
void grouped_linear_wgrad(const Fp8Columns& dy, const Fp8Columns& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode, const ExecContext& ctx) {
  cuda::grouped_linear_wgrad(dy, x, groups, dweight, mode, ctx.stream);
}
#endif

}  // namespace moe
