// safetensors files (https://github.com/huggingface/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON header {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}, then the data section the offsets index into.
//
// Reading validates everything before any tensor is touched: the header length against the file,
// the JSON, every dtype, shape and byte range (sizes must match, ranges must tile the data section
// without overlaps or holes), so a malformed file is a moe::Error (kIo) naming the problem, never a
// crash or an out-of-bounds read. Tensors of any safetensors dtype are kept as raw bytes, so tools
// can copy what they do not compute with unchanged.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe_engine/dtype.hpp"
#include "moe_engine/export.hpp"
#include "moe_engine/tensor.hpp"

namespace moe {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;           // the file's dtype string: "BF16", "F32", "I64", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section
};

class MOE_API SafetensorsFile {
 public:
  // Reads and validates a whole file (`source` names it in error messages).
  static SafetensorsFile load(const std::string& path);
  static SafetensorsFile parse(std::vector<uint8_t> bytes, std::string source = "<memory>");

  const std::string& source() const { return source_; }
  // In data-section order.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry* find(std::string_view name) const;
  const SafetensorsEntry& at(std::string_view name) const;  // throws kIo if absent
  std::span<const uint8_t> bytes(const SafetensorsEntry& entry) const;
  // A CPU copy of a tensor whose dtype moe-engine has (see dtype_from_safetensors).
  Tensor tensor(std::string_view name) const;

 private:
  std::string source_;
  std::vector<uint8_t> file_;
  uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: raw bytes in the given safetensors dtype (row-major, little-endian).
struct SafetensorsRecord {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> data;
};

// A record viewing a contiguous CPU tensor (the tensor must outlive the record).
MOE_API SafetensorsRecord safetensors_record(std::string name, const TensorView& tensor);

// The file bytes for `records` (written in the given order) and `metadata`; the header is padded
// with spaces to a multiple of 8 bytes. Names must be unique and not "__metadata__".
MOE_API std::vector<uint8_t> serialize_safetensors(const std::vector<SafetensorsRecord>& records,
                                                   const std::map<std::string, std::string>& metadata = {});
MOE_API void save_safetensors(const std::string& path, const std::vector<SafetensorsRecord>& records,
                              const std::map<std::string, std::string>& metadata = {});

// Bytes per element of a safetensors dtype string; 0 if it is not one this library knows.
MOE_API size_t safetensors_dtype_size(std::string_view dtype);
// The moe-engine dtype of a safetensors dtype string, if there is one, and back.
MOE_API std::optional<DType> dtype_from_safetensors(std::string_view dtype);
MOE_API const char* safetensors_dtype(DType dtype);

}  // namespace moe
