#include "serve/stop_matcher.h"

#include <algorithm>
#include <utility>

namespace k3::serve {

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (auto& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

std::string StopMatcher::feed(std::string_view text) {
  if (matched_) return {};
  held_.append(text);
  if (stops_.empty()) return std::exchange(held_, {});
  // Every occurrence starts inside held_: text already sent had no suffix that begins a stop
  // string. The earliest occurrence wins.
  size_t first = std::string::npos;
  for (const auto& s : stops_) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    matched_ = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Keep the longest suffix that is a proper prefix of some stop string. Candidates start at a
  // copy of the stop's first byte, so ordinary text costs one scan per stop string.
  size_t keep = 0;
  for (const auto& s : stops_) {
    const size_t max_len = std::min(s.size() - 1, held_.size());
    for (size_t p = held_.size() - max_len; p < held_.size() - keep; ++p) {
      if (held_[p] != s[0]) continue;
      const size_t len = held_.size() - p;
      if (held_.compare(p, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  if (matched_) return {};
  return std::exchange(held_, {});
}

}  // namespace k3::serve
