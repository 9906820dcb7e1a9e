#include "moe_engine/dtype.hpp"

#include "moe_engine/error.hpp"

namespace moe {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return 8;
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat16:
      return 2;
    case DType::kFloat8E4M3:
      return 1;
    case DType::kFloat8E5M2:
      return 1;
    case DType::kInt64:
      return 8;
    case DType::kInt32:
      return 4;
    case DType::kUInt8:
      return 1;
  }
  throw_error(ErrorCode::kInternal, "unknown dtype ", int(dtype));
}

bool is_floating(DType dtype) {
  return dtype == DType::kFloat64 || dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat16;
}

}  // namespace moe
