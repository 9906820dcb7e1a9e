#include "io/file.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "moe_engine/error.hpp"

namespace moe::detail {
namespace fs = std::filesystem;

std::vector<uint8_t> read_file(const std::string& path, std::string_view what) {
  MOE_CHECK(!path.empty(), ErrorCode::kIo, "the path of ", what, " is empty");
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  MOE_CHECK(fs::exists(status), ErrorCode::kIo, "cannot open '", path, "': no such file (expected ", what, ")");
  MOE_CHECK(!fs::is_directory(status), ErrorCode::kIo, "'", path, "' is a directory; expected ", what);
  MOE_CHECK(fs::is_regular_file(status), ErrorCode::kIo, "'", path, "' is not a regular file; expected ", what);
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.is_open(), ErrorCode::kIo, "cannot open '", path, "': ", std::strerror(errno));
  const uintmax_t size = fs::file_size(path, ec);
  MOE_CHECK(!ec, ErrorCode::kIo, "cannot read the size of '", path, "': ", ec.message());
  std::vector<uint8_t> bytes(size);
  if (size > 0) in.read(reinterpret_cast<char*>(bytes.data()), std::streamsize(size));
  MOE_CHECK(size == 0 || (in.good() && uintmax_t(in.gcount()) == size), ErrorCode::kIo, "cannot read '", path,
            "': ", in.bad() ? std::strerror(errno) : "the file ended early (it changed while being read?)");
  return bytes;
}

void check_output_path(const std::string& path, std::string_view what) {
  MOE_CHECK(!path.empty(), ErrorCode::kIo, "the path of ", what, " is empty");
  std::error_code ec;
  MOE_CHECK(!fs::is_directory(path, ec), ErrorCode::kIo, "cannot write '", path, "': it is a directory; expected the path of ",
            what);
  const fs::path parent = fs::path(path).parent_path();
  MOE_CHECK(parent.empty() || fs::is_directory(parent, ec), ErrorCode::kIo, "cannot write '", path, "': the directory '",
            parent.string(), "' does not exist");
}

void write_file(const std::string& path, std::span<const uint8_t> bytes, std::string_view what) {
  check_output_path(path, what);
  std::error_code ec;
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    MOE_CHECK(out.is_open(), ErrorCode::kIo, "cannot write '", path, "': ", std::strerror(errno));
    out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    out.close();
    if (!out.good()) {
      const std::string reason = std::strerror(errno);
      fs::remove(partial, ec);
      throw_error(ErrorCode::kIo, "writing '", path, "' failed: ", reason);
    }
  }
  fs::rename(partial, path, ec);
  if (ec) {
    const std::string reason = ec.message();
    fs::remove(partial, ec);
    throw_error(ErrorCode::kIo, "cannot write '", path, "': ", reason);
  }
}

}  // namespace moe::detail
