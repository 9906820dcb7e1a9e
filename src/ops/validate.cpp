#include "ops/validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace moe::ops {

Validator::Validator(const char* op, const GroupLayout& groups) : op_(op) {
  if (!groups.defined())
    throw_error(ErrorCode::kInvalidArgument, op,
                ": the group layout is undefined; build it with "
                "GroupLayout::compute(splits, capacity, offsets, ...)");
  device_ = groups.device();
  num_groups_ = groups.num_groups();
  capacity_ = groups.capacity();
  // The CPU backend indexes rows by the offsets as they are now: a buffer that changed since
  // GroupLayout::compute (reused, overwritten) must fail here, not read out of bounds. On CUDA
  // the kernels clamp what they read.
  if (device_.is_cpu()) {
    const int64_t* off = groups.offsets().data_as<int64_t>();
    for (int64_t g = 0; g < num_groups_; ++g)
      if (off[g] < 0 || off[g + 1] < off[g] || off[g + 1] > capacity_ || (g == 0 && off[0] != 0))
        throw_error(ErrorCode::kInvalidArgument, op, ": the group layout's offsets[", g, "..", g + 1, "] = ", off[g],
                    ", ", off[g + 1], " are not the prefix sums GroupLayout::compute wrote (non-decreasing from 0, "
                    "at most T = ", capacity_, "); was the offsets buffer changed after it?");
  }
}

Validator::Validator(const char* op, Device device, int64_t num_groups, const char* device_owner)
    : op_(op), device_owner_(device_owner), device_(device), num_groups_(num_groups) {}

void Validator::float_dtype(const char* name, DType dtype) const {
  if (is_floating(dtype)) return;
  if (dtype == DType::kFloat8E4M3)
    fail(ErrorCode::kDType, name,
         ": float8_e4m3 operands go to the FP8 ops (moe_engine/fp8.hpp: Fp8Rows, Fp8Columns, "
         "Fp8Weight); expected float32, bfloat16, float16 or float64");
  if (dtype == DType::kFloat8E5M2)
    fail(ErrorCode::kDType, name,
         ": float8_e5m2 is reserved and not supported yet; expected float32, bfloat16, float16 or "
         "float64");
  fail(ErrorCode::kDType, name,
       ": expected a float tensor (float32, bfloat16, float16 or float64), got ",
       dtype_name(dtype));
}

void Validator::on_device(const char* name, const TensorView& t) const {
  if (!(t.device() == device_))
    fail(ErrorCode::kDevice, name, " is on ", to_string(t.device()),
         "; expected ", device_owner_, " ", to_string(device_));
}

void Validator::aligned(const char* name, const TensorView& t) const {
  const auto addr = reinterpret_cast<uintptr_t>(t.data());
  if (addr % t.element_size() != 0)
    fail(ErrorCode::kAlignment, name, ": data pointer 0x", std::hex, addr, std::dec,
         " is not aligned to its ", t.element_size(), "-byte elements");
}

void Validator::matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols,
                       const char* dims) const {
  if (!t.defined())
    fail(ErrorCode::kInvalidArgument, name, ": required tensor ", dims, " is undefined");
  if (t.dim() != 2)
    fail(ErrorCode::kShape, name, ": expected a 2-D ", dims, " tensor, got ", t.describe());
  if ((rows >= 0 && t.size(0) != rows) || (cols >= 0 && t.size(1) != cols))
    fail(ErrorCode::kShape, name, ": expected ", dims, " = [",
         rows >= 0 ? std::to_string(rows) : "*", ", ", cols >= 0 ? std::to_string(cols) : "*",
         "], got ", t.describe());
  float_dtype(name, t.dtype());
  on_device(name, t);
  if (t.size(1) > 1 && t.stride(1) != 1)
    fail(ErrorCode::kShape, name, ": expected unit column stride (rows may be strided), got ",
         t.describe());
  if (t.size(0) > 1 && t.size(1) > 0 && t.stride(0) < t.size(1))
    fail(ErrorCode::kShape, name, ": expected rows that do not overlap (row stride >= ", t.size(1), "), got ",
         t.describe());
  aligned(name, t);
}

void Validator::vector(const char* name, const TensorView& t, int64_t n, const char* dims) const {
  if (!t.defined())
    fail(ErrorCode::kInvalidArgument, name, ": required tensor ", dims, " is undefined");
  if (t.dim() != 1 || t.size(0) != n)
    fail(ErrorCode::kShape, name, ": expected a 1-D ", dims, " = [", n, "] tensor, got ",
         t.describe());
  float_dtype(name, t.dtype());
  on_device(name, t);
  if (!t.is_contiguous())
    fail(ErrorCode::kShape, name, ": expected a contiguous tensor, got ", t.describe());
  aligned(name, t);
}

std::pair<uintptr_t, uintptr_t> byte_range(const TensorView& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data());
  if (!t.defined() || t.numel() == 0) return {begin, begin};
  int64_t last = 0;
  for (int d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {begin, begin + uintptr_t(last + 1) * t.element_size()};
}

bool overlap(const TensorView& a, const TensorView& b) {
  const auto [a0, a1] = byte_range(a);
  const auto [b0, b1] = byte_range(b);
  return a0 < b1 && b0 < a1;
}

void Validator::in_place_or_separate(const char* out_name, const TensorView& out, const char* in_name,
                                     const TensorView& in) const {
  const bool same = out.data() == in.data() && out.dtype() == in.dtype() && out.shape() == in.shape() &&
                    out.stride(0) == in.stride(0) && out.stride(1) == in.stride(1);
  if (!same && overlap(out, in))
    fail(ErrorCode::kInvalidArgument, "output ", out_name, " overlaps input ", in_name,
         " in memory; expected separate buffers, or ", in_name, " itself (in place)");
}

void Validator::no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                           const TensorView& in) const {
  if (overlap(out, in))
    fail(ErrorCode::kInvalidArgument, "output ", out_name, " overlaps input ", in_name,
         " in memory; expected separate buffers");
}

void Validator::distinct_outputs(const char* a_name, const TensorView& a, const char* b_name,
                                 const TensorView& b) const {
  if (overlap(a, b))
    fail(ErrorCode::kInvalidArgument, "outputs ", a_name, " and ", b_name,
         " overlap in memory; expected separate buffers");
}

void Validator::distinct_experts(const char* name, const GroupedParam& out) const {
  if (out.is_packed()) return;  // one contiguous tensor: its experts are disjoint slices
  // Sorted by first byte, each expert must end before the next begins: O(G log G).
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (int64_t g = 0; g < out.num_groups(); ++g)
    if (const auto span = byte_range(out.expert(g)); span.first < span.second) spans.push_back(span);
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second)
      fail(ErrorCode::kInvalidArgument, "output ", name,
           ": two experts' tensors overlap in memory; expected a separate tensor per expert");
}

void Validator::no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                           const GroupedParam& in) const {
  for (int64_t g = 0; g < in.num_groups(); ++g) no_overlap(out_name, out, in_name, in.expert(g));
}

void Validator::no_overlap(const char* out_name, const GroupedParam& out, const char* in_name,
                           const TensorView& in) const {
  for (int64_t g = 0; g < out.num_groups(); ++g) no_overlap(out_name, out.expert(g), in_name, in);
}

void Validator::probs_dtype(const char* name, DType dtype) const {
  const bool ok = dtype == DType::kFloat32 || (device_.is_cpu() && dtype == DType::kFloat64);
  if (!ok)
    fail(ErrorCode::kDType, name, ": expected float32", device_.is_cpu() ? " (or float64 on the CPU)" : "",
         ", got ", dtype_name(dtype));
}

void Validator::row_scale(const char* name, const TensorView& t, const char* dims) const {
  vector(name, t, capacity(), dims);
  probs_dtype(name, t.dtype());
}

void Validator::probs_matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols,
                             const char* dims) const {
  matrix(name, t, rows, cols, dims);
  probs_dtype(name, t.dtype());
  if (!t.is_contiguous()) fail(ErrorCode::kShape, name, ": expected a contiguous tensor, got ", t.describe());
}

void Validator::index_matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols, const char* dims,
                             std::initializer_list<DType> dtypes) const {
  defined(name, t, dims);
  if (t.dim() != 2 || (rows >= 0 && t.size(0) != rows) || (cols >= 0 && t.size(1) != cols))
    fail(ErrorCode::kShape, name, ": expected a 2-D ", dims, " = [", rows >= 0 ? std::to_string(rows) : "*", ", ",
         cols >= 0 ? std::to_string(cols) : "*", "] tensor, got ", t.describe());
  if (std::find(dtypes.begin(), dtypes.end(), t.dtype()) == dtypes.end()) {
    std::string names;
    for (DType d : dtypes) names += std::string(names.empty() ? "" : " or ") + dtype_name(d);
    fail(ErrorCode::kDType, name, ": expected ", names, ", got ", dtype_name(t.dtype()));
  }
  on_device(name, t);
  if (!t.is_contiguous()) fail(ErrorCode::kShape, name, ": expected a contiguous tensor, got ", t.describe());
  aligned(name, t);
}

namespace {
// The first entry of a contiguous [T, k] int32 / int64 tensor that `bad` flags, as (flat position,
// value); position -1 if none.
template <class Bad>
std::pair<int64_t, int64_t> first_bad_entry(const TensorView& t, Bad bad) {
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = t.dtype() == DType::kInt32 ? int64_t(t.data_as<int32_t>()[i]) : t.data_as<int64_t>()[i];
    if (bad(v)) return {i, v};
  }
  return {-1, 0};
}
}  // namespace

void Validator::expert_index_values(const char* name, const TensorView& indices, int64_t num_experts) const {
  if (!device_.is_cpu()) return;
  const auto [at, value] = first_bad_entry(indices, [&](int64_t v) { return v < 0 || v >= num_experts; });
  if (at >= 0)
    fail(ErrorCode::kInvalidArgument, name, "[", at / indices.size(1), ", ", at % indices.size(1), "] = ", value,
         " is not an expert in [0, E = ", num_experts, ") (expected every index in range)");
}

void Validator::row_map_values(const char* name, const TensorView& row_of, int64_t routed_rows) const {
  if (!device_.is_cpu()) return;
  const auto [at, value] = first_bad_entry(row_of, [&](int64_t v) { return v < -1 || v >= routed_rows; });
  if (at >= 0)
    fail(ErrorCode::kInvalidArgument, name, "[", at / row_of.size(1), ", ", at % row_of.size(1), "] = ", value,
         " is neither -1 nor a routed row in [0, offsets[G] = ", routed_rows,
         ") (expected the row map of permute_plan)");
}

Shape Validator::expert_shape(const char* name, const GroupedParam& p, int rank, const char* dims) const {
  if (!p.defined())
    fail(ErrorCode::kInvalidArgument, name, ": required per-expert tensor ", dims, " is undefined");
  if (p.num_groups() != num_groups())
    fail(ErrorCode::kGroupMismatch, name, " has G = ", p.num_groups(),
         " experts but the group layout has G = ", num_groups());
  if (int(p.expert_shape().size()) != rank)
    fail(ErrorCode::kShape, name, ": expected G x ", dims, ", got ", p.describe());
  return p.expert_shape();
}

void Validator::param(const char* name, const GroupedParam& p, const Shape& expert_shape,
                      const char* dims) const {
  if (!p.defined())
    fail(ErrorCode::kInvalidArgument, name, ": required per-expert tensor ", dims, " is undefined");
  if (p.num_groups() != num_groups())
    fail(ErrorCode::kGroupMismatch, name, " has G = ", p.num_groups(),
         " experts but the group layout has G = ", num_groups());
  if (!(p.expert_shape() == expert_shape))
    fail(ErrorCode::kShape, name, ": expected G x ", dims, " = ", num_groups(), " x ",
         expert_shape.to_string(), ", got ", p.describe());
  float_dtype(name, p.dtype());
  if (!(p.device() == device_))
    fail(ErrorCode::kDevice, name, " is on ", to_string(p.device()),
         "; expected ", device_owner_, " ", to_string(device_));
  if (p.is_packed())
    aligned(name, p.packed_view());
  else
    for (const TensorView& t : p.experts()) aligned(name, t);
}

void Validator::same_dtype(const char* name_b, DType b, const char* name_a, DType a) const {
  if (a != b)
    fail(ErrorCode::kDType, name_b, ": expected ", dtype_name(a), " like ", name_a, ", got ",
         dtype_name(b));
}

void Validator::grad_target(const char* name, const GroupedParam& p, GradMode mode) const {
  grad_mode(mode);
  if (mode != GradMode::kWrite && p.dtype() != DType::kFloat32)
    fail(ErrorCode::kDType, name, ": ", grad_mode_name(mode),
         " mode writes a float32 main_grad, got ", dtype_name(p.dtype()));
  distinct_experts(name, p);
}

void Validator::workspace(const Workspace& ws, size_t bytes, const char* size_function) const {
  if (bytes == 0) return;
  if (ws.data == nullptr || ws.bytes < bytes)
    fail(ErrorCode::kWorkspace, "the workspace holds ", ws.data ? ws.bytes : 0, " bytes but ",
         bytes, " are needed; size it with ", size_function, "(...)");
  if (!(ws.device == device_))
    fail(ErrorCode::kDevice, "the workspace is on ", to_string(ws.device),
         "; expected ", device_owner_, " ", to_string(device_));
}

void Validator::scalar(const char* name, const TensorView& t, DType dtype) const {
  defined(name, t, "[]");
  if (t.dim() != 0) fail(ErrorCode::kShape, name, ": expected a scalar (a 0-d tensor), got ", t.describe());
  dtype_is(name, t, dtype);
  on_device(name, t);
  aligned(name, t);
}

void Validator::index_matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols,
                             const char* dims) const {
  defined(name, t, dims);
  if (t.dim() != 2 || t.size(0) != rows || t.size(1) != cols)
    fail(ErrorCode::kShape, name, ": expected ", dims, " = [", rows, ", ", cols, "], got ", t.describe());
  if (t.dtype() != DType::kInt32 && t.dtype() != DType::kInt64)
    fail(ErrorCode::kDType, name, ": expected int32 or int64, got ", dtype_name(t.dtype()));
  on_device(name, t);
  if (t.size(1) > 1 && t.stride(1) != 1)
    fail(ErrorCode::kShape, name, ": expected unit column stride (rows may be strided), got ", t.describe());
  aligned(name, t);
}

void Validator::workspace_apart(const Workspace& ws, size_t bytes,
                                std::initializer_list<std::pair<const char*, TensorView>> tensors,
                                std::initializer_list<std::pair<const char*, const GroupedParam*>> params) const {
  if (bytes == 0 || ws.data == nullptr) return;
  const auto w0 = reinterpret_cast<uintptr_t>(ws.data), w1 = w0 + bytes;
  const auto check = [&](const char* name, const TensorView& t) {
    if (!t.defined()) return;
    const auto [t0, t1] = byte_range(t);
    if (t0 < w1 && w0 < t1)
      fail(ErrorCode::kInvalidArgument, "the workspace overlaps ", name, " in memory; expected a buffer of its own");
  };
  for (const auto& [name, t] : tensors) check(name, t);
  for (const auto& [name, p] : params)
    if (p != nullptr && p->defined())
      for (int64_t g = 0; g < p->num_groups(); ++g) check(name, p->expert(g));
}

void Validator::grad_mode(GradMode mode) const {
  if (mode != GradMode::kWrite && mode != GradMode::kAccumulate && mode != GradMode::kOverwrite)
    fail(ErrorCode::kInvalidArgument, "mode: expected GradMode kWrite, kAccumulate or kOverwrite, got the value ",
         static_cast<int>(mode));
}

void Validator::grad_target(const char* name, const TensorView& t, GradMode mode) const {
  grad_mode(mode);
  if (mode != GradMode::kWrite && t.dtype() != DType::kFloat32)
    fail(ErrorCode::kDType, name, ": ", grad_mode_name(mode), " mode writes a float32 main_grad, got ",
         dtype_name(t.dtype()));
}

void check_pair(const Validator& v, const char* a_name, const TensorView& a, const char* b_name, const TensorView& b) {
  if (a.defined() && !b.defined())
    v.fail(ErrorCode::kInvalidArgument, b_name, ": required with ", a_name, ", got an undefined tensor");
  if (b.defined() && !a.defined())
    v.fail(ErrorCode::kInvalidArgument, a_name, ": required with ", b_name, ", got an undefined tensor");
}

void Validator::glu_spec(const GluSpec& spec, int64_t ffn) const { check_glu_spec(spec, ffn, op_); }

void Validator::defined(const char* name, const TensorView& t, const char* dims) const {
  if (!t.defined()) fail(ErrorCode::kInvalidArgument, name, ": required tensor ", dims, " is undefined");
}

void Validator::dtype_is(const char* name, const TensorView& t, DType dtype) const {
  if (t.dtype() != dtype)
    fail(ErrorCode::kDType, name, ": expected ", dtype_name(dtype), ", got ", dtype_name(t.dtype()));
}

void Validator::aligned_16(const char* name, const TensorView& t) const {
  const auto addr = reinterpret_cast<uintptr_t>(t.data());
  if (addr % 16 != 0)
    fail(ErrorCode::kAlignment, name, ": data pointer 0x", std::hex, addr, std::dec,
         " is not 16-byte aligned (FP8 operands are read with TMA)");
}

void Validator::row_stride(const char* name, const TensorView& t, int64_t multiple_of) const {
  if (t.size(1) > 1 && t.stride(1) != 1)
    fail(ErrorCode::kShape, name, ": expected unit column stride (rows may be strided), got ", t.describe());
  const int64_t bytes = t.stride(0) * int64_t(t.element_size());
  if (t.size(0) > 1 && (t.stride(0) < t.size(1) || t.stride(0) % multiple_of != 0))
    fail(ErrorCode::kAlignment, name, ": row stride ", t.stride(0), " elements (", bytes,
         " bytes) must be >= ", t.size(1), " and a multiple of 16 bytes (FP8 operands are read with TMA)");
}

void Validator::fp8_matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols,
                           const char* dims) const {
  defined(name, t, dims);
  if (t.dim() != 2 || t.size(0) != rows || (cols >= 0 && t.size(1) != cols))
    fail(ErrorCode::kShape, name, ": expected ", dims, " = [", rows, ", ",
         cols >= 0 ? std::to_string(cols) : "*", "], got ", t.describe());
  dtype_is(name, t, DType::kFloat8E4M3);
  on_device(name, t);
  row_stride(name, t, 16);
  aligned_16(name, t);
}

void Validator::scale_matrix(const char* name, const TensorView& t, int64_t rows, int64_t cols,
                             const char* dims) const {
  defined(name, t, dims);
  if (t.dim() != 2 || t.size(0) != rows || (cols >= 0 && t.size(1) != cols))
    fail(ErrorCode::kShape, name, ": expected ", dims, " = [", rows, ", ",
         cols >= 0 ? std::to_string(cols) : "*", "], got ", t.describe());
  dtype_is(name, t, DType::kFloat32);
  on_device(name, t);
  row_stride(name, t, 4);
  aligned_16(name, t);
}

void Validator::contiguous(const char* name, const TensorView& t, const Shape& shape, DType dtype,
                           const char* dims) const {
  defined(name, t, dims);
  if (!(t.shape() == shape))
    fail(ErrorCode::kShape, name, ": expected ", dims, " = ", shape.to_string(), ", got ", t.describe());
  dtype_is(name, t, dtype);
  on_device(name, t);
  if (!t.is_contiguous()) fail(ErrorCode::kShape, name, ": expected a contiguous tensor, got ", t.describe());
  aligned_16(name, t);
}

void Validator::int64_vector(const char* name, const TensorView& t, int64_t n, const char* dims) const {
  defined(name, t, dims);
  if (t.dim() != 1 || t.size(0) != n)
    fail(ErrorCode::kShape, name, ": expected a 1-D ", dims, " = [", n, "] tensor, got ", t.describe());
  dtype_is(name, t, DType::kInt64);
  on_device(name, t);
  if (!t.is_contiguous()) fail(ErrorCode::kShape, name, ": expected a contiguous tensor, got ", t.describe());
  aligned(name, t);
}

void Validator::quantizable_dtype(const char* name, DType dtype) const {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16 && dtype != DType::kFloat32)
    fail(ErrorCode::kDType, name, ": expected bfloat16, float16 or float32, got ", dtype_name(dtype));
}

void Validator::multiple_of_16(const char* what, int64_t value, const char* of) const {
  if (value % 16 != 0)
    fail(ErrorCode::kShape, what, " = ", value, " (", of, ") is not a multiple of 16: FP8 rows are read with TMA, "
         "in 16-byte units");
}

TensorView WorkspaceCarver::take(Shape shape, DType dtype) {
  constexpr size_t kAlign = 256;  // keeps every buffer TMA- and vector-load aligned
  const size_t begin = (used_ + kAlign - 1) / kAlign * kAlign;
  const size_t bytes = size_t(shape.numel()) * dtype_size(dtype);
  used_ = begin + bytes;
  if (bytes == 0) return TensorView(ws_.data, shape, dtype, device_);  // nothing to address
  if (ws_.data == nullptr) return {};
  MOE_CHECK(used_ <= ws_.bytes, ErrorCode::kInternal, "workspace carver overran its buffer");
  return TensorView(static_cast<char*>(ws_.data) + begin, shape, dtype, ws_.device);
}

void WorkspaceCarver::rewind(size_t mark) {
  MOE_CHECK(mark <= used_, ErrorCode::kInternal, "workspace carver rewound past its end");
  high_ = used();
  used_ = mark;
}

}  // namespace moe::ops
