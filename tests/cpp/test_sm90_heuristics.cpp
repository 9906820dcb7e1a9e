// The Hopper kernel's pipeline choices (src/cuda/sm90/heuristics.hpp), on the host: every choice
// has a kernel instance to launch, and the benchmark suite's shapes get the pipelines the
// performance log measured for them. Host-only header: runs in the CPU build too.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/sm90/heuristics.hpp"
#include "moe_engine/fp8.hpp"

namespace moe::test {
namespace {

using cuda::Form;
using cuda::sm90::Fp8PipelineShape;
using cuda::sm90::PipelineShape;
using cuda::sm90::activation_instance_exists;
using cuda::sm90::activation_pipeline;
using cuda::sm90::fp8_instance_exists;
using cuda::sm90::fp8_pipeline;
using cuda::sm90::store_instance_exists;
using cuda::sm90::store_pipeline;

// Rows per group on average from 0 to 4096 (and past the thresholds by one), every form and
// output dtype, G = 1, 8 and 256: the launcher would raise an internal error on a choice with
// no instance, so there must be none.
TEST(Sm90Heuristics, EveryChoiceHasAKernelInstance) {
  for (Form form : {Form::kForward, Form::kDgrad, Form::kWgrad})
    for (DType out : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
      for (int64_t groups : {1, 8, 256})
        for (int64_t rows : {0, 1, 32, 64, 65, 255, 256, 1024, 1025, 4096}) {
          const PipelineShape s = store_pipeline(form, rows * groups, groups, out);
          EXPECT_TRUE(store_instance_exists(s, form, out == DType::kFloat32))
              << "pipeline " << int(s) << " (0 DeepRing, 1 WideEpilogue, 2 PingPong) for form " << int(form)
              << ", " << dtype_name(out) << ", " << rows << " rows x " << groups << " groups";
        }
  // FP8 (forward and dgrad run as the forward form; a wgrad's capacity is the columns' width).
  for (Form form : {Form::kForward, Form::kWgrad})
    for (DType out : {DType::kBFloat16, DType::kFloat32})
      for (int64_t groups : {1, 8, 256})
        for (int64_t rows : {0, 1, 32, 64, 65, 128, 1024, 1025, 4096}) {
          const Fp8PipelineShape s = fp8_pipeline(form, out, rows * groups, groups);
          EXPECT_TRUE(fp8_instance_exists(s, form, out == DType::kFloat32))
              << "FP8 pipeline " << int(s) << " (0 ring, 1 wide epilogue, 2 ping-pong) for form " << int(form) << ", "
              << dtype_name(out) << ", " << rows << " rows x " << groups << " groups";
        }
  // The activation epilogues: FC1's forward and FC2's dgrad.
  for (Form form : {Form::kForward, Form::kDgrad})
    for (int64_t groups : {1, 8, 256})
      for (int64_t rows : {0, 1, 32, 64, 65, 255, 4096}) {
        const PipelineShape s = activation_pipeline(form, rows * groups, groups);
        EXPECT_TRUE(activation_instance_exists(s, form))
            << "activation pipeline " << int(s) << " for form " << int(form) << ", " << rows << " rows x " << groups
            << " groups";
      }
}

// The suite's shapes (rows per expert on average; bench/workloads.json) and what the
// performance log measured best for them.
TEST(Sm90Heuristics, SuiteShapesGetTheMeasuredPipelines) {
  struct Pick {
    Form form;
    int64_t rows, groups;
    DType out;
    PipelineShape expected;
  };
  constexpr auto kDeep = PipelineShape::kDeepRing, kWide = PipelineShape::kWideEpilogue,
                 kPing = PipelineShape::kPingPong;
  const Pick picks[] = {
      // fp32 wgrads (main_grad): ping-pong up to 1024 rows (qwen3 512, the small batch 32), not on
      // long K (mixtral, deepseek, gpt-oss: 2048).
      {Form::kWgrad, 512, 128, DType::kFloat32, kPing},
      {Form::kWgrad, 32, 128, DType::kFloat32, kPing},
      {Form::kWgrad, 1024, 8, DType::kFloat32, kPing},
      {Form::kWgrad, 1025, 8, DType::kFloat32, kDeep},
      {Form::kWgrad, 2048, 32, DType::kFloat32, kDeep},
      // 16-bit wgrads: the whole-slab epilogue from 4 k steps (256 rows) a tile.
      {Form::kWgrad, 2048, 8, DType::kBFloat16, kWide},
      {Form::kWgrad, 256, 8, DType::kBFloat16, kWide},
      {Form::kWgrad, 255, 8, DType::kBFloat16, kDeep},
      // Forward / dgrad: ping-pong for the small batch's 16-bit outputs (<= 64 rows a group), else
      // the 4-stage ring; fp32 outputs (the router's dx) always on the ring.
      {Form::kForward, 32, 128, DType::kBFloat16, kPing},
      {Form::kDgrad, 64, 128, DType::kFloat16, kPing},
      {Form::kDgrad, 65, 128, DType::kBFloat16, kDeep},
      {Form::kForward, 512, 128, DType::kBFloat16, kDeep},
      {Form::kDgrad, 32, 128, DType::kFloat32, kDeep},
  };
  for (const Pick& p : picks)
    EXPECT_EQ(store_pipeline(p.form, p.rows * p.groups, p.groups, p.out), p.expected)
        << "form " << int(p.form) << ", " << dtype_name(p.out) << ", " << p.rows << " rows x " << p.groups
        << " groups (0 DeepRing, 1 WideEpilogue, 2 PingPong)";
  // FC1's activation forward: ping-pong for the small batch (<= 64 rows a group); FC2's dGLU
  // dgrad on the ring.
  EXPECT_EQ(activation_pipeline(Form::kForward, 32 * 128, 128), kPing);
  EXPECT_EQ(activation_pipeline(Form::kForward, 64 * 128, 128), kPing);
  EXPECT_EQ(activation_pipeline(Form::kForward, 65 * 128, 128), kDeep);
  EXPECT_EQ(activation_pipeline(Form::kForward, 512 * 128, 128), kDeep);
  EXPECT_EQ(activation_pipeline(Form::kDgrad, 32 * 128, 128), kDeep);
  // FP8: the small batch's forward / dgrad with bf16 outputs (<= 64 rows a group) on ping-pong
  // tiles; fp32 wgrads send their slab in one batch; everything else on the FP8 ring (short wgrads
  // included: a wgrad's capacity is the columns copies' width, fp8_columns_capacity).
  constexpr auto kFp8Ring = Fp8PipelineShape::kRing, kFp8Wide = Fp8PipelineShape::kWideEpilogue,
                 kFp8Ping = Fp8PipelineShape::kPingPong;
  EXPECT_EQ(fp8_pipeline(Form::kWgrad, DType::kFloat32, fp8_columns_capacity(32 * 128, 128), 128), kFp8Wide);
  EXPECT_EQ(fp8_pipeline(Form::kWgrad, DType::kBFloat16, fp8_columns_capacity(32 * 128, 128), 128), kFp8Ring);
  EXPECT_EQ(fp8_pipeline(Form::kWgrad, DType::kFloat32, fp8_columns_capacity(2048 * 8, 8), 8), kFp8Wide);
  EXPECT_EQ(fp8_pipeline(Form::kWgrad, DType::kBFloat16, fp8_columns_capacity(2048 * 32, 32), 32), kFp8Ring);
  EXPECT_EQ(fp8_pipeline(Form::kForward, DType::kBFloat16, 32 * 128, 128), kFp8Ping);
  EXPECT_EQ(fp8_pipeline(Form::kForward, DType::kBFloat16, 64 * 128, 128), kFp8Ping);
  EXPECT_EQ(fp8_pipeline(Form::kForward, DType::kBFloat16, 65 * 128, 128), kFp8Ring);
  EXPECT_EQ(fp8_pipeline(Form::kForward, DType::kFloat32, 32 * 128, 128), kFp8Ring);
  EXPECT_EQ(fp8_pipeline(Form::kForward, DType::kBFloat16, 2048 * 8, 8), kFp8Ring);
}

}  // namespace
}  // namespace moe::test
