// A text progress bar on stderr for long jobs (synthesizing a 97 GB checkpoint).
// Silent when stderr is not a terminal unless forced, so logs and CI stay clean.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace k3 {

class ProgressBar {
 public:
  ProgressBar(std::string label, uint64_t total, bool enabled);
  ~ProgressBar();
  void advance(uint64_t n);
  void finish();

 private:
  void draw(bool final_line);
  std::string label_;
  uint64_t total_, done_ = 0;
  bool enabled_, finished_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

// True when stderr is a terminal.
bool stderr_is_tty();

}  // namespace k3
