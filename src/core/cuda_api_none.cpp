// cuda_api for a build without CUDA.
#include "core/cuda_api.hpp"
#include "moe_engine/error.hpp"

namespace moe::cuda_api {
namespace {
[[noreturn]] void unavailable() {
  throw_error(ErrorCode::kNotImplemented,
              "this moe-engine was built without CUDA (MOE_ENGINE_WITH_CUDA=0); CUDA tensors and "
              "streams are unavailable");
}
}  // namespace

void* malloc(size_t, int) { unavailable(); }
void free(void*, int) noexcept {}
void* malloc_async(size_t, int, Stream) { unavailable(); }
void free_async(void*, int, Stream) noexcept {}
void* host_alloc(size_t) { unavailable(); }
void host_free(void*) noexcept {}
StreamOrderedMemory pool_usage(int) { unavailable(); }
void pool_reset_peak(int) { unavailable(); }
void memcpy_async(void*, const void*, size_t, Stream) { unavailable(); }
void memset_async(void*, int, size_t, Stream) { unavailable(); }
void synchronize(Stream) {}
bool is_capturing(Stream) { return false; }
int device_count(std::string* why) {
  if (why) *why = "built without CUDA";
  return 0;
}
GpuInfo device_info(int) { unavailable(); }
void* event_create() { unavailable(); }
void event_destroy(void*) noexcept {}
void event_record(void*, Stream) { unavailable(); }
void stream_wait_event(Stream, void*) { unavailable(); }
Stream stream_create(int) { unavailable(); }
void stream_destroy(Stream) noexcept {}
float event_elapsed_ms(void*, void*) { unavailable(); }
void fill_uniform(void*, DType, int64_t, uint64_t, float, float, Stream) { unavailable(); }
ScopedDevice::ScopedDevice(int) {}
ScopedDevice::~ScopedDevice() = default;

}  // namespace moe::cuda_api
