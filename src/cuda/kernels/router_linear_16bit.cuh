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
// The schedules: logits stream x and the weight through shared memory (cp.async, a few stages in
// flight), a thread summing several tokens x several experts so each unpacked value feeds several
// sums; dgrad keeps 8 tokens x 8 columns per thread, wgrad 8 experts x 8 columns of a token slice.
// The logits schedule comes from the shapes only (logits_config), never from timing.
#pragma once

#include <cstdint>
#include <optional>

#include "moe_engine/device.hpp"
#include "moe_engine/tensor.hpp"

namespace moe::cuda {

// The logits kernel's outputs per thread: experts_per_thread x tokens_per_thread, one of 8 x 4, 2 x 2,
// 2 x 1 (the ones built).
struct LogitsConfig {
  int experts_per_thread, tokens_per_thread;
};
LogitsConfig logits_config(int64_t tokens, int64_t experts);

// Each returns false, having launched nothing, when its operands are not ones it takes. config
// overrides the logits schedule chosen from the shapes (bench/experiments/router_schedules.cu).
bool router_logits_16bit(const TensorView& x, const TensorView& weight, const TensorView& logits, Stream stream,
                         std::optional<LogitsConfig> config = std::nullopt);
bool router_dgrad_16bit(const TensorView& d_logits, const TensorView& weight, const TensorView& dx,
                        bool accumulate, Stream stream);
// With partials [S, E, H] float32 (contiguous) each of S token slices writes its sums there, for the
// caller to add in slice order; undefined partials: dweight directly (S = 1).
bool router_wgrad_16bit(const TensorView& d_logits, const TensorView& x, const TensorView& partials,
                        const TensorView& dweight, bool accumulate, Stream stream);

}  // namespace moe::cuda
