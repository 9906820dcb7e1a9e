// How a kernel finds expert g's tensor: base + g * stride (packed) or table[g] (per-expert tensors,
// whose addresses live in a device pointer table).
#pragma once

#include <cstdint>

#include "moe_engine/dtype.hpp"  // MOE_HOST_DEVICE
#include "moe_engine/grouped_param.hpp"

namespace moe::cuda {

struct ExpertAddress {
  const void* base = nullptr;
  int64_t stride_bytes = 0;
  const int64_t* table = nullptr;
  // Host side only, per-expert tensors: the experts' views (the Hopper kernel encodes a TMA map
  // per expert from their addresses). Valid for the op call that built this address.
  const GroupedParam* experts = nullptr;

  MOE_HOST_DEVICE bool defined() const { return base != nullptr || table != nullptr; }

#if defined(__CUDACC__)
  template <class T>
  __device__ __forceinline__ T* at(int64_t g) const {
    return table ? reinterpret_cast<T*>(table[g])
                 : reinterpret_cast<T*>(static_cast<char*>(const_cast<void*>(base)) +
                                        g * stride_bytes);
  }
#endif
};

// The address description of a GroupedParam on a CUDA device (undefined for an undefined param).
// Per-expert tensors need their device pointer table; its absence is a clear error.
ExpertAddress expert_address(const char* op, const char* name, const GroupedParam& p);

}  // namespace moe::cuda
