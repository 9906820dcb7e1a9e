// Errors: every failure the host can see is a moe::Error with a code and a message that says what
// was wrong and what was expected.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "moe_engine/export.hpp"

namespace moe {

enum class ErrorCode {
  kInvalidArgument,  // a value out of its domain (unknown name, bad option combination)
  kShape,            // wrong rank or extent
  kDType,            // unsupported or mismatched element type
  kAlignment,        // pointer or stride alignment
  kDevice,           // tensors on the wrong or on different devices
  kGroupMismatch,    // number of experts G disagrees between arguments
  kWorkspace,        // workspace missing or too small
  kNotImplemented,   // valid request this build or device cannot run (yet)
  kCuda,             // a CUDA runtime call failed
  kDeviceReported,   // a kernel reported bad input through the device error flag
  kIo,               // file or format error
  kInternal,         // a bug in moe-engine
  kOutOfMemory,      // a host or device allocation failed
};

MOE_API const char* error_code_name(ErrorCode code);

class MOE_API Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
template <class... Parts>
std::string str_cat(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}
}  // namespace detail

// throw_error(ErrorCode::kShape, "x: expected ", a, ", got ", b)
template <class... Parts>
[[noreturn]] void throw_error(ErrorCode code, Parts&&... parts) {
  throw Error(code, detail::str_cat(std::forward<Parts>(parts)...));
}

}  // namespace moe

// MOE_CHECK(cond, code, message parts...): throws moe::Error when cond is false.
#define MOE_CHECK(cond, code, ...)                        \
  do {                                                    \
    if (!(cond)) ::moe::throw_error((code), __VA_ARGS__); \
  } while (0)
