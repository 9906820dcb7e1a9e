// Counter-based pseudo-random numbers (a 64-bit mix of seed and index), identical on host and
// device: benchmarks and tests fill large device tensors without a host round trip.
#pragma once

#include <cstdint>

#include "moe_engine/dtype.hpp"  // MOE_HOST_DEVICE

namespace moe::detail {

MOE_HOST_DEVICE inline uint64_t mix64(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [lo, hi) for element `index` of the stream `seed`.
MOE_HOST_DEVICE inline float hash_uniform(uint64_t seed, uint64_t index, float lo, float hi) {
  const uint64_t bits = mix64(seed * 0x2545f4914f6cdd1dull ^ mix64(index));
  const float u = float(bits >> 40) * (1.0f / 16777216.0f);  // 24 random bits in [0, 1)
  return lo + (hi - lo) * u;
}

}  // namespace moe::detail
