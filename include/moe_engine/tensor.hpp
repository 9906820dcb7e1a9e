// Tensors: a non-owning view (what every op takes) and an owning tensor (host or CUDA memory).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "moe_engine/device.hpp"
#include "moe_engine/dtype.hpp"
#include "moe_engine/error.hpp"
#include "moe_engine/export.hpp"

namespace moe {

inline constexpr int kMaxDims = 6;

// A small fixed-capacity list of extents (or strides), so views never allocate.
class MOE_API Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  template <class It>
  Shape(It first, It last) {
    for (; first != last; ++first) push_back(int64_t(*first));
  }

  int size() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t& operator[](int i) { return dims_[i]; }
  const int64_t* begin() const { return dims_.data(); }
  const int64_t* end() const { return dims_.data() + rank_; }
  void push_back(int64_t d);
  int64_t numel() const;          // product of extents (1 for rank 0)
  std::string to_string() const;  // "[3, 4]"
  friend MOE_API bool operator==(const Shape& a, const Shape& b);

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

// Non-owning view: data pointer, shape, strides (in elements), dtype and device.
// A default-constructed view is "undefined": the way optional tensor arguments are left out.
class MOE_API TensorView {
 public:
  TensorView() = default;
  TensorView(void* data, Shape shape, DType dtype, Device device = Device::cpu());  // contiguous
  TensorView(void* data, Shape shape, Shape strides, DType dtype, Device device);

  bool defined() const { return defined_; }
  void* data() const { return data_; }
  template <class T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int dim() const { return shape_.size(); }
  int64_t size(int d) const { return shape_[d]; }
  int64_t stride(int d) const { return strides_[d]; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  size_t element_size() const { return dtype_size(dtype_); }
  bool is_contiguous() const;

  // Sub-views along dim 0: one index (rank - 1) or a row range [begin, end).
  TensorView select(int64_t index) const;
  TensorView slice(int64_t begin, int64_t end) const;
  TensorView reshape(Shape shape) const;  // contiguous views only

  std::string describe() const;  // "bfloat16[128, 64] on cuda:0" (or "undefined")

 private:
  void* data_ = nullptr;
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::kFloat32;
  Device device_;
  bool defined_ = false;
};

// Owning tensor: contiguous, host memory (64-byte aligned) or CUDA device memory (cudaMalloc).
// Copies share the storage (like a shared_ptr); use copy_tensor for a deep copy.
class MOE_API Tensor {
 public:
  Tensor() = default;
  static Tensor empty(Shape shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype, Device device = Device::cpu());
  // Stream-ordered CUDA memory (cudaMallocAsync from the device's default pool): usable by work
  // enqueued on `stream` from now on, and given back with cudaFreeAsync on `stream` when the last
  // copy of the tensor is dropped, so nothing synchronizes. Work on other streams must be ordered
  // before that point (as with PyTorch's caching allocator), and `stream` must outlive the tensor.
  // zeros_async clears it on `stream`. On the CPU both are empty() / zeros().
  static Tensor empty_async(Shape shape, DType dtype, Device device, Stream stream);
  static Tensor zeros_async(Shape shape, DType dtype, Device device, Stream stream);

  bool defined() const { return view_.defined(); }
  const TensorView& view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: tensors pass where views are expected
  void* data() const { return view_.data(); }
  template <class T>
  T* data_as() const {
    return view_.data_as<T>();
  }
  DType dtype() const { return view_.dtype(); }
  Device device() const { return view_.device(); }
  const Shape& shape() const { return view_.shape(); }
  int dim() const { return view_.dim(); }
  int64_t size(int d) const { return view_.size(d); }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return view_.nbytes(); }

  // A contiguous copy on `device` (synchronous: the copy has completed when it returns).
  Tensor to(Device device) const;
  // The same elements seen with another shape of as many elements; shares the storage.
  Tensor reshape(Shape shape) const;

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Copies src into dst (same shape and dtype, both contiguous, any devices). Asynchronous on
// `stream` when either side is on CUDA; the caller synchronizes before reading host results.
MOE_API void copy_tensor(const TensorView& dst, const TensorView& src, Stream stream = nullptr);

// Fills every byte of a contiguous tensor with `byte` (the way tests poison outputs).
MOE_API void fill_bytes(const TensorView& dst, uint8_t byte, Stream stream = nullptr);

// Fills a float tensor (contiguous) with uniform values in [lo, hi) from a counter-based hash of
// (seed, element index): the same values on the CPU and on CUDA, generated where the tensor lives.
MOE_API void fill_uniform(const TensorView& dst, uint64_t seed, float lo, float hi,
                          Stream stream = nullptr);

}  // namespace moe
