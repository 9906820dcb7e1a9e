// libFuzzer target: the safetensors reader must either accept an input or throw moe::Error; it
// must never crash, hang or read out of bounds (built with AddressSanitizer by scripts/fuzz).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "moe_engine/safetensors.hpp"
#include "moe_engine/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const moe::SafetensorsFile f = moe::SafetensorsFile::parse(std::vector<uint8_t>(data, data + size), "fuzz");
    volatile uint8_t sink = 0;
    for (const moe::SafetensorsEntry& e : f.entries()) {
      for (uint8_t x : f.bytes(e)) sink = sink ^ x;
      try {
        (void)f.tensor(e.name);
      } catch (const moe::Error&) {
      }
    }
  } catch (const moe::Error&) {
  }
  return 0;
}
