// The few CUDA runtime services the host code needs, behind one internal interface so the rest of
// the library compiles without CUDA headers. Implemented in src/cuda/cuda_api.cpp, or by
// cuda_api_none.cpp in a build without CUDA (every call then throws kNotImplemented).
#pragma once

#include <cstddef>
#include <string>

#include "moe_engine/device.hpp"
#include "moe_engine/dtype.hpp"
#include "moe_engine/runtime.hpp"

namespace moe::cuda_api {

void* malloc(size_t bytes, int device);
void free(void* ptr, int device) noexcept;
// dst/src may be host or device pointers (unified addressing).
void memcpy_async(void* dst, const void* src, size_t bytes, Stream stream);
void memset_async(void* dst, int value, size_t bytes, Stream stream);
void synchronize(Stream stream);
bool is_capturing(Stream stream);
// Number of usable GPUs; 0 with the reason in *why when none can be used.
int device_count(std::string* why);
GpuInfo device_info(int index);

void* event_create();
void event_destroy(void* event) noexcept;
void event_record(void* event, Stream stream);
float event_elapsed_ms(void* start, void* stop);  // synchronizes on stop
void fill_uniform(void* data, DType dtype, int64_t n, uint64_t seed, float lo, float hi, Stream stream);

// Makes `device` the current CUDA device for the scope (no-op without CUDA).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace moe::cuda_api
