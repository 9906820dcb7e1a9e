// CUDA grouped linear: each op runs on the Hopper grouped GEMM when it can (sm_90a, packed
// tensors, TMA alignment), otherwise on the portable kernel (sm80+, anything else).
#include <string>

#include "cuda/backend.hpp"
#include "cuda/bias_grad.hpp"
#include "cuda/expert_address.hpp"
#include "cuda/portable/grouped_gemm.hpp"
#include "cuda/sm90/grouped_gemm.hpp"

namespace moe::cuda {

ExpertAddress expert_address(const char* op, const char* name, const GroupedParam& p) {
  if (!p.defined()) return {};
  if (p.is_packed())
    return {p.packed_view().data(),
            int64_t(p.expert_shape().numel() * int64_t(dtype_size(p.dtype()))), nullptr};
  if (!p.pointer_table().defined())
    throw_error(ErrorCode::kInvalidArgument, op, ": ", name,
                " is per-expert; on CUDA the kernels need its device pointer table: "
                "GroupedParam::per_expert(experts, make_pointer_table(experts))");
  return {nullptr, 0, p.pointer_table().data_as<int64_t>()};
}

namespace {

// The operands of one grouped GEMM, described once for both kernel families.
struct Operands {
  Form form;
  DType in, out;
  const void* a;
  int64_t a_ld;
  ExpertAddress b;  // forward/dgrad: weights; wgrad: x (base only)
  int64_t b_ld;
  ExpertAddress d;  // forward/dgrad: y/dx (base only); wgrad: dW
  int64_t d_ld;
  int64_t n, k;
  ExpertAddress bias;
  const float* row_scale = nullptr;
  bool accumulate = false;
  bool packed = true;  // every per-expert operand is packed (the Hopper kernel's requirement)
  DType bias_dtype = DType::kBFloat16;
};

void run_gemm(const char* op, const Operands& o, const GroupLayout& groups, Stream stream) {
  sm90::GroupedGemmProblem h;
  h.form = o.form;
  h.in_dtype = o.in;
  h.out_dtype = o.out;
  h.a = o.a;
  h.a_row_stride = o.a_ld;
  h.b = o.b.base;
  h.b_row_stride = o.b_ld;
  h.d = const_cast<void*>(o.d.base);
  h.d_row_stride = o.d_ld;
  h.num_groups = groups.num_groups();
  h.capacity = groups.capacity();
  h.n = o.n;
  h.k = o.k;
  h.offsets = groups.offsets().data_as<int64_t>();
  h.bias = o.bias.base;
  h.row_scale = o.row_scale;
  h.reduce_add = o.accumulate;
  h.device = groups.device().index;
  if (o.packed && (!o.bias.defined() || o.bias_dtype == o.in) && sm90::can_run(h, nullptr))
    return sm90::run(h, stream);

  portable::GroupedGemmProblem p;
  p.form = o.form;
  p.in_dtype = o.in;
  p.out_dtype = o.out;
  p.a = o.a;
  p.a_row_stride = o.a_ld;
  p.b = o.b;
  p.b_row_stride = o.b_ld;
  p.d = o.d;
  p.d_row_stride = o.d_ld;
  p.num_groups = groups.num_groups();
  p.capacity = groups.capacity();
  p.n = o.n;
  p.k = o.k;
  p.offsets = h.offsets;
  p.bias = o.bias;
  p.row_scale = o.row_scale;
  p.accumulate = o.accumulate;
  p.device = h.device;
  std::string why;
  if (!portable::can_run(p, &why)) throw_error(ErrorCode::kNotImplemented, op, ": ", why);
  if (o.bias.defined() && o.bias_dtype != o.in)
    throw_error(ErrorCode::kNotImplemented, op, ": the CUDA kernels read the bias in x's dtype ",
                dtype_name(o.in), ", got ", dtype_name(o.bias_dtype));
  portable::run(p, stream);
}

ExpertAddress plain(const void* data) { return {data, 0, nullptr}; }

}  // namespace

void grouped_linear_forward(const TensorView& x, const GroupedParam& weight,
                            const GroupLayout& groups, const TensorView& y,
                            const BiasEpilogue& bias, Stream stream) {
  const char* op = "grouped_linear_forward";
  Operands o{Form::kForward,
             x.dtype(),
             y.dtype(),
             x.data(),
             x.stride(0),
             expert_address(op, "weight", weight),
             weight.expert_shape()[1],
             plain(y.data()),
             y.stride(0),
             y.size(1),
             x.size(1),
             expert_address(op, "bias", bias.bias)};
  o.row_scale = bias.row_scale.defined() ? bias.row_scale.data_as<float>() : nullptr;
  o.packed = weight.is_packed() && (!bias.bias.defined() || bias.bias.is_packed());
  if (bias.bias.defined()) o.bias_dtype = bias.bias.dtype();
  run_gemm(op, o, groups, stream);
}

void grouped_linear_dgrad(const TensorView& dy, const GroupedParam& weight,
                          const GroupLayout& groups, const TensorView& dx, Stream stream) {
  const char* op = "grouped_linear_dgrad";
  Operands o{Form::kDgrad,
             dy.dtype(),
             dx.dtype(),
             dy.data(),
             dy.stride(0),
             expert_address(op, "weight", weight),
             weight.expert_shape()[1],
             plain(dx.data()),
             dx.stride(0),
             dy.size(1),
             dx.size(1),
             {}};
  o.packed = weight.is_packed();
  run_gemm(op, o, groups, stream);
}

void grouped_linear_wgrad(const TensorView& dy, const TensorView& x, const GroupLayout& groups,
                          const GroupedParam& dweight, GradMode mode, Stream stream) {
  const char* op = "grouped_linear_wgrad";
  Operands o{Form::kWgrad,
             dy.dtype(),
             dweight.dtype(),
             dy.data(),
             dy.stride(0),
             plain(x.data()),
             x.stride(0),
             expert_address(op, "dweight", dweight),
             dweight.expert_shape()[1],
             dy.size(1),
             x.size(1),
             {}};
  o.accumulate = mode == GradMode::kAccumulate;
  o.packed = dweight.is_packed();
  run_gemm(op, o, groups, stream);
}

void grouped_linear_dbias(const TensorView& dy, const GroupLayout& groups,
                          const GroupedParam& dbias, GradMode mode, const TensorView& row_scale,
                          Stream stream) {
  launch_dbias(dy, groups, expert_address("grouped_linear_dbias", "dbias", dbias), dbias.dtype(),
               mode == GradMode::kAccumulate, row_scale, stream);
}

void grouped_linear_dscales(const TensorView& dy, const GroupedParam& bias,
                            const GroupLayout& groups, const TensorView& dscales, bool accumulate,
                            Stream stream) {
  launch_dscales(dy, expert_address("grouped_linear_dscales", "bias", bias), bias.dtype(), groups,
                 dscales, accumulate, stream);
}

}  // namespace moe::cuda
