// Progress of a long benchmark for a person watching: one line on stderr, redrawn in place. It is
// drawn only when stderr is a terminal and the output is not JSON; on pipes, in logs and with
// --json every call does nothing, so captured output holds results only.
#pragma once

#include <chrono>
#include <string>

namespace moe::tools {

class ProgressLine {
 public:
  // `wanted`: the command prints for people (not --json).
  explicit ProgressLine(bool wanted);
  ~ProgressLine() { clear(); }
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  bool enabled() const { return enabled_; }
  // "<what>: <done>/<total> <unit>, <elapsed> elapsed, about <left> left" (time left from the
  // rate so far, or from `estimate_s` of the whole job before anything is done).
  void update(const std::string& what, long done, long total, const char* unit, double estimate_s = 0);
  // Erases the line (before a result line goes to the terminal).
  void clear();

 private:
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_;
};

// "0.4 s", "45 s", "3 min 20 s", "1 h 10 min".
std::string format_duration(double seconds);

}  // namespace moe::tools
