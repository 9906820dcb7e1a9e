// The device error flag: what kernels report about their inputs, read on the host.
#include "moe_engine/group_layout.hpp"

#include <cstring>
#include <sstream>

#include "core/cuda_api.hpp"

namespace moe {

// ---- DeviceErrorFlag ----

DeviceErrorFlag::DeviceErrorFlag(Device device)
    : record_(Tensor::zeros({int64_t(sizeof(DeviceErrorRecord))}, DType::kUInt8, device)) {}

DeviceErrorRecord DeviceErrorFlag::read_and_clear(Stream stream) {
  DeviceErrorRecord r{};
  if (device().is_cpu()) {
    std::memcpy(&r, record(), sizeof(r));
    std::memset(record(), 0, sizeof(r));
    return r;
  }
  MOE_CHECK(!cuda_api::is_capturing(stream), ErrorCode::kInvalidArgument,
            "DeviceErrorFlag: cannot read the device error flag while the stream is being captured "
            "into a CUDA graph; check it after the graph has been launched");
  cuda_api::memcpy_async(&r, record(), sizeof(r), stream);
  cuda_api::memset_async(record(), 0, sizeof(r), stream);
  cuda_api::synchronize(stream);
  return r;
}

void DeviceErrorFlag::check(Stream stream) {
  const DeviceErrorRecord r = read_and_clear(stream);
  if (r.bits != 0) throw_error(ErrorCode::kDeviceReported, describe_device_errors(r));
}

std::string describe_device_errors(const DeviceErrorRecord& r) {
  if (r.bits == 0) return {};
  std::ostringstream os;
  const char* sep = "";
  if (r.bits & kNegativeSplit) {
    os << "splits[" << r.group << "] = " << r.value
       << " is negative (expected every split >= 0; it was treated as 0)";
    sep = "; ";
  }
  if (r.bits & kSplitsExceedCapacity) {
    os << sep << "sum(splits) = " << r.total << " exceeds the buffer capacity T = " << r.capacity
       << " (expected sum(splits) <= T; the offsets were clamped to T, rows past it were not "
          "written)";
    sep = "; ";
  }
  if (r.bits & kExpertIndexOutOfRange) {
    os << sep << "indices[" << r.index.token << ", " << r.index.choice << "] = " << r.index.value
       << " is not an expert in [0, E = " << r.index.bound
       << ") (expected every index in range; the assignment was dropped: its row_of is -1)";
    sep = "; ";
  }
  if (r.bits & kRowOutOfRange) {
    os << sep << "row_of[" << r.row.token << ", " << r.row.choice << "] = " << r.row.value
       << " is neither -1 nor a routed row in [0, offsets[G] = " << r.row.bound
       << ") (expected the row map of permute_plan; the assignment was skipped)";
    sep = "; ";
  }
  const uint32_t known = kNegativeSplit | kSplitsExceedCapacity | kExpertIndexOutOfRange | kRowOutOfRange;
  if (r.bits & ~known) os << sep << "unknown device error bits 0x" << std::hex << (r.bits & ~known);
  return os.str();
}

}  // namespace moe
