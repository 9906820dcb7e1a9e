// What this build contains and which GPUs the process can see.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "moe_engine/device.hpp"
#include "moe_engine/export.hpp"

namespace moe {

struct BuildInfo {
  std::string version;
  bool with_cuda = false;
  std::string cuda_architectures;  // e.g. "80;90a"
  std::string cuda_compiler;       // nvcc version the kernels were built with
  std::string cxx_compiler;
  std::string build_type;
  bool with_openmp = false;  // the CPU backend runs multi-threaded
};
MOE_API BuildInfo build_info();

struct GpuInfo {
  int index = 0;
  std::string name;
  int major = 0, minor = 0;  // compute capability
  int multiprocessors = 0;
  size_t memory_bytes = 0;
  size_t l2_bytes = 0;
};

struct GpuInventory {
  std::vector<GpuInfo> gpus;
  std::string note;  // why the list is empty ("built without CUDA", the CUDA runtime's error, ...)
};

MOE_API GpuInventory query_gpus();  // never throws
MOE_API bool cuda_device_available();

// Blocks until all work queued on `stream` has finished (no-op without CUDA or, for the default
// stream, without a visible GPU).
MOE_API void synchronize(Stream stream);
// True while `stream` is being captured into a CUDA graph (false for the default stream without
// a visible GPU).
MOE_API bool stream_is_capturing(Stream stream);

// Stream-ordered device memory (the device's default pool, which Tensor::empty_async and the
// modules' outputs and saved activations come from): bytes in use now, the high-water mark since
// the last reset_peak_stream_ordered_memory, and bytes the pool holds from the driver.
struct StreamOrderedMemory {
  size_t used_bytes = 0, peak_used_bytes = 0, reserved_bytes = 0;
};
MOE_API StreamOrderedMemory stream_ordered_memory(Device device);  // CUDA devices only
MOE_API void reset_peak_stream_ordered_memory(Device device);

// Times work on a stream: CUDA events on a CUDA device, the host clock on the CPU.
class MOE_API StreamTimer {
 public:
  StreamTimer(Device device, Stream stream);
  ~StreamTimer();
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;
  void start();
  void stop();
  double elapsed_ms();  // waits for the stop event

 private:
  Device device_;
  Stream stream_;
  void* start_ = nullptr;  // cudaEvent_t
  void* stop_ = nullptr;
  double host_start_ = 0, host_stop_ = 0;
};

}  // namespace moe
