// UTF-8 scanning for the tokenizer: well-formed sequences per the Unicode standard (table 3-7:
// no overlongs, no surrogates, nothing above U+10FFFF). Token bytes are arbitrary, so every
// caller must cope with ill-formed input; these helpers say exactly where it is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace k3::utf8 {

enum class SeqKind {
  Valid,      // a complete, well-formed sequence of `len` bytes
  Invalid,    // ill-formed: the `len` bytes at s[i] (>= 1) are a maximal subpart (table 3-8)
  Truncated,  // a well-formed prefix of `len` bytes that runs into the end of s
};
struct Seq {
  SeqKind kind;
  int len;
  uint32_t cp;  // the code point when Valid, else 0
};

// The sequence starting at s[i] (i < s.size()).
Seq next(std::string_view s, size_t i);

// True when s is entirely well-formed UTF-8.
bool valid(std::string_view s);

// Length of the longest prefix of s after which no byte can change meaning: everything but a
// trailing Truncated sequence (at most 3 bytes) that later bytes might still complete.
size_t stable_prefix(std::string_view s);

// s with every ill-formed subpart (a truncated tail included) replaced by one U+FFFD: the text
// Python's bytes.decode("utf-8", errors="replace") and tiktoken's decode give.
std::string replace_invalid(std::string_view s);

// s as UTF-16 for ICU, with every ill-formed subpart replaced by U+FFFD, plus offsets: the UTF-8
// offset of UTF-16 unit k is offsets[k]; offsets has size() + 1 entries (the last is s.size()).
struct Utf16 {
  std::u16string text;
  std::vector<uint32_t> offsets;
};
Utf16 to_utf16(std::string_view s);

// Appends the UTF-8 encoding of code point cp (which must be a scalar value).
void append(std::string& out, uint32_t cp);

}  // namespace k3::utf8
