// The bias a grouped GEMM adds in its epilogue: the vocabulary of the ops and the backends.
#pragma once

#include "moe_engine/grouped_param.hpp"
#include "moe_engine/tensor.hpp"

namespace moe {

struct BiasEpilogue {
  GroupedParam bias;     // G x [N]; undefined = no bias
  TensorView row_scale;  // [T] float32; when defined, adds row_scale[r] * b_g ("scale_bias")
};

}  // namespace moe
