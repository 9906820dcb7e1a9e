// Where tensors live and where work runs.
#pragma once

#include <cstdint>
#include <string>

#include "moe_engine/export.hpp"

// cudaStream_t is `CUstream_st*`; declaring the struct keeps CUDA headers out of the public API.
struct CUstream_st;

namespace moe {

// A CUDA stream (nullptr = the legacy default stream). Ignored by the CPU backend.
using Stream = CUstream_st*;

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static constexpr Device cpu() { return {DeviceType::kCPU, 0}; }
  static constexpr Device cuda(int index = 0) { return {DeviceType::kCUDA, index}; }
  constexpr bool is_cpu() const { return type == DeviceType::kCPU; }
  constexpr bool is_cuda() const { return type == DeviceType::kCUDA; }
  friend constexpr bool operator==(Device a, Device b) {
    return a.type == b.type && (a.type == DeviceType::kCPU || a.index == b.index);
  }
};

MOE_API std::string to_string(Device device);          // "cpu", "cuda:0"
MOE_API Device parse_device(const std::string& text);  // "cpu", "cuda", "cuda:1"

}  // namespace moe
