// Whole-file reads and writes behind checked paths. A missing file, a directory, something that is
// not a regular file, an unreadable file or an output whose directory does not exist is a
// moe::Error (kIo) naming the path and the problem, never a stream exception or a bogus size.
// Writes go to a temporary file beside the target (a name of its own, never an existing file) that
// is flushed to disk and renamed over it once complete, so a failed write leaves neither a truncated
// file nor a half-overwritten input behind. An output path may be a symbolic link (the file it
// points to is written) but not a directory, device, FIFO or socket.
// (Compiled into the library and into the CLI, which reads its JSON files through it.)
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moe::detail {

// `what` says what the file should be, e.g. "a safetensors file".
std::vector<uint8_t> read_file(const std::string& path, std::string_view what);
void write_file(const std::string& path, std::span<const uint8_t> bytes, std::string_view what);
// The checks write_file makes before writing (a regular file or none, its directory exists), for callers
// that produce the bytes slowly and should fail before the work rather than after it.
void check_output_path(const std::string& path, std::string_view what);

}  // namespace moe::detail
