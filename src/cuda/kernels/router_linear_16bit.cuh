// The router's three float32 products for 16-bit x and weight (bf16, fp16), shaped for what the
// router is: few experts (E <= 256 here) against a long hidden axis. router_linear.cu tries these
// first and falls back to its generic tiled kernel when they decline (other dtypes, more experts,
// rows or pointers not 16-byte aligned).
//
// Each output is still summed by one thread in a fixed order, one fused multiply-add per step:
// - logits(t, e) = sum_h x(t, h) W(e, h) over h in increasing order from 0, as the CPU backend
//   (products of 16-bit values are exact in float32, so the fused steps round as its separate
//   product and sum): the CPU's bits;
// - dx(t, h) = sum_e d_logits(t, e) W(e, h) over e in increasing order (then + dx when accumulating);
// - dW(e, h) = sum over token slices, in slice order, of each slice's sum in increasing t.
// The schedules fill the GPU at T ~ 10^3..10^4: logits stream x through shared memory (cp.async, a
// few stages in flight) with the weight converted to float32 once per block and stage; dgrad and
// wgrad keep 8 x 8 outputs per thread so each 16-byte load feeds 64 fused multiply-adds.
#pragma once

#include <cstdint>

#include "moe_engine/device.hpp"
#include "moe_engine/tensor.hpp"

namespace moe::cuda {

// Each returns false, having launched nothing, when its operands are not ones it takes.
bool router_logits_16bit(const TensorView& x, const TensorView& weight, const TensorView& logits, Stream stream);
bool router_dgrad_16bit(const TensorView& d_logits, const TensorView& weight, const TensorView& dx,
                        bool accumulate, Stream stream);
// With partials [S, E, H] float32 (contiguous) each of S token slices writes its sums there, for the
// caller to add in slice order; undefined partials: dweight directly (S = 1).
bool router_wgrad_16bit(const TensorView& d_logits, const TensorView& x, const TensorView& partials,
                        const TensorView& dweight, bool accumulate, Stream stream);

}  // namespace moe::cuda
