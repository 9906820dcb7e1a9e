#include "io/file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
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

namespace {

// Where a write to `path` lands: the path itself, or the file a symbolic link at it points to (the
// link stays a link). Anything else that exists there and is not a regular file (a directory, a
// device such as /dev/null, a FIFO, a socket) is an error: renaming a file over it would replace it.
fs::path write_target(const std::string& path, std::string_view what) {
  MOE_CHECK(!path.empty(), ErrorCode::kIo, "the path of ", what, " is empty");
  std::error_code ec;
  fs::path target = path;
  if (fs::is_symlink(fs::symlink_status(target, ec))) {
    const fs::path resolved = fs::canonical(target, ec);
    MOE_CHECK(!ec, ErrorCode::kIo, "cannot write '", path, "': it is a symbolic link that leads nowhere (",
              ec.message(), "); expected the path of ", what);
    target = resolved;
  }
  const fs::file_status status = fs::status(target, ec);
  MOE_CHECK(!fs::is_directory(status), ErrorCode::kIo, "cannot write '", path,
            "': it is a directory; expected the path of ", what);
  MOE_CHECK(!fs::exists(status) || fs::is_regular_file(status), ErrorCode::kIo, "cannot write '", path,
            "': it exists and is not a regular file (a device, FIFO or socket); expected the path of ", what);
  const fs::path parent = target.parent_path();
  MOE_CHECK(parent.empty() || fs::is_directory(parent, ec), ErrorCode::kIo, "cannot write '", path,
            "': the directory '", parent.string(), "' does not exist");
  return target;
}

// A new file beside `target` with a name no other writer holds (O_EXCL), mode 0666 less the umask.
int create_temporary(const fs::path& target, std::string* name) {
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; attempt < 100; ++attempt) {
    *name = target.string() + ".partial-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    const int fd = ::open(name->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

}  // namespace

void check_output_path(const std::string& path, std::string_view what) { (void)write_target(path, what); }

void write_file(const std::string& path, std::span<const uint8_t> bytes, std::string_view what) {
  const fs::path target = write_target(path, what);
  std::string partial;
  const int fd = create_temporary(target, &partial);
  MOE_CHECK(fd >= 0, ErrorCode::kIo, "cannot write '", path, "': ", std::strerror(errno));
  std::error_code ec;
  const auto fail = [&](const std::string& reason) {
    ::close(fd);
    fs::remove(partial, ec);
    throw_error(ErrorCode::kIo, "writing '", path, "' failed: ", reason);
  };
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n < 0 ? std::strerror(errno) : "no progress");
    done += size_t(n);
  }
  // On disk before it replaces the old file, so a crash leaves the old or the new one whole.
  if (::fsync(fd) != 0) fail(std::strerror(errno));
  if (::close(fd) != 0) {
    const std::string reason = std::strerror(errno);
    fs::remove(partial, ec);
    throw_error(ErrorCode::kIo, "writing '", path, "' failed: ", reason);
  }
  fs::rename(partial, target, ec);
  if (ec) {
    const std::string reason = ec.message();
    fs::remove(partial, ec);
    throw_error(ErrorCode::kIo, "cannot write '", path, "': ", reason);
  }
}

}  // namespace moe::detail
