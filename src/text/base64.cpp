#include "text/base64.h"

#include <algorithm>
#include <array>
#include <cstdint>

namespace k3 {
namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// 6-bit value of each byte, -1 for bytes outside the alphabet.
constexpr std::array<int8_t, 256> make_values() {
  std::array<int8_t, 256> v{};
  for (auto& x : v) x = -1;
  for (int i = 0; i < 64; ++i) v[static_cast<uint8_t>(kAlphabet[i])] = static_cast<int8_t>(i);
  return v;
}
constexpr std::array<int8_t, 256> kValues = make_values();

}  // namespace

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t w = 0;
    for (size_t k = 0; k < 3; ++k) w = (w << 8) | (k < n ? static_cast<uint8_t>(bytes[i + k]) : 0u);
    for (size_t k = 0; k < 4; ++k)
      out.push_back(k <= n ? kAlphabet[(w >> (18 - 6 * k)) & 63] : '=');
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view s) {
  if (s.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(s.size() / 4 * 3);
  for (size_t i = 0; i < s.size(); i += 4) {
    const bool last = i + 4 == s.size();
    size_t pad = 0;
    uint32_t w = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char c = s[i + k];
      if (c == '=' && last && k >= 2) {
        ++pad;
        w <<= 6;
        continue;
      }
      const int8_t v = kValues[static_cast<uint8_t>(c)];
      if (v < 0 || pad > 0) return std::nullopt;  // not base64, or data after padding
      w = (w << 6) | static_cast<uint32_t>(v);
    }
    // Canonical form only: the bits dropped by padding must be zero.
    if ((pad == 1 && (w & 0xFF) != 0) || (pad == 2 && (w & 0xFFFF) != 0)) return std::nullopt;
    for (size_t k = 0; k < 3 - pad; ++k)
      out.push_back(static_cast<char>((w >> (16 - 8 * k)) & 0xFF));
  }
  return out;
}

}  // namespace k3
