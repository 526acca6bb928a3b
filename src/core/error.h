// Errors: one exception type for everything a user can cause (bad config, bad checkpoint,
// bad request) and one always-on check macro for invariants. Never `assert`.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace k3 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <typename... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}
}  // namespace detail

// Builds a message from any streamable parts: k3::fail("bad ", name, ": ", value).
template <typename... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw Error(detail::concat(std::forward<Parts>(parts)...));
}

}  // namespace k3

// Checked in every build type. The message parts are only evaluated on failure.
#define K3_CHECK(cond, ...)               \
  do {                                    \
    if (!(cond)) ::k3::fail(__VA_ARGS__); \
  } while (0)
