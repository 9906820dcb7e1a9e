#include "moe_engine/runtime.hpp"

#include <chrono>

#include "core/cuda_api.hpp"
#include "moe_engine/config.hpp"
#include "moe_engine/error.hpp"

namespace moe {

BuildInfo build_info() {
  BuildInfo b;
  b.version = MOE_ENGINE_VERSION;
  b.with_cuda = MOE_ENGINE_WITH_CUDA;
  b.cuda_architectures = MOE_ENGINE_CUDA_ARCHITECTURES;
  b.cuda_compiler = MOE_ENGINE_CUDA_COMPILER_VERSION;
  b.cxx_compiler = MOE_ENGINE_CXX_COMPILER;
  b.build_type = MOE_ENGINE_BUILD_TYPE;
  b.with_openmp = MOE_ENGINE_WITH_OPENMP;
  return b;
}

GpuInventory query_gpus() {
  GpuInventory inv;
  try {
    const int n = cuda_api::device_count(&inv.note);
    for (int i = 0; i < n; ++i) inv.gpus.push_back(cuda_api::device_info(i));
  } catch (const Error& e) {
    inv.gpus.clear();
    inv.note = e.what();
  }
  return inv;
}

bool cuda_device_available() { return !query_gpus().gpus.empty(); }

void synchronize(Stream stream) {
  // With no GPU visible nothing can have been queued on the default stream (a CUDA build on a
  // machine without a GPU): nothing to wait for, rather than the runtime's no-driver error.
  if (stream == nullptr && cuda_api::device_count(nullptr) == 0) return;
  cuda_api::synchronize(stream);
}

bool stream_is_capturing(Stream stream) {
  if (stream == nullptr && cuda_api::device_count(nullptr) == 0) return false;  // as synchronize
  return cuda_api::is_capturing(stream);
}

StreamOrderedMemory stream_ordered_memory(Device device) {
  MOE_CHECK(device.is_cuda(), ErrorCode::kInvalidArgument, "stream_ordered_memory: needs a CUDA device, got ",
            to_string(device));
  return cuda_api::pool_usage(device.index);
}

void reset_peak_stream_ordered_memory(Device device) {
  MOE_CHECK(device.is_cuda(), ErrorCode::kInvalidArgument,
            "reset_peak_stream_ordered_memory: needs a CUDA device, got ", to_string(device));
  cuda_api::pool_reset_peak(device.index);
}

namespace {
double host_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}
}  // namespace

StreamTimer::StreamTimer(Device device, Stream stream) : device_(device), stream_(stream) {
  if (device_.is_cuda()) {
    const cuda_api::ScopedDevice scoped(device_.index);
    start_ = cuda_api::event_create();
    stop_ = cuda_api::event_create();
  }
}

StreamTimer::~StreamTimer() {
  cuda_api::event_destroy(start_);
  cuda_api::event_destroy(stop_);
}

void StreamTimer::start() {
  if (device_.is_cuda())
    cuda_api::event_record(start_, stream_);
  else
    host_start_ = host_ms();
}

void StreamTimer::stop() {
  if (device_.is_cuda())
    cuda_api::event_record(stop_, stream_);
  else
    host_stop_ = host_ms();
}

double StreamTimer::elapsed_ms() {
  if (device_.is_cuda()) return cuda_api::event_elapsed_ms(start_, stop_);
  return host_stop_ - host_start_;
}

}  // namespace moe
