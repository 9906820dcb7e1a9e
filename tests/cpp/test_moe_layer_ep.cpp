// The expert-parallel MoE layer on the CPU backend (docs/design.md section 16): P ranks as threads
// over an in-process communicator, uneven token counts (ranks without tokens), against the layer
// without expert parallelism on each rank's tokens, dropless and with a fixed capacity (drops
// accounted for), with 16-bit and FP8 experts; and the validation of the options.
#include <memory>
#include <string>
#include <tuple>

#include "moe_layer_ep_support.hpp"

namespace moe::test {
namespace {

class MoELayerExpertParallel : public ::testing::TestWithParam<std::tuple<EpCase, DType>> {};

TEST_P(MoELayerExpertParallel, EachRankMatchesTheFullLayerOnItsTokens) {
  const auto& [e, dtype] = GetParam();
  check_expert_parallel(e, dtype, Device::cpu(), std::vector<Stream>(size_t(e.ranks), nullptr),
                        dtype == DType::kFloat32 ? 1e-5 : 1e-2);
}

INSTANTIATE_TEST_SUITE_P(Cases, MoELayerExpertParallel,
                         ::testing::Combine(::testing::ValuesIn(ep_cases()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         ep_param_name);

INSTANTIATE_TEST_SUITE_P(Fp8, MoELayerExpertParallel,
                         ::testing::Combine(::testing::ValuesIn(ep_fp8_cases()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         ep_param_name);

TEST(MoELayerExpertParallel, ValidationErrors) {
  const LayerCase c = layer_cases()[0];  // E 6
  MoELayerOptions o = layer_options(c, DType::kFloat32);
  o.expert_parallel = std::make_shared<ThreadCommunicator>(std::make_shared<ThreadGroup>(4), 1);
  EXPECT_MOE_ERROR(MoELayer(c.E, c.H, c.F, o), ErrorCode::kInvalidArgument,
                   "num_experts = 6 must be a multiple of the expert-parallel group's size 4");
  o.expert_parallel = std::make_shared<ThreadCommunicator>(std::make_shared<ThreadGroup>(2), 2);
  EXPECT_MOE_ERROR(MoELayer(c.E, c.H, c.F, o), ErrorCode::kInvalidArgument, "expected a rank in [0, size)");
  o.expert_parallel = std::make_shared<ThreadCommunicator>(std::make_shared<ThreadGroup>(3), 2);
  o.expert_parallel_capacity_factor = 0.0;
  EXPECT_MOE_ERROR(MoELayer(c.E, c.H, c.F, o), ErrorCode::kInvalidArgument,
                   "options.expert_parallel_capacity_factor: expected a finite value > 0, got 0");
  MoELayerOptions no_group = layer_options(c, DType::kFloat32);
  no_group.expert_parallel_capacity_factor = 1.5;
  EXPECT_MOE_ERROR(MoELayer(c.E, c.H, c.F, no_group), ErrorCode::kInvalidArgument,
                   "expert_parallel_capacity_factor is set without options.expert_parallel");
  o.expert_parallel_capacity_factor.reset();
  MoELayer layer(c.E, c.H, c.F, o);
  EXPECT_EQ(layer.num_experts(), 6);
  EXPECT_EQ(layer.local_experts(), 2);
  EXPECT_EQ(layer.first_local_expert(), 4);
  EXPECT_EQ(layer.state_dict().at("router.weight").size(0), 6);
  EXPECT_EQ(layer.state_dict().at("experts.fc1.weight").size(0), 2);
}

}  // namespace
}  // namespace moe::test
