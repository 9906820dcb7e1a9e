// Uses the installed library through its public headers only: one grouped linear forward.
#include <cstdio>
#include <cstring>
#include <moe_engine/moe_engine.hpp>

int main() {
  moe::Tensor splits = moe::Tensor::empty({2}, moe::DType::kInt64);
  const int64_t s[2] = {1, 2};
  std::memcpy(splits.data(), s, sizeof(s));
  moe::Tensor offsets = moe::Tensor::empty({3}, moe::DType::kInt64);
  const auto groups = moe::GroupLayout::compute(splits, 4, offsets);
  moe::Tensor x = moe::Tensor::zeros({4, 8}, moe::DType::kFloat32);
  moe::Tensor w = moe::Tensor::zeros({2, 3, 8}, moe::DType::kFloat32);
  moe::Tensor y = moe::Tensor::zeros({4, 3}, moe::DType::kFloat32);
  x.data_as<float>()[0] = 2.0f;
  w.data_as<float>()[0] = 1.5f;
  moe::grouped_linear_forward(x, moe::GroupedParam::packed(w), groups, y);
  std::printf("moe-engine %s: y[0][0] = %g\n", moe::build_info().version.c_str(),
              y.data_as<float>()[0]);
  return y.data_as<float>()[0] == 3.0f ? 0 : 1;
}
