// The oracle itself, on values computed by hand.
#include <cmath>

#include "test_support.hpp"

namespace moe::test {
namespace {

TEST(Oracle, HandComputedValues) {
  // Two experts, splits {1, 1}: y0 = x0 W0^T + b0, y1 = x1 W1^T + p1 b1.
  oracle::Matrix x(2, 2);
  x.data = {1, 2, 3, 4};
  std::vector<oracle::Matrix> w(2, oracle::Matrix(1, 2));
  w[0].data = {10, 1};
  w[1].data = {0, -1};
  oracle::Matrix b(2, 1);
  b.data = {0.5, 2};
  const oracle::Vector p = {1.0, 0.25};
  const auto y = oracle::linear_forward(x, w, {1, 1}, b, p);
  EXPECT_DOUBLE_EQ(y(0, 0), 12.5);
  EXPECT_DOUBLE_EQ(y(1, 0), -3.5);
  const auto dw = oracle::linear_wgrad(y, x, {1, 1});  // dW_g = y_g^T x_g
  EXPECT_DOUBLE_EQ(dw[1](0, 1), -14.0);
  EXPECT_DOUBLE_EQ(oracle::linear_dscales(y, b, {1, 1})[1], -7.0);

  // swiglu(gate 1, linear 2) = 1 * sigmoid(1) * 2; GPT-OSS clamps gate 9 -> 7, linear 8 -> 7 (+1).
  oracle::Matrix h(1, 4);
  h.data = {1, 9, 2, 8};  // halves: gates {1, 9}, linears {2, 8}
  GluSpec swiglu;
  EXPECT_NEAR(oracle::glu_forward(h, {}, swiglu)(0, 0), 2.0 / (1.0 + std::exp(-1.0)), 1e-15);
  GluSpec gptoss{Activation::kClampedQGeGLU};
  const double alpha = 1.702f;  // the spec holds float parameters, as the kernels do
  EXPECT_NEAR(oracle::glu_forward(h, {}, gptoss)(0, 1), 7.0 / (1.0 + std::exp(-alpha * 7.0)) * 8.0,
              1e-12);
  EXPECT_DOUBLE_EQ(oracle::rel_error(oracle::Vector{1, 1}, oracle::Vector{1, 1}), 0.0);
  EXPECT_TRUE(std::isinf(oracle::rel_error(oracle::Vector{NAN}, oracle::Vector{1})));
}

}  // namespace
}  // namespace moe::test
