// Argument checks shared by every op. Each failure throws moe::Error naming the op, the argument,
// what was expected and what was given.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "core/cuda_api.hpp"
#include "moe_engine/config.hpp"
#include "moe_engine/error.hpp"
#include "moe_engine/glu.hpp"
#include "moe_engine/grad_mode.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_linear.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"

// Compiles its argument only in builds with the CUDA backend (the dispatch never calls it otherwise).
#if MOE_ENGINE_WITH_CUDA
#define MOE_CUDA_ONLY(...) __VA_ARGS__
#else
#define MOE_CUDA_ONLY(...) (void)0
#endif

namespace moe::ops {

// The bytes [begin, end) a view can touch (empty for an undefined or empty view), and whether two
// views' ranges meet.
std::pair<uintptr_t, uintptr_t> byte_range(const TensorView& t);
bool overlap(const TensorView& a, const TensorView& b);

class Validator {
 public:
  // All tensors must live on the group layout's device.
  Validator(const char* op, const GroupLayout& groups);
  // An op without a routing (weight quantization, the router): every tensor on `device`, G experts.
  // `device_owner` names the device in messages ("expected <device_owner> cuda:0").
  Validator(const char* op, Device device, int64_t num_groups,
            const char* device_owner = "the group layout's device");

  Device device() const { return device_; }
  int64_t capacity() const { return capacity_; }
  int64_t num_groups() const { return num_groups_; }

  template <class... Parts>
  [[noreturn]] void fail(ErrorCode code, Parts&&... parts) const {
    throw_error(code, op_, ": ", std::forward<Parts>(parts)...);
  }

  // A 2-D [rows, cols] tensor of a compute float dtype, unit column stride, rows that do not
  // overlap, on the device.
  // rows/cols < 0: any extent. `dims` names the expected shape, e.g. "[T, K]".
  void matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols,
              const char* dims) const;
  // A contiguous 1-D [n] tensor of a compute float dtype on the device.
  void vector(const char* name, const TensorView& t, int64_t n, const char* dims) const;
  // A per-row scale (router probs): [T] (`dims` names it), float32 (float64 too on the CPU backend).
  void row_scale(const char* name, const TensorView& t, const char* dims = "[T]") const;
  // Router probs per assignment: a contiguous 2-D [rows, cols] float32 tensor (float64 too on the
  // CPU backend) on the device.
  void probs_matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols, const char* dims) const;
  // A contiguous 2-D [rows, cols] integer tensor of one of `dtypes` on the device (routing indices,
  // row maps). rows/cols < 0: any extent.
  void index_matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols, const char* dims,
                    std::initializer_list<DType> dtypes) const;
  // The values of a routing tensor ([T, k] int32 or int64), on the CPU: expert indices in
  // [0, num_experts); row map entries -1 or in [0, routed_rows). On CUDA nothing (the kernels
  // report bad values through the device error flag).
  void expert_index_values(const char* name, const TensorView& indices, int64_t num_experts) const;
  void row_map_values(const char* name, const TensorView& row_of, int64_t routed_rows) const;
  // The expert shape of a per-expert tensor that must be given, with G experts of rank `rank`
  // (`dims`, e.g. "[N, K]"): where a parameter sets the sizes the activations are checked against.
  Shape expert_shape(const char* name, const GroupedParam& p, int rank, const char* dims) const;
  // A per-expert tensor with G experts of shape `expert_shape` on the device.
  void param(const char* name, const GroupedParam& p, const Shape& expert_shape,
             const char* dims) const;
  // `b` has the dtype of `a`.
  void same_dtype(const char* name_b, DType b, const char* name_a, DType a) const;
  // float32 main_grad for accumulate / overwrite.
  void grad_target(const char* name, const GroupedParam& p, GradMode mode) const;
  // An output must not share memory with an input (the result would depend on the order of work).
  void no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                  const TensorView& in) const;
  void no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                  const GroupedParam& in) const;
  void no_overlap(const char* out_name, const GroupedParam& out, const char* in_name,
                  const TensorView& in) const;
  // A per-expert output's experts must not share memory with each other (a packed tensor's never
  // do unless its strides alias them; a per-expert table may list one tensor twice).
  void distinct_experts(const char* name, const GroupedParam& out) const;
  // Two outputs must not share memory either.
  void distinct_outputs(const char* a_name, const TensorView& a, const char* b_name, const TensorView& b) const;
  // For element-wise ops whose every element is read before it is written by the same thread:
  // the output may be the input itself (same address, shape, strides and dtype); any other
  // overlap is an error.
  void in_place_or_separate(const char* out_name, const TensorView& out, const char* in_name,
                            const TensorView& in) const;
  // The activation spec is usable with F features (check_glu_spec).
  void glu_spec(const GluSpec& spec, int64_t ffn) const;
  // The workspace can hold `bytes` on the device.
  void workspace(const Workspace& ws, size_t bytes, const char* size_function) const;
  // The `bytes` of the workspace an op uses share no memory with its arguments (undefined ones
  // skipped): the op's inner steps would otherwise report an overlap of their own buffers.
  void workspace_apart(const Workspace& ws, size_t bytes,
                       std::initializer_list<std::pair<const char*, TensorView>> tensors,
                       std::initializer_list<std::pair<const char*, const GroupedParam*>> params = {}) const;
  // `t` has `dtype` (after its shape was checked).
  void dtype_is(const char* name, const TensorView& t, DType dtype) const;
  // A scalar: a 0-d tensor of `dtype` on the device.
  void scalar(const char* name, const TensorView& t, DType dtype) const;
  // A 2-D [rows, cols] int32 or int64 tensor (expert indices), unit column stride, on the device.
  void index_matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols, const char* dims) const;
  // A plain weight gradient's target for `mode`: float32 for accumulate / overwrite.
  void grad_target(const char* name, const TensorView& t, GradMode mode) const;

  // FP8 operands (moe_engine/fp8.hpp), read by the kernels with TMA: 16-byte aligned data and rows.
  // A 2-D [rows, cols] float8_e4m3 matrix (cols < 0: any), rows strided by a multiple of 16 bytes
  // (>= cols).
  void fp8_matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols, const char* dims) const;
  // A 2-D float32 scale matrix [rows, cols] (cols < 0: any), rows strided by a multiple of 4
  // elements (>= cols).
  void scale_matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols, const char* dims) const;
  // A contiguous tensor of `shape` and `dtype`, 16-byte aligned (the FP8 weight's blocks).
  void contiguous(const char* name, const TensorView& t, const Shape& shape, DType dtype, const char* dims) const;
  // A contiguous int64 [n] tensor (offsets).
  void int64_vector(const char* name, const TensorView& t, int64_t n, const char* dims) const;
  // A float tensor the quantizers read: bfloat16, float16 or float32.
  void quantizable_dtype(const char* name, DType dtype) const;
  // An extent the FP8 layouts need as a multiple of 16 (rows of 16 bytes).
  void multiple_of_16(const char* what, int64_t value, const char* of) const;

 private:
  void float_dtype(const char* name, DType dtype) const;
  void probs_dtype(const char* name, DType dtype) const;
  void on_device(const char* name, const TensorView& t) const;
  void aligned(const char* name, const TensorView& t) const;
  void defined(const char* name, const TensorView& t, const char* dims) const;
  void aligned_16(const char* name, const TensorView& t) const;
  void row_stride(const char* name, const TensorView& t, int64_t multiple_of) const;
  void grad_mode(GradMode mode) const;

  const char* op_;
  const char* device_owner_ = "the group layout's device";
  Device device_;
  int64_t num_groups_ = 0;
  int64_t capacity_ = -1;
};

// FC1's output width for an activation spec (fc1_width: 2F gated, F not) and the names of the shapes
// that have it, for the messages.
struct Fc1Dims {
  int64_t width;
  const char* rows;            // h, dL/dh: "[T, 2F]" or "[T, F]"
  const char* weight;          // "[2F, H]"
  const char* bias;            // "[2F]"
  const char* packed_weight;   // the FP8 weight: "[G, 2F, H]"
  const char* packed_weight_t; // and its transposed copy: "[G, H, 2F]"
  const char* row_scales;      // the FP8 rows' scales: "[ceil(2F/128), S]"
};
inline Fc1Dims fc1_dims(const GluSpec& spec, int64_t ffn) {
  if (spec.gated()) return {2 * ffn, "[T, 2F]", "[2F, H]", "[2F]", "[G, 2F, H]", "[G, H, 2F]", "[ceil(2F/128), S]"};
  return {ffn, "[T, F]", "[F, H]", "[F]", "[G, F, H]", "[G, H, F]", "[ceil(F/128), S]"};
}

// A tensor with the name messages give it.
struct NamedTensor {
  const char* name;
  const TensorView& t;
};

// Outputs given: none overlaps an input or another output.
template <size_t N>
void check_outputs(const Validator& v, const NamedTensor (&outputs)[N], std::initializer_list<NamedTensor> inputs) {
  for (size_t i = 0; i < N; ++i) {
    if (!outputs[i].t.defined()) continue;
    for (const NamedTensor& in : inputs)
      if (in.t.defined()) v.no_overlap(outputs[i].name, outputs[i].t, in.name, in.t);
    for (size_t j = 0; j < i; ++j)
      if (outputs[j].t.defined()) v.distinct_outputs(outputs[j].name, outputs[j].t, outputs[i].name, outputs[i].t);
  }
}

// Tensors that go together are given together: both, or neither.
void check_pair(const Validator& v, const char* a_name, const TensorView& a, const char* b_name, const TensorView& b);

// Splits scratch buffers off a workspace; with no data it only adds up their sizes, so an op's
// *_workspace_size and the op itself share one description of the layout.
class WorkspaceCarver {
 public:
  // Without a workspace (ws.data null) it only sizes: take() returns undefined views. `device`: the
  // op's, for the empty buffers of an op over zero rows, which need no workspace bytes.
  explicit WorkspaceCarver(const Workspace& ws = {}) : ws_(ws), device_(ws.device) {}
  WorkspaceCarver(const Workspace& ws, Device device) : ws_(ws), device_(device) {}
  TensorView take(Shape shape, DType dtype);
  // Buffers taken after rewind(m), m = mark() before some earlier takes, reuse those buffers'
  // memory: for buffers whose lifetimes do not overlap theirs. used() stays the high-water mark.
  size_t mark() const { return used_; }
  void rewind(size_t mark);
  // Buffers taken after skip_to(m) start at or past m (m = mark() after some takes that were then
  // rewound): they overlap none of those buffers.
  void skip_to(size_t mark) { used_ = mark > used_ ? mark : used_; }
  size_t used() const { return used_ > high_ ? used_ : high_; }

 private:
  Workspace ws_;
  Device device_;
  size_t used_ = 0;
  size_t high_ = 0;
};

// Runs `cpu` for CPU tensors and `cuda` (with the tensors' device made current) for CUDA tensors.
template <class CpuFn, class CudaFn>
void dispatch(const Validator& v, CpuFn&& cpu, CudaFn&& cuda) {
  if (v.device().is_cpu()) return cpu();
  if (!MOE_ENGINE_WITH_CUDA)
    v.fail(ErrorCode::kNotImplemented, "this build has no CUDA backend (MOE_ENGINE_CUDA=OFF)");
  const cuda_api::ScopedDevice scoped(v.device().index);
  cuda();
}

}  // namespace moe::ops
