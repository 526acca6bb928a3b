#include "core/progress.h"

#include <unistd.h>

#include <cstdio>

namespace k3 {

bool stderr_is_tty() {
  return isatty(STDERR_FILENO) == 1;
}

ProgressBar::ProgressBar(std::string label, uint64_t total, bool enabled)
    : label_(std::move(label)), total_(total ? total : 1), enabled_(enabled) {
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

ProgressBar::~ProgressBar() {
  finish();
}

void ProgressBar::advance(uint64_t n) {
  done_ += n;
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ > std::chrono::milliseconds(200)) {
    last_draw_ = now;
    draw(false);
  }
}

void ProgressBar::finish() {
  if (finished_) return;
  finished_ = true;
  if (enabled_) draw(true);
}

void ProgressBar::draw(bool final_line) {
  const double frac = done_ > total_ ? 1.0 : static_cast<double>(done_) / total_;
  const int width = 30;
  const int filled = static_cast<int>(frac * width);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double gb = done_ / 1e9;
  std::fprintf(stderr, "\r%s [", label_.c_str());
  for (int i = 0; i < width; ++i) std::fputc(i < filled ? '#' : '.', stderr);
  std::fprintf(stderr, "] %5.1f%%  %.2f GB  %.0f MB/s", frac * 100.0, gb,
               secs > 0 ? done_ / 1e6 / secs : 0.0);
  if (final_line) std::fputc('\n', stderr);
  std::fflush(stderr);
}

}  // namespace k3
