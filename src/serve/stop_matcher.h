// Stop strings on streamed text. Text that might be the start of a stop string is held back,
// so a client never receives part of a stop string that the next token completes.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace k3::serve {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops = {});
  // Appends generated text; returns the part that is now safe to send. Once a stop string
  // appears, returns the text before it, sets matched(), and ignores everything after.
  std::string feed(std::string_view text);
  // The held tail at the end of generation (no stop string completed).
  std::string flush();
  bool matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;  // non-empty strings
  std::string held_;
  bool matched_ = false;
};

}  // namespace k3::serve
