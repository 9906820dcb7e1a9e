// The few CUDA runtime services the host code needs, behind one internal interface so the rest of
// the library compiles without CUDA headers. Implemented in src/cuda/runtime/cuda_api.cpp, or by
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
// Stream-ordered allocation from the device's default memory pool (cudaMallocAsync /
// cudaFreeAsync): the memory is usable by work enqueued on `stream` after the call, and returns to
// the pool once the work enqueued on `stream` before free_async has run.
void* malloc_async(size_t bytes, int device, Stream stream);
void free_async(void* ptr, int device, Stream stream) noexcept;
// Page-locked host memory (what asynchronous copies to and from the device need).
void* host_alloc(size_t bytes);
void host_free(void* ptr) noexcept;
// The default memory pool of `device` (what runtime.hpp's stream_ordered_memory reports).
StreamOrderedMemory pool_usage(int device);
void pool_reset_peak(int device);
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
void stream_wait_event(Stream stream, void* event);  // later work on stream waits for the event
Stream stream_create(int device);  // a non-blocking stream (no implicit sync with the legacy stream)
void stream_destroy(Stream stream) noexcept;
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
  [[maybe_unused]] int previous_ = -1;  // read only where CUDA is built in
};

}  // namespace moe::cuda_api
