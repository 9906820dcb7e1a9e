#include "moe_engine/tensor.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/hash_random.hpp"
#include "core/cuda_api.hpp"

namespace moe {

// ---- Shape ----

Shape::Shape(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) push_back(d);
}

void Shape::push_back(int64_t d) {
  MOE_CHECK(rank_ < kMaxDims, ErrorCode::kShape, "tensors have at most ", kMaxDims, " dimensions");
  dims_[rank_++] = d;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

std::string Shape::to_string() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < rank_; ++i) os << (i ? ", " : "") << dims_[i];
  os << ']';
  return os.str();
}

bool operator==(const Shape& a, const Shape& b) {
  if (a.rank_ != b.rank_) return false;
  for (int i = 0; i < a.rank_; ++i)
    if (a.dims_[i] != b.dims_[i]) return false;
  return true;
}

namespace {
Shape contiguous_strides(const Shape& shape) {
  Shape strides = shape;
  int64_t s = 1;
  for (int i = shape.size() - 1; i >= 0; --i) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}
}  // namespace

// ---- TensorView ----

TensorView::TensorView(void* data, Shape shape, DType dtype, Device device)
    : TensorView(data, shape, contiguous_strides(shape), dtype, device) {}

TensorView::TensorView(void* data, Shape shape, Shape strides, DType dtype, Device device)
    : data_(data),
      shape_(shape),
      strides_(strides),
      dtype_(dtype),
      device_(device),
      defined_(true) {
  MOE_CHECK(shape.size() == strides.size(), ErrorCode::kShape, "tensor view: shape ",
            shape.to_string(), " and strides ", strides.to_string(), " differ in rank");
  for (int i = 0; i < shape.size(); ++i) {
    MOE_CHECK(shape[i] >= 0, ErrorCode::kShape, "tensor view: negative extent in shape ",
              shape.to_string());
    MOE_CHECK(strides[i] >= 0, ErrorCode::kShape, "tensor view: negative stride in ",
              strides.to_string());
  }
  // Every element's byte offset must fit in 64 bits (a shape like [2^62, 4] would wrap numel() to
  // 0 and pass every shape check of the ops after it).
  bool empty = false;
  for (int i = 0; i < shape.size(); ++i) empty = empty || shape[i] == 0;
  if (!empty) {
    int64_t n = 1, last = 0;  // numel and the offset of the last element, in elements
    bool overflow = false;
    for (int i = 0; i < shape.size(); ++i) {
      int64_t reach = 0;
      overflow = overflow || __builtin_mul_overflow(n, shape[i], &n) ||
                 __builtin_mul_overflow(shape[i] - 1, strides[i], &reach) || __builtin_add_overflow(last, reach, &last);
    }
    int64_t bytes = 0;
    overflow = overflow || __builtin_add_overflow(last, int64_t(1), &last) ||
               __builtin_mul_overflow(std::max(n, last), int64_t(dtype_size(dtype)), &bytes);
    MOE_CHECK(!overflow, ErrorCode::kShape, "tensor view: shape ", shape.to_string(), " with strides ",
              strides.to_string(), " of ", dtype_name(dtype), " spans more than 2^63 bytes");
  }
  MOE_CHECK(data != nullptr || shape.numel() == 0, ErrorCode::kInvalidArgument,
            "tensor view: null data pointer for a non-empty tensor of shape ", shape.to_string());
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

TensorView TensorView::select(int64_t index) const {
  MOE_CHECK(defined_ && dim() >= 1, ErrorCode::kShape, "select: needs a tensor of rank >= 1, got ",
            describe());
  MOE_CHECK(index >= 0 && index < shape_[0], ErrorCode::kShape, "select: index ", index,
            " out of range for ", describe());
  Shape shape, strides;
  for (int i = 1; i < dim(); ++i) {
    shape.push_back(shape_[i]);
    strides.push_back(strides_[i]);
  }
  auto* p = static_cast<char*>(data_) + index * strides_[0] * int64_t(element_size());
  return TensorView(p, shape, strides, dtype_, device_);
}

TensorView TensorView::slice(int64_t begin, int64_t end) const {
  MOE_CHECK(defined_ && dim() >= 1, ErrorCode::kShape, "slice: needs a tensor of rank >= 1, got ",
            describe());
  MOE_CHECK(0 <= begin && begin <= end && end <= shape_[0], ErrorCode::kShape, "slice: rows [",
            begin, ", ", end, ") out of range for ", describe());
  Shape shape = shape_;
  shape[0] = end - begin;
  auto* p = static_cast<char*>(data_) + begin * strides_[0] * int64_t(element_size());
  return TensorView(shape.numel() ? p : data_, shape, strides_, dtype_, device_);
}

TensorView TensorView::reshape(Shape shape) const {
  MOE_CHECK(defined_ && is_contiguous(), ErrorCode::kShape,
            "reshape: needs a contiguous tensor, got ", describe());
  MOE_CHECK(shape.numel() == numel(), ErrorCode::kShape, "reshape: cannot view ", describe(),
            " as ", shape.to_string());
  return TensorView(data_, shape, dtype_, device_);
}

std::string TensorView::describe() const {
  if (!defined_) return "undefined";
  std::string s =
      std::string(dtype_name(dtype_)) + shape_.to_string() + " on " + to_string(device_);
  if (!is_contiguous()) s += " (strides " + strides_.to_string() + ")";
  return s;
}

// ---- Tensor ----

namespace {
size_t checked_bytes(const Shape& shape, DType dtype, const char* who) {
  for (int64_t d : shape) MOE_CHECK(d >= 0, ErrorCode::kShape, who, ": negative extent in ", shape.to_string());
  int64_t bytes = int64_t(dtype_size(dtype));
  bool overflow = false, empty = false;
  for (int64_t d : shape) {
    empty = empty || d == 0;
    overflow = overflow || __builtin_mul_overflow(bytes, d, &bytes);
  }
  if (empty) return 0;
  MOE_CHECK(!overflow, ErrorCode::kShape, who, ": ", shape.to_string(), " of ", dtype_name(dtype),
            " is more than 2^63 bytes");
  return size_t(bytes);
}
}  // namespace

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  const size_t bytes = checked_bytes(shape, dtype, "Tensor::empty");
  Tensor t;
  if (device.is_cpu()) {
    const size_t padded =
        ((bytes + 63) / 64) * 64;  // aligned_alloc needs a multiple of the alignment
    void* p = std::aligned_alloc(64, padded ? padded : 64);
    MOE_CHECK(p != nullptr, ErrorCode::kOutOfMemory, "Tensor::empty: out of host memory (", bytes, " bytes for ",
              dtype_name(dtype), shape.to_string(), ")");
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  } else {
    void* p = cuda_api::malloc(bytes ? bytes : 256, device.index);
    const int index = device.index;
    t.storage_ = std::shared_ptr<void>(p, [index](void* q) { cuda_api::free(q, index); });
  }
  t.view_ = TensorView(t.storage_.get(), shape, dtype, device);
  return t;
}

Tensor Tensor::empty_async(Shape shape, DType dtype, Device device, Stream stream) {
  if (device.is_cpu()) return empty(shape, dtype, device);
  const size_t bytes = checked_bytes(shape, dtype, "Tensor::empty_async");
  void* p = cuda_api::malloc_async(bytes ? bytes : 256, device.index, stream);
  const int index = device.index;
  Tensor t;
  t.storage_ = std::shared_ptr<void>(p, [index, stream](void* q) { cuda_api::free_async(q, index, stream); });
  t.view_ = TensorView(t.storage_.get(), shape, dtype, device);
  return t;
}

Tensor Tensor::zeros_async(Shape shape, DType dtype, Device device, Stream stream) {
  Tensor t = empty_async(shape, dtype, device, stream);
  fill_bytes(t, 0, stream);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  fill_bytes(t, 0);
  if (device.is_cuda()) cuda_api::synchronize(nullptr);
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  Tensor t = *this;
  t.view_ = view_.reshape(shape);
  return t;
}

Tensor Tensor::to(Device device) const {
  MOE_CHECK(defined(), ErrorCode::kInvalidArgument, "Tensor::to: undefined tensor");
  Tensor t = empty(shape(), dtype(), device);
  copy_tensor(t, view_, nullptr);
  if (device.is_cuda() || this->device().is_cuda()) cuda_api::synchronize(nullptr);
  return t;
}

void copy_tensor(const TensorView& dst, const TensorView& src, Stream stream) {
  MOE_CHECK(dst.defined() && src.defined(), ErrorCode::kInvalidArgument,
            "copy_tensor: undefined tensor");
  MOE_CHECK(dst.shape() == src.shape() && dst.dtype() == src.dtype(), ErrorCode::kShape,
            "copy_tensor: destination ", dst.describe(), " and source ", src.describe(),
            " differ in shape or dtype");
  MOE_CHECK(dst.is_contiguous() && src.is_contiguous(), ErrorCode::kShape,
            "copy_tensor: needs contiguous tensors, got ", dst.describe(), " and ", src.describe());
  if (dst.nbytes() == 0) return;
  if (dst.device().is_cpu() && src.device().is_cpu())
    std::memcpy(dst.data(), src.data(), dst.nbytes());
  else
    cuda_api::memcpy_async(dst.data(), src.data(), dst.nbytes(), stream);
}

void fill_bytes(const TensorView& dst, uint8_t byte, Stream stream) {
  MOE_CHECK(dst.defined() && dst.is_contiguous(), ErrorCode::kShape,
            "fill_bytes: needs a contiguous tensor, got ", dst.describe());
  if (dst.nbytes() == 0) return;
  if (dst.device().is_cpu())
    std::memset(dst.data(), byte, dst.nbytes());
  else
    cuda_api::memset_async(dst.data(), byte, dst.nbytes(), stream);
}

void fill_uniform(const TensorView& dst, uint64_t seed, float lo, float hi, Stream stream) {
  MOE_CHECK(dst.defined() && dst.is_contiguous() && is_floating(dst.dtype()), ErrorCode::kInvalidArgument,
            "fill_uniform: needs a contiguous float tensor, got ", dst.describe());
  if (dst.device().is_cuda()) {
    const cuda_api::ScopedDevice scoped(dst.device().index);
    return cuda_api::fill_uniform(dst.data(), dst.dtype(), dst.numel(), seed, lo, hi, stream);
  }
  for (int64_t i = 0; i < dst.numel(); ++i) {
    const float v = detail::hash_uniform(seed, uint64_t(i), lo, hi);
    switch (dst.dtype()) {
      case DType::kFloat64: dst.data_as<double>()[i] = v; break;
      case DType::kFloat32: dst.data_as<float>()[i] = v; break;
      case DType::kBFloat16: dst.data_as<BFloat16>()[i] = BFloat16(v); break;
      default: dst.data_as<Float16>()[i] = Float16(v); break;
    }
  }
}

}  // namespace moe
