#include "text/utf8.h"

#include "core/error.h"

namespace k3::utf8 {

Seq next(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  if (c < 0x80) return {SeqKind::Valid, 1, c};
  // Lead byte -> sequence length and the allowed range of the second byte (table 3-7); the
  // narrowed ranges after E0, ED, F0 and F4 exclude overlongs, surrogates and > U+10FFFF.
  int len;
  uint8_t lo = 0x80, hi = 0xBF;
  uint32_t cp;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2, cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3, cp = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4, cp = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return {SeqKind::Invalid, 1, 0};
  }
  for (int k = 1; k < len; ++k) {
    if (i + k >= s.size()) return {SeqKind::Truncated, k, 0};
    const uint8_t t = b(i + k);
    // The well-formed bytes before the bad one are one "maximal subpart" (what a decoder that
    // replaces errors turns into one U+FFFD, like Python's errors="replace").
    if (t < (k == 1 ? lo : 0x80) || t > (k == 1 ? hi : 0xBF)) return {SeqKind::Invalid, k, 0};
    cp = (cp << 6) | (t & 0x3F);
  }
  return {SeqKind::Valid, len, cp};
}

bool valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const Seq q = next(s, i);
    if (q.kind != SeqKind::Valid) return false;
    i += q.len;
  }
  return true;
}

size_t stable_prefix(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const Seq q = next(s, i);
    if (q.kind == SeqKind::Truncated) return i;
    i += q.len;
  }
  return s.size();
}

Utf16 to_utf16(std::string_view s) {
  K3_CHECK(s.size() < (1ull << 32), "text of ", s.size(), " bytes is too long to tokenize");
  Utf16 r;
  r.text.reserve(s.size());
  r.offsets.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size();) {
    const Seq q = next(s, i);
    const auto at = static_cast<uint32_t>(i);
    if (q.kind != SeqKind::Valid) {
      r.text.push_back(u'\uFFFD');  // a stand-in for the regex; the pieces keep the bytes
      r.offsets.push_back(at);
      i += q.len;
      continue;
    }
    if (q.cp >= 0x10000) {  // surrogate pair: both units map to the sequence start
      r.text.push_back(static_cast<char16_t>(0xD800 + ((q.cp - 0x10000) >> 10)));
      r.text.push_back(static_cast<char16_t>(0xDC00 + ((q.cp - 0x10000) & 0x3FF)));
      r.offsets.push_back(at);
      r.offsets.push_back(at);
    } else {
      r.text.push_back(static_cast<char16_t>(q.cp));
      r.offsets.push_back(at);
    }
    i += q.len;
  }
  r.offsets.push_back(static_cast<uint32_t>(s.size()));
  return r;
}

std::string replace_invalid(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const Seq q = next(s, i);
    if (q.kind == SeqKind::Valid)
      out.append(s.substr(i, q.len));
    else
      out += "\xEF\xBF\xBD";  // U+FFFD
    i += q.len;
  }
  return out;
}

void append(std::string& out, uint32_t cp) {
  K3_CHECK(cp <= 0x10FFFF && (cp < 0xD800 || cp > 0xDFFF), "internal: U+", cp,
           " is not a scalar value");
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace k3::utf8
