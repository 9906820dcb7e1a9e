// safetensors reading (validated) and writing; see moe_engine/safetensors.hpp.
#include "moe_engine/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "io/file.hpp"
#include "moe_engine/error.hpp"

namespace moe {
namespace {

// The reference implementation's limit; also keeps a hostile length from allocating gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeInfo {
  const char* name;
  size_t size;
  std::optional<DType> dtype;
};

constexpr DTypeInfo kDTypes[] = {
    {"BOOL", 1, std::nullopt},         {"U8", 1, DType::kUInt8},
    {"I8", 1, std::nullopt},           {"I16", 2, std::nullopt},
    {"U16", 2, std::nullopt},          {"F16", 2, DType::kFloat16},
    {"BF16", 2, DType::kBFloat16},     {"I32", 4, DType::kInt32},
    {"U32", 4, std::nullopt},          {"F32", 4, DType::kFloat32},
    {"F64", 8, DType::kFloat64},       {"I64", 8, DType::kInt64},
    {"U64", 8, std::nullopt},          {"F8_E4M3", 1, DType::kFloat8E4M3},
    {"F8_E5M2", 1, DType::kFloat8E5M2},
};

const DTypeInfo* dtype_info(std::string_view name) {
  for (const DTypeInfo& d : kDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

// a * b, or nullopt on overflow of uint64.
std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b) {
  if (a != 0 && b > UINT64_MAX / a) return std::nullopt;
  return a * b;
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

size_t safetensors_dtype_size(std::string_view dtype) {
  const DTypeInfo* d = dtype_info(dtype);
  return d ? d->size : 0;
}

std::optional<DType> dtype_from_safetensors(std::string_view dtype) {
  const DTypeInfo* d = dtype_info(dtype);
  return d ? d->dtype : std::nullopt;
}

const char* safetensors_dtype(DType dtype) {
  for (const DTypeInfo& d : kDTypes)
    if (d.dtype == dtype) return d.name;
  throw_error(ErrorCode::kDType, "safetensors has no dtype for ", dtype_name(dtype));
}

SafetensorsFile SafetensorsFile::load(const std::string& path) {
  return parse(detail::read_file(path, "a safetensors file"), path);
}

SafetensorsFile SafetensorsFile::parse(std::vector<uint8_t> bytes, std::string source) {
  SafetensorsFile f;
  f.source_ = std::move(source);
  auto fail = [&](const auto&... what) -> void {
    throw_error(ErrorCode::kIo, f.source_, ": not a valid safetensors file: ", what...);
  };
  f.file_ = std::move(bytes);
  const uint64_t size = f.file_.size();
  if (size < 8) fail("it has ", size, " bytes, fewer than the 8-byte header length");
  const uint64_t header_bytes = read_u64_le(f.file_.data());
  if (header_bytes > kMaxHeaderBytes)
    fail("header length ", header_bytes, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  if (header_bytes > size - 8)
    fail("header length ", header_bytes, " runs past the end of the file (", size - 8,
         " bytes after the length)");
  f.data_start_ = 8 + header_bytes;
  const uint64_t data_bytes = size - f.data_start_;

  const char* text = reinterpret_cast<const char*>(f.file_.data() + 8);
  // JSON parsers keep the last of two equal keys; here a repeated key is an error of its own (a
  // tensor named twice would otherwise surface as bytes that belong to no tensor).
  std::vector<std::set<std::string>> keys_of_open_objects;
  std::string entry, duplicate;
  const auto find_duplicates = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) keys_of_open_objects.emplace_back();
    if (event == Event::object_end && !keys_of_open_objects.empty()) keys_of_open_objects.pop_back();
    if (event == Event::key && !keys_of_open_objects.empty() && parsed.is_string()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (depth == 1) entry = key;
      if (!keys_of_open_objects.back().insert(key).second && duplicate.empty())
        duplicate = depth == 1 ? (key == "__metadata__" ? "__metadata__ appears twice" : "duplicate tensor name '" + key + "'")
                               : "duplicate key '" + key + "' inside '" + entry + "'";
    }
    return true;
  };
  nlohmann::json header = nlohmann::json::parse(text, text + header_bytes, find_duplicates, false);
  if (header.is_discarded()) fail("the header is not valid JSON");
  if (!duplicate.empty()) fail(duplicate);
  if (!header.is_object()) fail("the header is not a JSON object");

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail("__metadata__[\"", m.key(), "\"] is not a string");
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) fail("the entry of '", name, "' is not an object");
    SafetensorsEntry e;
    e.name = name;
    if (!v.contains("dtype") || !v["dtype"].is_string()) fail("'", name, "' has no dtype string");
    e.dtype = v["dtype"].get<std::string>();
    const DTypeInfo* d = dtype_info(e.dtype);
    if (!d) fail("'", name, "' has the unknown dtype \"", e.dtype, "\"");
    if (!v.contains("shape") || !v["shape"].is_array()) fail("'", name, "' has no shape array");
    uint64_t numel = 1;
    for (const nlohmann::json& x : v["shape"]) {
      if (!x.is_number_unsigned() && !(x.is_number_integer() && x.get<int64_t>() >= 0))
        fail("'", name, "' has a shape entry that is not a non-negative integer");
      const uint64_t extent = x.get<uint64_t>();
      if (extent > uint64_t(INT64_MAX)) fail("'", name, "' has an extent past 2^63");
      const std::optional<uint64_t> n = checked_mul(numel, extent);
      if (!n) fail("'", name, "' has a shape whose element count overflows");
      numel = *n;
      e.shape.push_back(int64_t(extent));
    }
    const nlohmann::json& o = v.contains("data_offsets") ? v["data_offsets"] : nlohmann::json();
    if (!o.is_array() || o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned())
      fail("'", name, "' has no data_offsets pair of non-negative integers");
    e.begin = o[0].get<uint64_t>();
    e.end = o[1].get<uint64_t>();
    if (e.begin > e.end) fail("'", name, "' has data_offsets [", e.begin, ", ", e.end, "] that run backwards");
    if (e.end > data_bytes)
      fail("'", name, "' ends at byte ", e.end, " of a ", data_bytes, "-byte data section");
    const std::optional<uint64_t> expected = checked_mul(numel, d->size);
    if (!expected || *expected != e.end - e.begin)
      fail("'", name, "' holds ", e.end - e.begin, " bytes, but ", numel, " elements of ", e.dtype,
           " need ", expected ? std::to_string(*expected) : std::string("more than 2^64"));
    f.entries_.push_back(std::move(e));
  }
  // The byte ranges must tile the data section in order: no overlap, no hole.
  std::sort(f.entries_.begin(), f.entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  for (const SafetensorsEntry& e : f.entries_) {
    if (e.begin < cursor) fail("the bytes of '", e.name, "' overlap those of the tensor before it");
    if (e.begin > cursor) fail("bytes [", cursor, ", ", e.begin, ") of the data section belong to no tensor");
    cursor = e.end;
  }
  if (cursor != data_bytes)
    fail("bytes [", cursor, ", ", data_bytes, ") of the data section belong to no tensor");
  return f;
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  for (const SafetensorsEntry& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

const SafetensorsEntry& SafetensorsFile::at(std::string_view name) const {
  const SafetensorsEntry* e = find(name);
  MOE_CHECK(e != nullptr, ErrorCode::kIo, source_, ": no tensor named '", name, "'");
  return *e;
}

std::span<const uint8_t> SafetensorsFile::bytes(const SafetensorsEntry& e) const {
  return {file_.data() + data_start_ + e.begin, size_t(e.end - e.begin)};
}

Tensor SafetensorsFile::tensor(std::string_view name) const {
  const SafetensorsEntry& e = at(name);
  const std::optional<DType> dtype = dtype_from_safetensors(e.dtype);
  MOE_CHECK(dtype.has_value(), ErrorCode::kDType, source_, ": '", name, "' has dtype ", e.dtype,
            ", which moe-engine tensors do not have");
  MOE_CHECK(int(e.shape.size()) <= kMaxDims, ErrorCode::kShape, source_, ": '", name, "' has rank ",
            e.shape.size(), "; moe-engine tensors have at most ", kMaxDims, " dimensions");
  Tensor t = Tensor::empty(Shape(e.shape.begin(), e.shape.end()), *dtype);
  const std::span<const uint8_t> b = bytes(e);
  if (!b.empty()) std::memcpy(t.data(), b.data(), b.size());
  return t;
}

SafetensorsRecord safetensors_record(std::string name, const TensorView& tensor) {
  MOE_CHECK(tensor.defined() && tensor.device().is_cpu(), ErrorCode::kDevice, "safetensors: '", name,
            "' must be a CPU tensor, got ", tensor.describe());
  MOE_CHECK(tensor.is_contiguous(), ErrorCode::kShape, "safetensors: '", name, "' must be contiguous");
  SafetensorsRecord r;
  r.name = std::move(name);
  r.dtype = safetensors_dtype(tensor.dtype());
  r.shape.assign(tensor.shape().begin(), tensor.shape().end());
  r.data = {static_cast<const uint8_t*>(tensor.data()), tensor.nbytes()};
  return r;
}

std::vector<uint8_t> serialize_safetensors(const std::vector<SafetensorsRecord>& records,
                                           const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const SafetensorsRecord& r : records) {
    MOE_CHECK(r.name != "__metadata__" && !r.name.empty(), ErrorCode::kInvalidArgument,
              "safetensors: '", r.name, "' is not a usable tensor name");
    MOE_CHECK(names.insert(r.name).second, ErrorCode::kInvalidArgument, "safetensors: the name '",
              r.name, "' appears twice");
    const size_t element = safetensors_dtype_size(r.dtype);
    MOE_CHECK(element != 0, ErrorCode::kDType, "safetensors: '", r.name, "' has the unknown dtype ", r.dtype);
    uint64_t numel = 1;
    for (int64_t x : r.shape) {
      MOE_CHECK(x >= 0, ErrorCode::kShape, "safetensors: '", r.name, "' has a negative extent");
      numel *= uint64_t(x);
    }
    MOE_CHECK(numel * element == r.data.size(), ErrorCode::kShape, "safetensors: '", r.name, "' has ",
              r.data.size(), " bytes of data for ", numel, " elements of ", r.dtype);
    header[r.name] = {{"dtype", r.dtype}, {"shape", r.shape}, {"data_offsets", {offset, offset + r.data.size()}}};
    offset += r.data.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::vector<uint8_t> out(8 + text.size() + offset);
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out[size_t(i)] = uint8_t(n & 0xff);
  std::memcpy(out.data() + 8, text.data(), text.size());
  uint8_t* data = out.data() + 8 + text.size();
  for (const SafetensorsRecord& r : records) {
    if (!r.data.empty()) std::memcpy(data, r.data.data(), r.data.size());
    data += r.data.size();
  }
  return out;
}

void save_safetensors(const std::string& path, const std::vector<SafetensorsRecord>& records,
                      const std::map<std::string, std::string>& metadata) {
  detail::write_file(path, serialize_safetensors(records, metadata), "a safetensors file");
}

}  // namespace moe
