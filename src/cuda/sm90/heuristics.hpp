// Tile-configuration choices of the Hopper grouped GEMM's launchers: which shared-memory split
// (config.hpp's Pipeline) an instance runs with. Each is decided on the host from static problem
// shapes only (form, dtypes, capacity, group count), never from device data such as the routing,
// so that a launch captured in a CUDA graph stays right at every replay. One function per
// decision, with the measurement behind it (details in docs/performance-log.md).
#pragma once

#include <cstdint>

#include "cuda/sm90/config.hpp"
#include "moe_engine/dtype.hpp"

namespace moe::cuda::sm90 {

// The launchable Pipeline shapes (config.hpp).
enum class PipelineShape { kDeepRing, kWideEpilogue, kPingPong };

// The store-epilogue instances grouped_gemm.cu builds, by pipeline, form and output width:
// store_pipeline picks only among these (tests/cpp/test_sm90_heuristics.cpp checks it).
constexpr bool store_instance_exists(PipelineShape shape, Form form, bool out32) {
  switch (shape) {
    case PipelineShape::kDeepRing:
      return true;
    case PipelineShape::kWideEpilogue:
      return form == Form::kWgrad && !out32;
    case PipelineShape::kPingPong:
      return form == Form::kWgrad ? out32 : !out32;
  }
  return false;
}

// Forward / dgrad over at most one ping-pong tile (64 rows) per group on average: the small batch,
// whose forward-form GEMMs take PingPong (store_pipeline, activation_pipeline).
inline bool groups_fit_a_pingpong_tile(int64_t capacity, int64_t num_groups) {
  return capacity <= PingPongConfig::kBlockM * num_groups;
}

// GEMMs with the store epilogue. Wgrads with 16-bit outputs over >= 4 k steps per tile on
// average (capacity rows over num_groups groups) take WideEpilogue: the whole 64 x 256 slab of
// a math warpgroup goes out in one batch, measured 1-4% faster than two batches with a 4-stage
// ring on the suite's bf16 wgrads. 1-step tiles (the small batch) need the 4th stage's loads in
// flight more (+4-5% time with it gone), long fp32 wgrads take two batches either way (+1-4%),
// and forward/dgrad measured within +-1%: those keep DeepRing.
inline PipelineShape store_pipeline(Form form, int64_t capacity, int64_t num_groups, DType out_dtype) {
  // fp32 wgrads (main_grad) over <= 16 k steps per tile on average take PingPong: their epilogue
  // (reduce-adds or stores of a 64 x 256 fp32 slab a warpgroup, ~7-10k cycles) is half or more of
  // a tile, and runs under the other warpgroup's mainloop there. Measured against DeepRing (H200,
  // wgrad_acc, bench/results/2026-11-30-wgrad-pingpong-h200.md): qwen3 (8 steps) -9..-17% (heavy
  // routing's FC1 +2..+6%: its large experts' long tiles), the small batch (1 step) -0.3..-1.5%;
  // long-K ones (32+ steps: deepseek, gpt-oss, mixtral) mostly +5..+14%, where 64-row tiles' extra
  // operand traffic costs more than the epilogue it hides. 16-bit wgrads measured mixed.
  if (form == Form::kWgrad && out_dtype == DType::kFloat32 && capacity <= 16 * Config::kBlockK * num_groups)
    return PipelineShape::kPingPong;
  const bool out16 = out_dtype == DType::kBFloat16 || out_dtype == DType::kFloat16;
  // Forward / dgrad with 16-bit outputs over <= 64 rows per group on average (the small batch:
  // weight-streaming, memory-bound) take PingPong: a group of <= 64 rows is one 64-row tile, so the
  // weights stream no more often than with 128-row tiles, the half-empty tile's second warpgroup
  // no longer idles, and one warpgroup's epilogue runs under the other's mainloop, where the weight
  // stream otherwise stops. Measured against DeepRing (H200, the small batch's FC2 forward and
  // dgrads, bench/results/2026-11-30-small-batch-pingpong-h200.md): -2.2..-3.3% on 8 of 9, +1.5%
  // on heavy routing's FC2 dgrad (experts up to 250 rows). FC1's GLU forward keeps DeepRing.
  if (form != Form::kWgrad && out16 && groups_fit_a_pingpong_tile(capacity, num_groups))
    return PipelineShape::kPingPong;
  if (form == Form::kWgrad && out16 && capacity >= 4 * Config::kBlockK * num_groups)
    return PipelineShape::kWideEpilogue;
  return PipelineShape::kDeepRing;
}

// The activation-epilogue instances launch.cuh's launch_activation builds (FC1's forward, FC2's
// dgrad): activation_pipeline picks only among these (tests/cpp/test_sm90_heuristics.cpp checks it).
constexpr bool activation_instance_exists(PipelineShape shape, Form form) {
  switch (shape) {
    case PipelineShape::kDeepRing:
      return form != Form::kWgrad;
    case PipelineShape::kPingPong:  // as ActivationPingPong
      return form == Form::kForward;
    case PipelineShape::kWideEpilogue:
      return false;
  }
  return false;
}

// FC1's forward with an activation epilogue (a GLU's or a non-gated one's). Over <= 64 rows per
// group on average (the small batch) it takes PingPong (as ActivationPingPong: two buffers) for the
// store forward's reasons: a group is one 64-row tile, the half-empty tile's second warpgroup no
// longer idles, and one warpgroup's epilogue (the GLU math, h's batches and act's) runs under the
// other's mainloop. Measured against DeepRing (H200, the small batch's fused MLP, SwiGLU blocks:32,
// bench/results/2026-11-30-small-batch-glu-pingpong-h200.md): forward (FC1 + FC2) -2.8..-3.1% on all
// three routings in all six rounds, FC1's GEMM ~-4.5%. WideEpilogue (h in one batch, act in a second)
// measured lower on every case (small batch 0.994-0.997 vs 0.999-1.006): the memory-bound small batch
// needs the 4th stage more than the epilogue needs the buffers. FC2's dgrad with the dGLU epilogue
// (MlpFusion::kForwardBackward, not the default) keeps DeepRing: not built on ping-pong.
inline PipelineShape activation_pipeline(Form form, int64_t capacity, int64_t num_groups) {
  if (form == Form::kForward && groups_fit_a_pingpong_tile(capacity, num_groups)) return PipelineShape::kPingPong;
  return PipelineShape::kDeepRing;
}

// The FP8 kernel's shared-memory splits (config.hpp): Fp8Ring, Fp8WideEpilogue or Fp8PingPong.
enum class Fp8PipelineShape { kRing, kWideEpilogue, kPingPong };

// The FP8 instances grouped_gemm_fp8.cu builds: fp8_pipeline picks only among these
// (tests/cpp/test_sm90_heuristics.cpp checks it).
constexpr bool fp8_instance_exists(Fp8PipelineShape shape, Form form, bool out32) {
  switch (shape) {
    case Fp8PipelineShape::kRing:
      return form != Form::kWgrad || !out32;
    case Fp8PipelineShape::kWideEpilogue:
      return form == Form::kWgrad && out32;
    case Fp8PipelineShape::kPingPong:
      return form != Form::kWgrad && !out32;
  }
  return false;
}

// FP8 wgrads with fp32 outputs take Fp8WideEpilogue: their 64 x 192 fp32 slab a warpgroup goes out
// in one batch rather than two. Measured against Fp8Ring (H200, the suite's 30 wgrad_acc GEMMs,
// bench/results/2026-11-30-fp8-wgrad-wide-epilogue-h200.md): about -1% on deepseek and mixtral,
// nothing measurable elsewhere (0.994 geomean, as much as a null A/B of the protocol reads), no
// case slower. 16-bit outputs already go out in one batch (three 128-byte chunks of 192 columns).
// Forward-form GEMMs (forward, and dgrad over the transposed weight) with bf16 outputs over <= 64
// rows a group on average (the small batch) take Fp8PingPong, for the 16-bit kernel's reasons
// (store_pipeline): a group is one 64-row tile, the half-empty 128-row tile's second warpgroup no
// longer multiplies zeros, and one warpgroup's epilogue runs under the other's mainloop. Measured
// against Fp8Ring (H200, bench/results/2026-12-01-fp8-pingpong-h200.md): the small batch's FC1
// forward -1..-3%, FC1 dgrad -5..-7%, FC2 forward -7..-9%, FC2 dgrad 0..+3%. On full tiles the forward form
// measured 1.25-1.39x (qwen3's 6-16 steps a tile, gpt-oss, mixtral), the wgrads 1.36-1.47x (the
// small batch, bf16 outputs) and 1.06-1.45x (qwen3): a ping-pong warpgroup's promotions do not
// run under the other's wgmma as the two 128-row warpgroups' do.
inline Fp8PipelineShape fp8_pipeline(Form form, DType out_dtype, int64_t capacity, int64_t num_groups) {
  const bool out32 = out_dtype == DType::kFloat32;
  if (form == Form::kWgrad) return out32 ? Fp8PipelineShape::kWideEpilogue : Fp8PipelineShape::kRing;
  if (!out32 && groups_fit_a_pingpong_tile(capacity, num_groups)) return Fp8PipelineShape::kPingPong;
  return Fp8PipelineShape::kRing;
}

}  // namespace moe::cuda::sm90
