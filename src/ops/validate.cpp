#include "ops/validate.hpp"

#include <cmath>
#include <cstdint>
#include <utility>

namespace moe::ops {

Validator::Validator(const char* op, const GroupLayout& groups) : op_(op), groups_(&groups) {
  if (!groups.defined())
    throw_error(ErrorCode::kInvalidArgument, op,
                ": the group layout is undefined; build it with "
                "GroupLayout::compute(splits, capacity, offsets, ...)");
  device_ = groups.device();
}

void Validator::float_dtype(const char* name, DType dtype) const {
  if (is_floating(dtype)) return;
  if (dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2)
    fail(ErrorCode::kDType, name, ": ", dtype_name(dtype),
         " is reserved for the FP8 GEMMs and not supported yet; expected float32, bfloat16, "
         "float16 or float64");
  fail(ErrorCode::kDType, name,
       ": expected a float tensor (float32, bfloat16, float16 or float64), got ",
       dtype_name(dtype));
}

void Validator::on_device(const char* name, const TensorView& t) const {
  if (!(t.device() == device_))
    fail(ErrorCode::kDevice, name, " is on ", to_string(t.device()),
         "; expected the group layout's device ", to_string(device_));
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

namespace {
// The bytes [begin, end) a view can touch.
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
}  // namespace

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

void Validator::no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                           const GroupedParam& in) const {
  for (int64_t g = 0; g < in.num_groups(); ++g) no_overlap(out_name, out, in_name, in.expert(g));
}

void Validator::no_overlap(const char* out_name, const GroupedParam& out, const char* in_name,
                           const TensorView& in) const {
  for (int64_t g = 0; g < out.num_groups(); ++g) no_overlap(out_name, out.expert(g), in_name, in);
}

void Validator::row_scale(const char* name, const TensorView& t) const {
  vector(name, t, capacity(), "[T]");
  const bool ok =
      t.dtype() == DType::kFloat32 || (device_.is_cpu() && t.dtype() == DType::kFloat64);
  if (!ok)
    fail(ErrorCode::kDType, name, ": expected float32",
         device_.is_cpu() ? " (or float64 on the CPU)" : "", ", got ", dtype_name(t.dtype()));
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
         "; expected the group layout's device ", to_string(device_));
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
  if (mode != GradMode::kWrite && p.dtype() != DType::kFloat32)
    fail(ErrorCode::kDType, name, ": ", grad_mode_name(mode),
         " mode writes a float32 main_grad, got ", dtype_name(p.dtype()));
}

void Validator::workspace(const Workspace& ws, size_t bytes, const char* size_function) const {
  if (bytes == 0) return;
  if (ws.data == nullptr || ws.bytes < bytes)
    fail(ErrorCode::kWorkspace, "the workspace holds ", ws.data ? ws.bytes : 0, " bytes but ",
         bytes, " are needed; size it with ", size_function, "(...)");
  if (!(ws.device == device_))
    fail(ErrorCode::kDevice, "the workspace is on ", to_string(ws.device),
         "; expected the group layout's device ", to_string(device_));
}

void Validator::glu_spec(const GluSpec& spec, int64_t ffn) const {
  const int64_t s = spec.layout.block_size(ffn);
  if (ffn > 0 && ffn % s != 0)
    fail(ErrorCode::kShape, "GLU layout ", spec.layout.name(), " needs F divisible by ", s,
         ", got F = ", ffn);
  if (spec.activation == GluActivation::kClampedQGeGLU) {
    if (!(spec.limit > 0) || std::isnan(spec.limit))
      fail(ErrorCode::kInvalidArgument, "clamped_qgeglu limit must be > 0, got ", spec.limit);
    if (!std::isfinite(spec.alpha) || !std::isfinite(spec.offset))
      fail(ErrorCode::kInvalidArgument,
           "clamped_qgeglu alpha and offset must be finite, got alpha = ", spec.alpha,
           ", offset = ", spec.offset);
  }
}

TensorView WorkspaceCarver::take(Shape shape, DType dtype) {
  constexpr size_t kAlign = 256;  // keeps every buffer TMA- and vector-load aligned
  const size_t begin = (used_ + kAlign - 1) / kAlign * kAlign;
  const size_t bytes = size_t(shape.numel()) * dtype_size(dtype);
  used_ = begin + bytes;
  if (ws_.data == nullptr) return {};
  MOE_CHECK(used_ <= ws_.bytes, ErrorCode::kInternal, "workspace carver overran its buffer");
  return TensorView(static_cast<char*>(ws_.data) + begin, shape, dtype, ws_.device);
}

}  // namespace moe::ops
