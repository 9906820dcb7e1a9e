// The device a CPU-capable benchmark (bench mlp, bench layer) runs on, from its --device flag.
#pragma once

#include <string>

#include "moe_engine/moe_engine.hpp"

namespace moe::tools {

// "auto": the first GPU, or the CPU where none is visible (`note` then says why); otherwise the
// device named, which must be visible if it is a GPU (`who` starts the error message).
inline Device bench_device(const std::string& flag, const char* who, std::string& note) {
  const GpuInventory inventory = query_gpus();
  if (flag == "auto") {
    if (!inventory.gpus.empty()) return Device::cuda(0);
    note = "no GPU visible: " + inventory.note + "; the CPU backend runs";
    return Device::cpu();
  }
  const Device device = parse_device(flag);
  if (device.is_cuda()) {
    bool visible = false;
    for (const GpuInfo& g : inventory.gpus) visible |= g.index == device.index;
    MOE_CHECK(visible, ErrorCode::kDevice, who, ": --device ", flag, ": ",
              inventory.gpus.empty() ? inventory.note
                                     : "this process sees " + std::to_string(inventory.gpus.size()) + " GPU(s)");
  }
  return device;
}

}  // namespace moe::tools
