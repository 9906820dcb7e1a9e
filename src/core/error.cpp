#include "moe_engine/error.hpp"

namespace moe {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kShape:
      return "shape";
    case ErrorCode::kDType:
      return "dtype";
    case ErrorCode::kAlignment:
      return "alignment";
    case ErrorCode::kDevice:
      return "device";
    case ErrorCode::kGroupMismatch:
      return "group mismatch";
    case ErrorCode::kWorkspace:
      return "workspace";
    case ErrorCode::kNotImplemented:
      return "not implemented";
    case ErrorCode::kCuda:
      return "cuda";
    case ErrorCode::kDeviceReported:
      return "device-reported";
    case ErrorCode::kIo:
      return "io";
    case ErrorCode::kInternal:
      return "internal";
    case ErrorCode::kOutOfMemory:
      return "out of memory";
  }
  return "unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error("moe-engine " + std::string(error_code_name(code)) + " error: " + message),
      code_(code) {}

}  // namespace moe
