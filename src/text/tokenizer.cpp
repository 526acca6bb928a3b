#include "text/tokenizer.h"

#include "core/error.h"
#include "text/utf8.h"

namespace k3 {

Tokenizer::SpecialHit Tokenizer::find_special(std::string_view s, size_t from) const {
  for (size_t pos = from; pos < s.size(); ++pos) {
    for (const auto& [text, id] : by_first_byte_[static_cast<uint8_t>(s[pos])])
      if (s.compare(pos, text.size(), text) == 0) return {pos, text.size(), id};
  }
  return {std::string_view::npos, 0, -1};
}

void Tokenizer::encode_ordinary(std::string_view text, std::vector<int64_t>& out) const {
  if (byte_fallback_) {
    for (unsigned char c : text) out.push_back(c);
    return;
  }
  for (const std::string_view piece : pre_->split(text)) ranks_.encode_piece(piece, out);
}

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  std::vector<int64_t> out;
  out.reserve(text.size() / 3 + 1);
  // tokenization_kimi.py's chunks first; specials are then found within each chunk (a special
  // token cut by a chunk boundary is ordinary text there too).
  const std::vector<std::string_view> chunks =
      byte_fallback_ ? std::vector<std::string_view>{text} : kimi_chunks(text);
  for (const std::string_view chunk : chunks) {
    if (!allow_special) {
      encode_ordinary(chunk, out);
      continue;
    }
    size_t at = 0;
    while (at < chunk.size()) {
      const SpecialHit h = find_special(chunk, at);
      const size_t stop = h.pos == std::string_view::npos ? chunk.size() : h.pos;
      encode_ordinary(chunk.substr(at, stop - at), out);
      if (h.pos == std::string_view::npos) break;
      out.push_back(h.id);
      at = h.pos + h.len;
    }
  }
  return out;
}

std::string Tokenizer::token_bytes(int64_t id) const {
  if (const auto it = special_text_.find(id); it != special_text_.end()) return it->second;
  if (byte_fallback_) {
    K3_CHECK(id >= 0, "token id ", id, " is negative");
    if (id < 256) return std::string(1, static_cast<char>(id));
    return "<|" + std::to_string(id) + "|>";
  }
  const std::string* b = ranks_.bytes(id);
  K3_CHECK(b != nullptr, "token id ", id, " is not in the vocabulary (size ", vocab_size_, ")");
  return *b;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) out += token_bytes(id);
  return out;
}

std::optional<int64_t> Tokenizer::token_id(std::string_view special) const {
  const auto it = special_ids_.find(std::string(special));
  if (it == special_ids_.end()) return std::nullopt;
  return it->second;
}

bool Tokenizer::is_special(int64_t id) const {
  return special_text_.count(id) > 0 || (byte_fallback_ && id >= 256);
}

std::string StreamDecoder::push(int64_t id) {
  pending_ += tok_.token_bytes(id);
  // Everything but an incomplete trailing sequence is final; ill-formed parts are decided by
  // bytes already here, so replacing them now gives what replacing the whole text would.
  const size_t n = utf8::stable_prefix(pending_);
  std::string out = utf8::replace_invalid(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8::replace_invalid(pending_);
  pending_.clear();
  return out;
}

}  // namespace k3
