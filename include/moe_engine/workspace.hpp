// Scratch memory and the execution context every op takes. Ops allocate nothing: scratch comes
// from a caller-owned workspace whose size each op reports from static shapes only, so the same
// buffer serves every step and every CUDA-graph replay.
#pragma once

#include <cstddef>

#include "moe_engine/device.hpp"

namespace moe {

struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
  Device device{};
};

struct ExecContext {
  Stream stream = nullptr;  // CUDA stream for CUDA tensors; ignored on the CPU
  Workspace workspace{};    // required by ops whose *_workspace_size(...) is non-zero
};

}  // namespace moe
