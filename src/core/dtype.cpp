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

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return "float64";
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat8E4M3:
      return "float8_e4m3";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
    case DType::kInt64:
      return "int64";
    case DType::kInt32:
      return "int32";
    case DType::kUInt8:
      return "uint8";
  }
  return "unknown";
}

DType dtype_from_name(std::string_view name) {
  struct Alias {
    std::string_view name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"float64", DType::kFloat64},
      {"fp64", DType::kFloat64},
      {"float32", DType::kFloat32},
      {"fp32", DType::kFloat32},
      {"bfloat16", DType::kBFloat16},
      {"bf16", DType::kBFloat16},
      {"float16", DType::kFloat16},
      {"fp16", DType::kFloat16},
      {"float8_e4m3", DType::kFloat8E4M3},
      {"float8_e5m2", DType::kFloat8E5M2},
      {"int64", DType::kInt64},
      {"int32", DType::kInt32},
      {"uint8", DType::kUInt8},
  };
  for (const auto& a : kAliases)
    if (a.name == name) return a.dtype;
  throw_error(ErrorCode::kInvalidArgument, "unknown dtype '", name,
              "'; expected one of float64, float32, bfloat16, float16, float8_e4m3, float8_e5m2, "
              "int64, int32, uint8 (or bf16, fp16, fp32, fp64)");
}

bool is_floating(DType dtype) {
  return dtype == DType::kFloat64 || dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat16;
}

}  // namespace moe
