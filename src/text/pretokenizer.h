// Kimi's pre-tokenizer: the text is cut into chunks the way tokenization_kimi.py cuts it before
// calling tiktoken, and each chunk into pieces by Kimi's regex (ICU, which implements the
// `[...&&[...]]` class intersection and a Unicode `\s` exactly as tiktoken's Rust regex does).
// BPE then runs on each piece independently.
#pragma once

#include <memory>
#include <string_view>
#include <vector>

namespace k3 {

// `pat_str` of Kimi's tokenization_kimi.py (Kimi-K2, Kimi-Linear and K3 share it), verbatim:
// Han runs; words with an optional leading non-letter and a case-insensitive 's 't 're 've 'm
// 'll 'd suffix, where letters exclude Han (the class intersections); 1-3 digits; punctuation
// runs; newlines; trailing whitespace.
extern const char kKimiPattern[];

// tokenization_kimi.py's encode cuts text into windows of 400000 code points, then cuts every
// run of more than 25000 consecutive whitespace (Python str.isspace) or non-whitespace code
// points; tiktoken sees each chunk separately. Chunks tile text in order; ill-formed bytes
// count as one code point per maximal subpart.
std::vector<std::string_view> kimi_chunks(std::string_view text);

class PreTokenizer {
 public:
  // Compiles pattern (ICU syntax); throws k3::Error with ICU's reason and offset when invalid.
  explicit PreTokenizer(std::string_view pattern = kKimiPattern);
  ~PreTokenizer();
  PreTokenizer(const PreTokenizer&) = delete;
  PreTokenizer& operator=(const PreTokenizer&) = delete;

  // The regex matches of text in order, as views into text (tiktoken's find_iter). With Kimi's
  // pattern they tile text. Thread-safe: each call uses its own matcher. Ill-formed UTF-8
  // matches as U+FFFD but the pieces keep the original bytes.
  std::vector<std::string_view> split(std::string_view text) const;

 private:
  struct Impl;  // the compiled ICU pattern (keeps ICU headers out of this one)
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3
