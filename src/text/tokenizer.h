// Kimi's tokenizer: tiktoken byte-level BPE (tiktoken.model) with Kimi's pre-tokenizer and the
// special tokens of tokenizer_config.json, as tokenization_kimi.py builds it. Checkpoints
// without tiktoken.model get the byte-level fallback (token id = byte value).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "text/bpe.h"
#include "text/pretokenizer.h"

namespace k3 {

// Immutable once loaded: every method is const and safe to call from many threads.
class Tokenizer {
 public:
  // Specials fill [first, first + kReservedSpecials) above the BPE ranks, named from
  // tokenizer_config.json's added_tokens_decoder and "<|reserved_token_{id}|>" elsewhere
  // (K3: ranks 0..163583, specials 163584..163839).
  static constexpr int64_t kReservedSpecials = 256;

  // dir/tiktoken.model + dir/tokenizer_config.json (optional). Without tiktoken.model: the
  // byte-level fallback (id = byte; ids >= 256 are specials, named from tokenizer_config.json
  // when present, else shown as <|id|>). Errors (malformed line, bad base64, duplicate rank or
  // token, a byte without a token, bad JSON, special id clash) throw k3::Error naming the file
  // and the line (tiktoken.model) or the entry (tokenizer_config.json).
  static std::unique_ptr<Tokenizer> load(const std::string& dir);

  // allow_special: special-token strings in text map to their ids (tiktoken's
  // allowed_special="all"); otherwise they are ordinary text. Any bytes are accepted (ill-formed
  // UTF-8 round-trips). Thread-safe.
  std::vector<int64_t> encode(std::string_view text, bool allow_special = false) const;
  // Concatenated token bytes (ill-formed UTF-8 kept as-is), specials as their text. Throws
  // k3::Error for an id outside the vocabulary.
  std::string decode(const std::vector<int64_t>& ids) const;
  // The bytes of one token (a special's text); throws like decode.
  std::string token_bytes(int64_t id) const;

  std::optional<int64_t> token_id(std::string_view special) const;
  bool is_special(int64_t id) const;
  // One past the largest id (BPE ranks and specials).
  int64_t vocab_size() const { return vocab_size_; }
  bool byte_fallback() const { return byte_fallback_; }

 private:
  Tokenizer() = default;
  void add_special(const std::string& text, int64_t id, const std::string& where);
  void finish_specials();
  // Earliest special-token occurrence in s at or after from (the longest one there):
  // {position, id, length}; position == npos when none.
  struct SpecialHit {
    size_t pos, len;
    int64_t id;
  };
  SpecialHit find_special(std::string_view s, size_t from) const;
  void encode_ordinary(std::string_view text, std::vector<int64_t>& out) const;

  bool byte_fallback_ = false;
  BpeRanks ranks_;
  std::unique_ptr<PreTokenizer> pre_;  // null in byte fallback
  std::unordered_map<std::string, int64_t> special_ids_;
  std::unordered_map<int64_t, std::string> special_text_;
  // Specials by first byte, longest first: the candidates at each text position.
  std::array<std::vector<std::pair<std::string, int64_t>>, 256> by_first_byte_;
  int64_t vocab_size_ = 0;
};

// Incremental detokenizer for streaming: push(id) returns the text that became complete,
// never half a UTF-8 character (an incomplete trailing sequence waits for the next token);
// flush() returns the rest. Output is always valid UTF-8: ill-formed bytes become U+FFFD, so
// the concatenated output equals utf8::replace_invalid(tokenizer.decode(ids)) (what tiktoken's
// decode returns). Holds a reference to the tokenizer.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok) : tok_(tok) {}
  std::string push(int64_t id);
  std::string flush();

 private:
  const Tokenizer& tok_;
  std::string pending_;  // at most 3 bytes of an incomplete sequence between calls
};

}  // namespace k3
