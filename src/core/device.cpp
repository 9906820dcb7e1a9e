#include "moe_engine/device.hpp"

#include <charconv>

#include "moe_engine/error.hpp"

namespace moe {

std::string to_string(Device device) {
  if (device.is_cpu()) return "cpu";
  return "cuda:" + std::to_string(device.index);
}

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (text.rfind("cuda:", 0) == 0) {
    int index = -1;
    const char* first = text.data() + 5;
    const char* last = text.data() + text.size();
    auto [ptr, ec] = std::from_chars(first, last, index);
    if (ec == std::errc() && ptr == last && first != last && index >= 0) return Device::cuda(index);
  }
  throw_error(ErrorCode::kInvalidArgument, "unknown device '", text,
              "'; expected cpu, cuda or cuda:N");
}

}  // namespace moe
