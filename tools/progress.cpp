#include "progress.hpp"

#include <unistd.h>

#include <cmath>
#include <cstdio>

namespace moe::tools {

ProgressLine::ProgressLine(bool wanted)
    : enabled_(wanted && isatty(STDERR_FILENO) == 1), start_(std::chrono::steady_clock::now()) {}

void ProgressLine::update(const std::string& what, long done, long total, const char* unit, double estimate_s) {
  if (!enabled_) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  double left = estimate_s - elapsed;
  if (done > 0) left = elapsed / double(done) * double(total - done);
  std::fprintf(stderr, "\r\033[K%s: %ld/%ld %s, %s elapsed", what.c_str(), done, total, unit,
               format_duration(elapsed).c_str());
  if (left > 0 && done < total) std::fprintf(stderr, ", about %s left", format_duration(left).c_str());
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressLine::clear() {
  if (!drawn_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  drawn_ = false;
}

std::string format_duration(double seconds) {
  char text[64];
  if (!(seconds >= 0) || std::isinf(seconds)) return "unknown time";
  if (seconds < 10) {
    std::snprintf(text, sizeof text, "%.1f s", seconds);
  } else if (seconds < 60) {
    std::snprintf(text, sizeof text, "%.0f s", seconds);
  } else if (seconds < 3600) {
    const long s = std::lround(seconds);
    std::snprintf(text, sizeof text, "%ld min %ld s", s / 60, s % 60);
  } else {
    const long m = std::lround(seconds / 60);
    std::snprintf(text, sizeof text, "%ld h %ld min", m / 60, m % 60);
  }
  return text;
}

}  // namespace moe::tools
