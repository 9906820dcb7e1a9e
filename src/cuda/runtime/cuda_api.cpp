// cuda_api over the CUDA runtime (linked statically).
#include "core/cuda_api.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "cuda/runtime/check.hpp"

namespace moe::cuda {

std::string describe_cuda_error(cudaError_t status) {
  const std::string code = cudaGetErrorName(status);
  if (status == cudaErrorNoDevice) return "no NVIDIA GPU found (" + code + ")";
  if (status == cudaErrorInsufficientDriver) {
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    if (driver == 0) return "no NVIDIA GPU/driver found (no CUDA driver is installed; " + code + ")";
    auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
    return "the NVIDIA driver supports CUDA " + version(driver) + ", older than this build's CUDA runtime " +
           version(runtime) + ": update the driver (" + code + ")";
  }
  return code + " (" + cudaGetErrorString(status) + ")";
}

}  // namespace moe::cuda

namespace moe::cuda_api {
void* event_create() {
  cudaEvent_t e = nullptr;
  MOE_CUDA_CHECK(cudaEventCreate(&e), "cudaEventCreate");
  return e;
}

void event_destroy(void* event) noexcept {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void event_record(void* event, Stream stream) {
  MOE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), stream), "cudaEventRecord");
}

void stream_wait_event(Stream stream, void* event) {
  MOE_CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event), 0), "cudaStreamWaitEvent");
}

Stream stream_create(int device) {
  ScopedDevice guard(device);
  cudaStream_t s = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags on cuda:", device);
  return s;
}

void stream_destroy(Stream stream) noexcept {
  if (stream) cudaStreamDestroy(stream);
}

float event_elapsed_ms(void* start, void* stop) {
  MOE_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(stop)), "cudaEventSynchronize");
  float ms = 0;
  MOE_CUDA_CHECK(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(stop)),
      "cudaEventElapsedTime");
  return ms;
}

ScopedDevice::ScopedDevice(int device) {
  MOE_CUDA_CHECK(cudaGetDevice(&previous_), "cudaGetDevice");
  // Always set, even when cudaGetDevice already names the device: on a thread that has made no
  // runtime call yet (autograd's backward thread, say) it reports device 0 while no context is
  // current, and the driver calls behind a launch (cuTensorMapEncodeTiled) then fail with
  // CUDA_ERROR_INVALID_CONTEXT. cudaSetDevice makes the device's primary context current.
  MOE_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice(", device, ")");
}

ScopedDevice::~ScopedDevice() {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
}

namespace {
// A failed allocation: kOutOfMemory when the device had no room (the error is cleared, so that the
// next launch check does not report it again), kCuda otherwise.
[[noreturn]] void allocation_failed(cudaError_t status, const char* call, size_t bytes, const std::string& where) {
  const ErrorCode code = status == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kCuda;
  if (code == ErrorCode::kOutOfMemory) (void)cudaGetLastError();
  throw_error(code, call, "(", bytes, " bytes)", where, ": ", cuda::describe_cuda_error(status));
}
}  // namespace

void* malloc(size_t bytes, int device) {
  ScopedDevice guard(device);
  void* p = nullptr;
  if (const cudaError_t status = cudaMalloc(&p, bytes); status != cudaSuccess)
    allocation_failed(status, "cudaMalloc", bytes, " on cuda:" + std::to_string(device));
  return p;
}

void free(void* ptr, int device) noexcept {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  if (previous != device) cudaSetDevice(device);
  cudaFree(ptr);
  if (previous != device) cudaSetDevice(previous);
}

void* malloc_async(size_t bytes, int device, Stream stream) {
  ScopedDevice guard(device);
  void* p = nullptr;
  if (const cudaError_t status = cudaMallocAsync(&p, bytes, stream); status != cudaSuccess)
    allocation_failed(status, "cudaMallocAsync", bytes, " on cuda:" + std::to_string(device));
  return p;
}

void free_async(void* ptr, int device, Stream stream) noexcept {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  if (previous != device) cudaSetDevice(device);
  cudaFreeAsync(ptr, stream);
  if (previous != device) cudaSetDevice(previous);
}

void* host_alloc(size_t bytes) {
  void* p = nullptr;
  if (const cudaError_t status = cudaHostAlloc(&p, bytes, cudaHostAllocDefault); status != cudaSuccess)
    allocation_failed(status, "cudaHostAlloc", bytes, "");
  return p;
}

void host_free(void* ptr) noexcept {
  if (ptr) cudaFreeHost(ptr);
}

namespace {
cudaMemPool_t default_pool(int device) {
  cudaMemPool_t pool = nullptr;
  MOE_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool(", device, ")");
  return pool;
}
size_t pool_attribute(cudaMemPool_t pool, cudaMemPoolAttr attr) {
  uint64_t value = 0;
  MOE_CUDA_CHECK(cudaMemPoolGetAttribute(pool, attr, &value), "cudaMemPoolGetAttribute");
  return size_t(value);
}
}  // namespace

StreamOrderedMemory pool_usage(int device) {
  const cudaMemPool_t pool = default_pool(device);
  return {pool_attribute(pool, cudaMemPoolAttrUsedMemCurrent), pool_attribute(pool, cudaMemPoolAttrUsedMemHigh),
          pool_attribute(pool, cudaMemPoolAttrReservedMemCurrent)};
}

void pool_reset_peak(int device) {
  uint64_t zero = 0;  // the only value the attribute accepts: the mark restarts from the current use
  MOE_CUDA_CHECK(cudaMemPoolSetAttribute(default_pool(device), cudaMemPoolAttrUsedMemHigh, &zero),
                 "cudaMemPoolSetAttribute(UsedMemHigh)");
}

void memcpy_async(void* dst, const void* src, size_t bytes, Stream stream) {
  MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync(",
                 bytes, " bytes)");
}

void memset_async(void* dst, int value, size_t bytes, Stream stream) {
  MOE_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream), "cudaMemsetAsync(", bytes, " bytes)");
}

void synchronize(Stream stream) {
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

bool is_capturing(Stream stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

int device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = cuda::describe_cuda_error(e);
    cudaGetLastError();  // clear the sticky error state of a failed query
    return 0;
  }
  if (n == 0 && why) *why = "the CUDA runtime reports no device";
  return n;
}

GpuInfo device_info(int index) {
  cudaDeviceProp p{};
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&p, index), "cudaGetDeviceProperties(", index, ")");
  GpuInfo g;
  g.index = index;
  g.name = p.name;
  g.major = p.major;
  g.minor = p.minor;
  g.multiprocessors = p.multiProcessorCount;
  g.memory_bytes = p.totalGlobalMem;
  g.l2_bytes = size_t(p.l2CacheSize);
  return g;
}

}  // namespace moe::cuda_api
