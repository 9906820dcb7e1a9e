// The CUDA backend. Inputs arrive validated by src/ops (device, shapes, dtypes); these functions
// check what their kernels additionally need (alignment, packed weights, ...) and raise
// kNotImplemented, saying why, for what no kernel covers yet. Everything is enqueued on `stream`:
// no host sync, no allocation, fixed launch shapes (CUDA-graph safe).
#pragma once

#include <cstdint>
#include <string>

#include "common/router_scratch.hpp"
#include "moe_engine/bias_epilogue.hpp"
#include "moe_engine/fp8.hpp"
#include "moe_engine/glu_spec.hpp"
#include "moe_engine/grad_mode.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/router_spec.hpp"
#include "moe_engine/tensor.hpp"

namespace moe::cuda {

// offsets[g] = min(sum_{h<g} max(splits[h], 0), capacity) for g = 0..G; reports negative splits
// and sum > capacity in *record. One block, fixed shape: graph safe for any G.
void launch_group_offsets(const void* splits, bool splits_are_int32, int64_t num_groups,
                          int64_t capacity, int64_t* offsets, DeviceErrorRecord* record,
                          Stream stream);

// Up to kMaxTargets buffers of one routing whose rows past the routed ones are zeroed together.
struct ZeroTailTargets {
  static constexpr int kMaxTargets = 8;
  uint8_t* data[kMaxTargets] = {};
  int64_t rows[kMaxTargets] = {};
  int64_t row_bytes[kMaxTargets] = {};
  int count = 0;
};

// Zeroes bytes [offsets[G] * row_bytes, rows * row_bytes) of every target (rows past the routed
// ones) in one launch. Fixed grid; row_bytes need not be a multiple of anything.
void launch_zero_unrouted_rows(const ZeroTailTargets& targets, const int64_t* end_offset, Stream stream);

void grouped_linear_forward(const TensorView& x, const GroupedParam& weight,
                            const GroupLayout& groups, const TensorView& y,
                            const BiasEpilogue& bias, Stream stream);
void grouped_linear_dgrad(const TensorView& dy, const GroupedParam& weight,
                          const GroupLayout& groups, const TensorView& dx, Stream stream);
void grouped_linear_wgrad(const TensorView& dy, const TensorView& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode, Stream stream);
void grouped_linear_dbias(const TensorView& dy, const GroupLayout& groups,
                          const GroupedParam& dbias, GradMode mode, const TensorView& row_scale,
                          Stream stream);
void grouped_linear_dscales(const TensorView& dy, const GroupedParam& bias,
                            const GroupLayout& groups, const TensorView& dscales, bool accumulate,
                            Stream stream);


void glu_forward(const TensorView& h, const TensorView& probs, const GroupLayout& groups,
                 const TensorView& out, const GluSpec& spec, Stream stream);
void glu_backward(const TensorView& h, const TensorView& probs, const TensorView& d_out,
                  const GroupLayout& groups, const GluBackwardOutputs& outputs, const GluSpec& spec,
                  Stream stream);

// dprobs[r] = sum over t < tiles of partial[r, t] (row stride `stride`), for rows < offsets[G].
void glu_dprobs_reduce(const float* partial, int64_t stride, int64_t tiles, const GroupLayout& groups,
                       const TensorView& dprobs, Stream stream);

// Permute and unpermute (kernels/permute.cu; docs/design.md section 14): the CPU backend's
// functions, with the same bits. Bad routing values cannot throw on the device: an index outside
// [0, E) is dropped (row -1) and a row_of entry neither -1 nor below offsets[G] is skipped, both
// reported in the error record (the plan's `record`, the permute ops' groups.error_record());
// nothing is read or written out of bounds. Fixed grids from T, k and E.
//   Scratch from the workspace: chunk_counts [E, detail::plan_chunks(T k)] and expert_rows [E], int32.
void permute_plan(const TensorView& indices, int64_t expert_capacity, const TensorView& row_of,
                  const TensorView& splits, const TensorView& dropped, const TensorView& chunk_counts,
                  const TensorView& expert_rows, DeviceErrorRecord* record, Stream stream);
void permute(const TensorView& x, const TensorView& probs, const TensorView& row_of, const GroupLayout& groups,
             const TensorView& x_sorted, const TensorView& probs_sorted, Stream stream);
// The expert-parallel send plan (moe_engine/permute.hpp send_plan): one block per destination scans
// the assignments in token order; an index outside [0, P L) is not sent and reported in `record`.
void send_plan(const TensorView& indices, const TensorView& row_of_expert, int64_t local_experts, int64_t capacity,
               const TensorView& row_send, const TensorView& ids, const TensorView& splits, const TensorView& dropped,
               DeviceErrorRecord* record, Stream stream);

void unpermute(const TensorView& out, const TensorView& probs, const TensorView& row_of, const GroupLayout& groups,
               const TensorView& y, const TensorView& sorted_probs, const TensorView& gathered, Stream stream);
void unpermute_backward(const TensorView& dy, const TensorView& out, const TensorView& probs,
                        const TensorView& row_of, const GroupLayout& groups, const TensorView& d_out,
                        const TensorView& d_probs, Stream stream);

// The fused expert MLP's two activation GEMMs (Hopper kernel, sm90/glu_epilogue.cuh), for a GLU or
// a non-gated activation. Each returns false without doing anything where the kernel cannot run the
// problem; the caller then composes the unfused path. Inputs arrive validated (ops/expert_mlp.cpp).
//   FC1: act = act(x W1^T + b1) * p; h (optional) receives the pre-activation.
bool expert_mlp_fc1_glu(const TensorView& x, const GroupedParam& fc1_weight, const GroupedParam& fc1_bias,
                        const GroupLayout& groups,
                        const TensorView& probs, const GluSpec& spec, const TensorView& h,
                        const TensorView& act, Stream stream);
//   FC2 dgrad: from dy and the pre-activation h, dh = dL/dh; act (optional) = act * p recomputed;
//   dprobs (optional) = <act, dy W2> per row, reduced from `scratch` (>= T * ceil(F / 256) floats).
bool expert_mlp_fc2_dgrad_glu(const TensorView& dy, const GroupedParam& fc2_weight,
                              const GroupLayout& groups, const TensorView& h, const TensorView& probs,
                              const GluSpec& spec, const TensorView& dh, const TensorView& act,
                              const TensorView& dprobs, const TensorView& scratch, Stream stream);

// FP8 block scaling (moe_engine/fp8.hpp). Quantizers: one launch each, fixed shapes, only rows
// < offsets[G] read and written (kernels/fp8_quantize_tokens.cu).
void quantize_fp8(const TensorView& x, const GroupLayout& groups, const Fp8Rows& rows, const Fp8Columns& columns,
                  const Fp8Recipe& recipe, Stream stream);
void quantize_fp8_weight(const GroupedParam& weight, const Fp8Weight& out, const Fp8Recipe& recipe, Stream stream);
// The FP8 expert MLP's step between FC1 and FC2 in one pass (kernels/fp8_glu_forward.cu): from h
// [T, 2F], h_rows (optional) = h quantized by rows and act_rows = GLU(h) * p quantized by rows, the
// bytes and scales of quantize_fp8(h), glu_forward and quantize_fp8(act). False, doing nothing,
// for a non-gated activation and where the layout, dtype or alignment is not one it takes.
bool fp8_glu_quantize(const TensorView& h, const TensorView& probs, const GroupLayout& groups, const Fp8Rows& h_rows,
                      const Fp8Rows& act_rows, const GluSpec& spec, const Fp8Recipe& recipe, Stream stream);
// The FP8 expert MLP's backward step between FC2's dgrad and the FC1 / FC2 weight gradients in one
// pass (kernels/fp8_glu_backward.cu): from the kept h (rows) and d_act = d(act * p), dL/dh by rows
// (dh_rows, optional: for dx) and columns, act * p recomputed by columns, dprobs (optional, reduced
// from `scratch`, >= T * ceil(2F / 128) floats) without fc2 bias's share; the bytes and scales of
// dequantize_fp8, glu_backward and the quantizers. The columnwise copies take their expert offsets
// from `column_offsets` (an earlier quantizer's, same routing). False, doing nothing, for a
// non-gated activation and where the layout (pairs, blocks of 4, blocks of 8..64 dividing 64), dtype
// (bfloat16) or alignment is not one it takes.
bool fp8_glu_backward_quantize(const Fp8Rows& h, const TensorView& d_act, const TensorView& probs,
                               const GroupLayout& groups, const TensorView& column_offsets, const Fp8Rows& dh_rows,
                               const Fp8Columns& dh_columns, const Fp8Columns& act_columns, const TensorView& dprobs,
                               const TensorView& scratch, const GluSpec& spec, const Fp8Recipe& recipe, Stream stream);
// The FP8 expert MLP's GLU backward from the kept h in one pass (kernels/fp8_glu_backward.cu):
// dequantize_fp8(h) and glu_backward with the same bytes, dL/dh into `dh` [T, 2F] and, where `act` is
// defined (it must be d_act itself), act * p over d_act = d(act * p); dprobs' per-128-feature shares
// in `scratch` ([T, ceil(F/128)] floats), added in order. False, doing nothing, for a non-gated
// activation and where the layout (pairs or runs of a multiple of 4), dtype or alignment is not one
// it takes.
bool fp8_glu_backward_rows(const Fp8Rows& h, const TensorView& d_act, const TensorView& probs,
                           const GroupLayout& groups, const TensorView& dh, const TensorView& act,
                           const TensorView& dprobs, const TensorView& scratch, const GluSpec& spec, Stream stream);
// Rows -> out for rows < offsets[G]: one launch, grid from T, K and the device's occupancy
// (kernels/fp8_dequantize.cu).
void dequantize_fp8(const Fp8Rows& rows, const GroupLayout& groups, const TensorView& out,
                    Stream stream);
// The FP8 grouped GEMMs (Hopper kernel, sm90/; dispatch/fp8_linear.cpp): kNotImplemented, saying
// why, where the kernel cannot run the problem (there is no other CUDA FP8 path). A float32
// forward's bias of another dtype than bfloat16 is added after the GEMM. fp8_gemms_supported:
// whether `device` runs them at all, for ops that check before their first step.
bool fp8_gemms_supported(int device, std::string* why);
void grouped_linear_forward(const Fp8Rows& x, const Fp8Weight& weight, const GroupLayout& groups,
                            const TensorView& y, const BiasEpilogue& bias, Stream stream);
void grouped_linear_dgrad(const Fp8Rows& dy, const Fp8Weight& weight, const GroupLayout& groups,
                          const TensorView& dx, Stream stream);
void grouped_linear_wgrad(const Fp8Columns& dy, const Fp8Columns& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode, Stream stream);

// The router (kernels/router.cu, kernels/router_linear.cu, dispatch/router_gemm.cpp;
// docs/design.md section 13): the logits, then one warp per token; the sums over tokens in a fixed
// order, through per-64-token partial sums. kNotImplemented beyond E = 512 experts or topk = 32.
// The buffers are carved from the ops' workspaces (common/router_scratch.hpp).
void router_forward(const TensorView& x, const TensorView& weight, const TensorView& expert_bias,
                    const RouterOutputs& out, const RouterSpec& spec, const detail::RouterForwardScratch& scratch,
                    Stream stream);
void router_backward(const RouterOutputGrads& d_out, const TensorView& x, const TensorView& weight,
                     const TensorView& logits, const TensorView& indices, const TensorView& aux_loss_counts,
                     const RouterGrads& grads, const RouterSpec& spec, const detail::RouterBackwardScratch& scratch,
                     Stream stream);
void router_update_expert_bias(const TensorView& expert_bias, const TensorView& counts, float rate, Stream stream);

// The router's float32 products (kernels/router_linear.cu; CUDA-graph safe, deterministic):
//   logits [T, E] = x W^T;  dx [T, H] = d_logits W (x's dtype);  dweight [E, H] = d_logits^T x (per mode).
// On Hopper, 16-bit x and weight with rows TMA can read run on the grouped GEMM: the logits as
// they are (exact products, float32 sums in the tensor cores' order; gemm_offsets [2] int64 scratch
// takes the one group's offsets); for bfloat16, dx and dweight over d_logits split into three
// bfloat16 parts whose sum is d_logits exactly (the same exact products and float32 sums). The rest
// runs on SIMT kernels, each output summed by one thread in order (the CPU backend's logits bits).
void router_logits(const TensorView& x, const TensorView& weight, const TensorView& logits,
                   const TensorView& gemm_offsets, Stream stream);
// Which backward products run on the grouped GEMM; router_backward_products then expects the
// scratch's d_split written (the backward kernel writes it beside d_logits).
struct RouterBackwardPlan {
  bool dx_on_gemm = false, dweight_on_gemm = false;
  bool splits() const { return dx_on_gemm || dweight_on_gemm; }
};
RouterBackwardPlan router_backward_plan(const TensorView& x, const TensorView& weight, const RouterGrads& grads,
                                        const detail::RouterBackwardScratch& scratch);
// dx = d_logits W (or dx += it with grads.accumulate_dx: on the SIMT kernels dx's value plus the
// float32 sum, rounded once; on the grouped GEMM the sum rounded to dx's dtype, then added and
// rounded) and dweight (per grads.dweight_mode) from the scratch's d_logits / d_split.
void router_backward_products(const RouterBackwardPlan& plan, const TensorView& x, const TensorView& weight,
                              const RouterGrads& grads, const detail::RouterBackwardScratch& scratch,
                              Stream stream);

// The router's problems on the Hopper grouped GEMM (dispatch/router_gemm.cpp); each can_run says
// whether that kernel takes the operands (offsets may be null there).
//   logits = x W^T: the forward of one group, offsets {0, T};
//   dx = d_split weight_stack: the dgrad of one group, offsets {0, T}; with `accumulate` added into
//     dx by the TMA's reductions (the product rounded to dx's dtype, then the sum);
//   partials[s] = d_split^T x over token slice s: the wgrad of S' groups, offsets the slices'.
bool router_logits_gemm_can_run(const TensorView& x, const TensorView& weight, const TensorView& logits);
void router_logits_gemm(const TensorView& x, const TensorView& weight, const TensorView& logits,
                        const int64_t* offsets, Stream stream);
bool router_dgrad_gemm_can_run(const TensorView& d_split, const TensorView& weight_stack, const TensorView& dx,
                               bool accumulate);
void router_dgrad_gemm(const TensorView& d_split, const TensorView& weight_stack, const TensorView& dx,
                       bool accumulate, const int64_t* offsets, Stream stream);
bool router_wgrad_gemm_can_run(const TensorView& d_split, const TensorView& x, const TensorView& partials);
void router_wgrad_gemm(const TensorView& d_split, const TensorView& x, const TensorView& partials,
                       const int64_t* offsets, Stream stream);

}  // namespace moe::cuda
