#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "commands.hpp"
#include "moe_engine/moe_engine.hpp"

namespace moe::tools {

int run_info(const InfoOptions& options) {
  const BuildInfo b = build_info();
  const GpuInventory inv = query_gpus();
  if (options.json) {
    nlohmann::json j;
    j["version"] = b.version;
    j["build"] = {{"cuda", b.with_cuda},
                  {"cuda_architectures", b.cuda_architectures},
                  {"cuda_compiler", b.cuda_compiler},
                  {"cxx_compiler", b.cxx_compiler},
                  {"build_type", b.build_type},
                  {"openmp", b.with_openmp}};
    j["gpus"] = nlohmann::json::array();
    for (const GpuInfo& g : inv.gpus)
      j["gpus"].push_back(
          {{"index", g.index},
           {"name", g.name},
           {"compute_capability", std::to_string(g.major) + "." + std::to_string(g.minor)},
           {"multiprocessors", g.multiprocessors},
           {"memory_bytes", g.memory_bytes},
           {"l2_bytes", g.l2_bytes}});
    if (inv.gpus.empty()) j["gpus_note"] = inv.note;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "moe-engine " << b.version << "\n"
            << "build: " << b.build_type << ", " << b.cxx_compiler << ", CPU backend "
            << (b.with_openmp
                    ? "OpenMP (" + std::to_string(std::thread::hardware_concurrency()) + " threads)"
                    : "single-threaded")
            << "\n"
            << "CUDA backend: "
            << (b.with_cuda ? "yes (nvcc " + b.cuda_compiler + ", architectures " +
                                  b.cuda_architectures + ")"
                            : std::string("no (built without CUDA)"))
            << "\n";
  if (inv.gpus.empty()) {
    std::cout << "GPUs: none: " << inv.note << "\n";
    return 0;
  }
  std::cout << "GPUs:\n";
  for (const GpuInfo& g : inv.gpus)
    std::cout << "  cuda:" << g.index << "  " << g.name << ", sm_" << g.major << g.minor << ", "
              << g.multiprocessors << " SMs, " << (g.memory_bytes >> 20) << " MiB, L2 "
              << (g.l2_bytes >> 20) << " MiB\n";
  return 0;
}

}  // namespace moe::tools
