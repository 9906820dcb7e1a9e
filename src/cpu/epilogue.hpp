// What the CPU GEMMs do with a finished tile of C (c[i * kTile + j]): the forward's bias epilogue
// and the weight gradient's modes. The 16/32-bit and the FP8 GEMMs share them.
#pragma once

#include <cstdint>

#include "cpu/tiled_gemm.hpp"
#include "moe_engine/bias_epilogue.hpp"
#include "moe_engine/grad_mode.hpp"

namespace moe::cpu {

// Writes (or accumulates) n values into a float buffer of any float dtype.
template <class Acc>
void emit_grad(const Acc* values, int64_t n, void* dst, DType dtype, GradMode mode, Acc* scratch) {
  if (mode != GradMode::kAccumulate) return store(values, n, dst, dtype);
  load(dst, dtype, n, 1, scratch);
  for (int64_t i = 0; i < n; ++i) scratch[i] += values[i];
  store(scratch, n, dst, dtype);
}

// Rows row0 .. row0 + ni - 1 of y (expert g's), columns j0 .. j0 + nj - 1: c plus b_g (times
// row_scale[r] with scale_bias), added in the accumulator type and rounded once to y's dtype.
template <class Acc>
void emit_forward_tile(const TensorView& y, const BiasEpilogue& epi, int64_t g, int64_t row0, int64_t ni,
                       int64_t j0, int64_t nj, const Acc* c) {
  const bool has_bias = epi.bias.defined();
  const bool scaled = epi.row_scale.defined();
  Acc bias[kTile], out[kTile];
  if (has_bias) load(element_ptr_1d(epi.bias.expert(g), j0), epi.bias.dtype(), nj, 1, bias);
  for (int64_t i = 0; i < ni; ++i) {
    const int64_t r = row0 + i;
    const Acc s = scaled ? load_at<Acc>(epi.row_scale, r) : Acc(1);
    for (int64_t j = 0; j < nj; ++j)
      out[j] = c[i * kTile + j] + (has_bias ? (scaled ? s * bias[j] : bias[j]) : Acc(0));
    store(out, nj, element_ptr(y, r, j0), y.dtype());
  }
}

// Rows i0 .. i0 + ni - 1, columns j0 .. j0 + nj - 1 of expert g's weight gradient, per `mode`.
// An expert without tokens contributes nothing: accumulate leaves main_grad untouched bit for bit.
template <class Acc>
void emit_wgrad_tile(const GroupedParam& dweight, GradMode mode, int64_t g, bool expert_is_empty, int64_t i0,
                     int64_t ni, int64_t j0, int64_t nj, const Acc* c) {
  if (mode == GradMode::kAccumulate && expert_is_empty) return;
  const TensorView dw = dweight.expert(g);
  Acc scratch[kTile];
  for (int64_t i = 0; i < ni; ++i)
    emit_grad(c + i * kTile, nj, element_ptr(dw, i0 + i, j0), dw.dtype(), mode, scratch);
}

}  // namespace moe::cpu
