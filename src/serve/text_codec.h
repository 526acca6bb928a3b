// The server's view of the tokenizer: encode prompts, decode generated tokens incrementally,
// look up special tokens. A small interface over k3::Tokenizer, so engine tests can substitute
// their own and another executor's tokenizer path can plug in.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace k3::serve {

// Incremental detokenizer for one request. Returns only complete, well-formed UTF-8: bytes of a
// character split across tokens are held until it completes, so deltas concatenate to the text
// a one-shot decode gives, and never put invalid UTF-8 into a JSON event.
class TokenStream {
 public:
  virtual ~TokenStream() = default;
  virtual std::string push(int64_t id) = 0;
  virtual std::string flush() = 0;  // whatever is still held (invalid bytes as U+FFFD)
};

class TextCodec {
 public:
  virtual ~TextCodec() = default;
  // The model's tokenizer from dir (k3::Tokenizer: tiktoken BPE, or the byte-level fallback
  // when the checkpoint ships no tiktoken.model).
  static std::unique_ptr<TextCodec> load(const std::string& model_dir);

  // allow_special: special-token strings in text become their ids (chat markup); otherwise
  // they are encoded as ordinary text, so user text cannot forge them.
  virtual std::vector<int64_t> encode(std::string_view text, bool allow_special) const = 0;
  virtual std::unique_ptr<TokenStream> stream() const = 0;
  // The id of a special token string, if this tokenizer has it.
  virtual std::optional<int64_t> special_id(std::string_view token) const = 0;
  virtual std::string name() const = 0;  // for the startup log
};

}  // namespace k3::serve
