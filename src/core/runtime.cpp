#include "moe_engine/runtime.hpp"

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

void synchronize(Stream stream) { cuda_api::synchronize(stream); }

bool stream_is_capturing(Stream stream) { return cuda_api::is_capturing(stream); }

}  // namespace moe
