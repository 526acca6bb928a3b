#include "serve/text_codec.h"

#include "text/tokenizer.h"

namespace k3::serve {
namespace {

class TokenizerStream final : public TokenStream {
 public:
  explicit TokenizerStream(const Tokenizer& t) : dec_(t) {}
  std::string push(int64_t id) override { return dec_.push(id); }
  std::string flush() override { return dec_.flush(); }

 private:
  StreamDecoder dec_;
};

class TokenizerCodec final : public TextCodec {
 public:
  explicit TokenizerCodec(std::unique_ptr<Tokenizer> t) : tok_(std::move(t)) {}
  std::vector<int64_t> encode(std::string_view text, bool allow_special) const override {
    return tok_->encode(text, allow_special);
  }
  std::unique_ptr<TokenStream> stream() const override {
    return std::make_unique<TokenizerStream>(*tok_);
  }
  std::optional<int64_t> special_id(std::string_view token) const override {
    return tok_->token_id(token);
  }
  std::string name() const override {
    return tok_->byte_fallback() ? "byte-level fallback" : "tiktoken BPE";
  }

 private:
  std::unique_ptr<Tokenizer> tok_;  // StreamDecoders hold references into it
};

}  // namespace

std::unique_ptr<TextCodec> TextCodec::load(const std::string& model_dir) {
  return std::make_unique<TokenizerCodec>(Tokenizer::load(model_dir));
}

}  // namespace k3::serve
