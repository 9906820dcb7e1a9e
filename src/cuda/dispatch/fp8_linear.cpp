// FP8 grouped GEMMs on CUDA: placeholder until the Hopper FP8 kernel lands (this file is replaced).
#include "cuda/backend.hpp"
#include "moe_engine/error.hpp"

namespace moe::cuda {

void grouped_linear_forward(const Fp8Rows&, const Fp8Weight&, const GroupLayout&, const TensorView&,
                            const BiasEpilogue&, Stream) {
  throw_error(ErrorCode::kNotImplemented, "grouped_linear_forward: the FP8 Hopper kernel is not built yet");
}
void grouped_linear_dgrad(const Fp8Rows&, const Fp8Weight&, const GroupLayout&, const TensorView&, Stream) {
  throw_error(ErrorCode::kNotImplemented, "grouped_linear_dgrad: the FP8 Hopper kernel is not built yet");
}
void grouped_linear_wgrad(const Fp8Columns&, const Fp8Columns&, const GroupLayout&, const GroupedParam&, GradMode,
                          Stream) {
  throw_error(ErrorCode::kNotImplemented, "grouped_linear_wgrad: the FP8 Hopper kernel is not built yet");
}

}  // namespace moe::cuda
