// safetensors: round trips, files from an independent (hand-written) encoder, every malformation
// the reader must reject with a clear error, and seeded random mutations that must never crash.
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "test_support.hpp"

namespace moe::test {
namespace {

// An independent encoder: the header text is written by hand, not by our serializer.
std::vector<uint8_t> raw_file(const std::string& header, const std::vector<uint8_t>& data,
                              uint64_t header_length_override = UINT64_MAX) {
  std::vector<uint8_t> out(8 + header.size() + data.size());
  uint64_t n = header_length_override == UINT64_MAX ? header.size() : header_length_override;
  for (int i = 0; i < 8; ++i, n >>= 8) out[size_t(i)] = uint8_t(n & 0xff);
  for (size_t i = 0; i < header.size(); ++i) out[8 + i] = uint8_t(header[i]);
  for (size_t i = 0; i < data.size(); ++i) out[8 + header.size() + i] = data[i];
  return out;
}

std::vector<uint8_t> floats_bytes(std::initializer_list<float> v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), std::data(v), b.size());
  return b;
}

// Parsing must throw a moe::Error with code kIo whose message contains `phrase`.
void expect_rejected(const std::vector<uint8_t>& bytes, const std::string& phrase) {
  try {
    SafetensorsFile::parse(bytes, "case.safetensors");
    ADD_FAILURE() << "accepted a malformed file; expected: " << phrase;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
    EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("case.safetensors"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, RoundTripKeepsTensorsMetadataAndOrder) {
  Rng rng;
  Tensor a = random_tensor({3, 5, 7}, DType::kBFloat16, rng);
  Tensor b = random_tensor({11}, DType::kFloat32, rng);
  Tensor c = Tensor::empty({2, 2}, DType::kInt64);
  for (int i = 0; i < 4; ++i) c.data_as<int64_t>()[i] = rng.integer(-1000000, 1000000);
  Tensor empty = Tensor::empty({0, 4}, DType::kFloat16);
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "round \"trip\""}};
  const std::vector<uint8_t> bytes = serialize_safetensors(
      {safetensors_record("layer.weight", a), safetensors_record("b", b), safetensors_record("c", c),
       safetensors_record("empty", empty)},
      meta);
  EXPECT_EQ((bytes.size() - 8 - a.nbytes() - b.nbytes() - c.nbytes()) % 8, 0u) << "header padded to 8";
  const SafetensorsFile f = SafetensorsFile::parse(bytes);
  EXPECT_EQ(f.metadata(), meta);
  ASSERT_EQ(f.entries().size(), 4u);
  EXPECT_EQ(f.entries()[0].name, "layer.weight");
  EXPECT_EQ(f.at("layer.weight").dtype, "BF16");
  EXPECT_EQ(f.at("layer.weight").shape, (std::vector<int64_t>{3, 5, 7}));
  EXPECT_EQ(f.at("empty").shape, (std::vector<int64_t>{0, 4}));
  for (const auto& [name, t] : std::vector<std::pair<std::string, Tensor>>{{"layer.weight", a}, {"b", b}, {"c", c}, {"empty", empty}}) {
    const Tensor back = f.tensor(name);
    EXPECT_EQ(back.dtype(), t.dtype()) << name;
    EXPECT_EQ(back.view().shape(), t.view().shape()) << name;
    EXPECT_EQ(std::memcmp(back.data(), t.data(), t.view().nbytes()), 0) << name;
  }
  // Through a file on disk, too.
  const std::string path = (std::filesystem::temp_directory_path() / "moe_engine_test_rt.safetensors").string();
  save_safetensors(path, {safetensors_record("b", b)});
  const SafetensorsFile g = SafetensorsFile::load(path);
  EXPECT_TRUE(g.metadata().empty());
  EXPECT_EQ(std::memcmp(g.tensor("b").data(), b.data(), b.view().nbytes()), 0);
  std::filesystem::remove(path);
}

TEST(Safetensors, ReadsAFileFromAnIndependentEncoder) {
  // Keys out of data order, spaces padding the header, a dtype moe-engine has no tensor type for.
  const std::string header =
      R"({"second":{"dtype":"I16","shape":[2],"data_offsets":[8,12]},)"
      R"("__metadata__":{"format":"pt"},"first":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})"
      "    ";
  std::vector<uint8_t> data = floats_bytes({1.5f, -2.25f});
  data.insert(data.end(), {0x01, 0x00, 0xff, 0xff});
  const SafetensorsFile f = SafetensorsFile::parse(raw_file(header, data));
  ASSERT_EQ(f.entries().size(), 2u);
  EXPECT_EQ(f.entries()[0].name, "first");  // data-section order
  const Tensor first = f.tensor("first");
  EXPECT_EQ(first.data_as<float>()[0], 1.5f);
  EXPECT_EQ(first.data_as<float>()[1], -2.25f);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const auto raw = f.bytes(f.at("second"));
  EXPECT_EQ(std::vector<uint8_t>(raw.begin(), raw.end()), (std::vector<uint8_t>{0x01, 0x00, 0xff, 0xff}));
  EXPECT_THROW(f.tensor("second"), Error);  // I16 has no moe-engine dtype: raw bytes only
  EXPECT_THROW(f.at("third"), Error);
  // No tensors at all is a valid file.
  EXPECT_TRUE(SafetensorsFile::parse(raw_file("{}", {})).entries().empty());
}

TEST(Safetensors, RejectsMalformedFiles) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::vector<uint8_t> two = floats_bytes({1.f, 2.f});
  expect_rejected({}, "fewer than the 8-byte header length");
  expect_rejected({1, 2, 3}, "fewer than the 8-byte header length");
  expect_rejected(raw_file(ok, two, ok.size() + 100), "runs past the end of the file");
  expect_rejected(raw_file(ok, two, uint64_t(1) << 63), "exceeds the limit");
  std::vector<uint8_t> truncated = raw_file(ok, two);
  truncated.resize(truncated.size() - 3);
  expect_rejected(truncated, "ends at byte 8 of a 5-byte data section");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32",)", two), "not valid JSON");
  expect_rejected(raw_file("[1, 2]", {}), "not a JSON object");
  expect_rejected(raw_file(R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", two), "unknown dtype");
  expect_rejected(raw_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", two), "no dtype");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", two), "no shape");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", two), "non-negative");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", two), "no data_offsets");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", two), "run backwards");
  expect_rejected(raw_file(R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}})", two), "need 16");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})", two),
                  "overflows");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", two),
                  "overlap");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", two), "belong to no tensor");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", two), "belong to no tensor");
  expect_rejected(raw_file(R"({"__metadata__":{"k":1}})", {}), "is not a string");
  expect_rejected(raw_file(R"({"a":3})", {}), "is not an object");
  // A repeated key is named, not reported as the bytes its lost twin leaves without a tensor.
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", two),
                  "duplicate tensor name 'a'");
  expect_rejected(raw_file(R"({"__metadata__":{"k":"1"},"__metadata__":{"k":"2"}})", {}), "__metadata__ appears twice");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","dtype":"F64","shape":[2],"data_offsets":[0,8]}})", two),
                  "duplicate key 'dtype' inside 'a'");
  expect_rejected(raw_file(R"({"__metadata__":{"k":"1","k":"2"}})", {}), "duplicate key 'k' inside '__metadata__'");
}

// Paths that are not readable regular files are io errors naming the path and the problem (a
// directory once aborted the process through a huge allocation); writes never leave a partial file,
// never touch a file of another name, and never replace what is not a regular file.
TEST(Safetensors, LoadAndSaveCheckTheirPaths) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("moe_engine_paths_" + std::to_string(test_seed()));
  fs::create_directories(dir);
  EXPECT_MOE_ERROR(SafetensorsFile::load(dir.string()), ErrorCode::kIo, "is a directory; expected a safetensors file");
  EXPECT_MOE_ERROR(SafetensorsFile::load((dir / "missing.safetensors").string()), ErrorCode::kIo, "no such file");
  EXPECT_MOE_ERROR(SafetensorsFile::load(""), ErrorCode::kIo, "is empty");
  EXPECT_MOE_ERROR(SafetensorsFile::load("/dev/null"), ErrorCode::kIo, "is not a regular file");
  const Tensor t = Tensor::zeros({4}, DType::kFloat32);
  const std::vector<SafetensorsRecord> records = {safetensors_record("t", t)};
  EXPECT_MOE_ERROR(save_safetensors(dir.string(), records), ErrorCode::kIo, "it is a directory");
  EXPECT_MOE_ERROR(save_safetensors((dir / "no" / "x.safetensors").string(), records), ErrorCode::kIo,
                   "the directory '" + (dir / "no").string() + "' does not exist");
  const std::string path = (dir / "x.safetensors").string();
  // A file of the name the temporary once had is someone else's: left alone.
  { std::ofstream(path + ".partial") << "keep"; }
  save_safetensors(path, records);
  EXPECT_EQ(SafetensorsFile::load(path).at("t").shape, (std::vector<int64_t>{4}));
  std::ifstream kept(path + ".partial");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "keep");
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().filename().string().find(".partial-"), std::string::npos) << entry.path();
  // Something that is not a regular file is never replaced (a FIFO here; /dev/null, a device, was
  // once renamed over): an error, the FIFO still there.
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_MOE_ERROR(save_safetensors(fifo, records), ErrorCode::kIo, "it exists and is not a regular file");
  EXPECT_TRUE(fs::is_fifo(fs::symlink_status(fifo)));
  // A symbolic link: the file it points to is written, the link stays.
  const fs::path link = dir / "link.safetensors", target = dir / "target.safetensors";
  fs::create_symlink(target, link);
  EXPECT_MOE_ERROR(save_safetensors(link.string(), records), ErrorCode::kIo, "symbolic link that leads nowhere");
  { std::ofstream(target) << "old"; }
  save_safetensors(link.string(), records);
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(link)));
  EXPECT_EQ(SafetensorsFile::load(target.string()).at("t").shape, (std::vector<int64_t>{4}));
  fs::remove_all(dir);
}

TEST(Safetensors, WriterRejectsInconsistentRecords) {
  Tensor t = Tensor::zeros({4}, DType::kFloat32);
  SafetensorsRecord r = safetensors_record("t", t);
  EXPECT_THROW(serialize_safetensors({r, r}), Error);  // duplicate name
  SafetensorsRecord bad = r;
  bad.shape = {5};
  EXPECT_THROW(serialize_safetensors({bad}), Error);  // bytes do not match the shape
  bad = r;
  bad.dtype = "Q4";
  EXPECT_THROW(serialize_safetensors({bad}), Error);
  bad = r;
  bad.name = "__metadata__";
  EXPECT_THROW(serialize_safetensors({bad}), Error);
}

// Seeded mutations of a valid file (byte flips, truncations, length edits): each parse succeeds or
// throws moe::Error; a crash or an out-of-bounds read (under sanitizers) fails the test.
TEST(Safetensors, MutatedFilesNeverCrash) {
  Rng rng;
  Tensor a = random_tensor({4, 3}, DType::kBFloat16, rng);
  Tensor b = random_tensor({5}, DType::kFloat32, rng);
  const std::vector<uint8_t> valid =
      serialize_safetensors({safetensors_record("a", a), safetensors_record("b", b)}, {{"k", "v"}});
  int accepted = 0, rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<uint8_t> m = valid;
    const int edits = int(rng.integer(1, 4));
    for (int e = 0; e < edits; ++e) {
      switch (rng.integer(0, 3)) {
        case 0: m[size_t(rng.integer(0, int64_t(m.size()) - 1))] = uint8_t(rng.integer(0, 255)); break;
        case 1: m.resize(size_t(rng.integer(0, int64_t(m.size())))); break;
        case 2: if (m.size() >= 8) m[size_t(rng.integer(0, 7))] ^= uint8_t(1u << rng.integer(0, 7)); break;
        default: m.insert(m.begin() + int64_t(rng.integer(0, int64_t(m.size()))), uint8_t(rng.integer(0, 255)));
      }
      if (m.empty()) break;
    }
    try {
      const SafetensorsFile f = SafetensorsFile::parse(m);
      for (const SafetensorsEntry& e : f.entries()) {
        const auto bytes = f.bytes(e);
        volatile uint8_t sink = 0;
        for (uint8_t x : bytes) sink = sink ^ x;  // touch every byte the reader hands out
      }
      ++accepted;
    } catch (const Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 0);
  RecordProperty("accepted", accepted);
}

}  // namespace
}  // namespace moe::test
