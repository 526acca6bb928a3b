// The tokenizer: UTF-8 scanning, base64, Kimi's pre-tokenizer and chunking, byte-level BPE,
// loading (and its errors), encode/decode round trips, special tokens, streaming decode and the
// byte-level fallback. The synthetic tokenizer (tiny K3 presets) is the real-format fixture.
// Cross-checked against Python tiktoken in test_tokenizer_vs_tiktoken.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "synth/tokenizer_synth.h"
#include "test_util.h"
#include "text/base64.h"
#include "text/tokenizer.h"
#include "text/utf8.h"
#include "text_samples.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;

// One synthetic tokenizer for the whole binary.
const Tokenizer& synth_tok() {
  static const std::unique_ptr<Tokenizer> t = [] {
    const fs::path dir = test::temp_dir("tok_synth");
    write_synthetic_tokenizer(dir.string());
    return Tokenizer::load(dir.string());
  }();
  return *t;
}

TEST(TokenizerUtf8, MaximalSubpartsAndTruncation) {
  using utf8::replace_invalid;
  EXPECT_EQ(replace_invalid("a\xE2\x82"
                            "A"),
            "a\uFFFDA");                                   // one U+FFFD per maximal subpart
  EXPECT_EQ(replace_invalid("\xC0\xAF"), "\uFFFD\uFFFD");  // overlong lead
  EXPECT_EQ(replace_invalid("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");            // surrogate
  EXPECT_EQ(replace_invalid("\xF4\x90\x80\x80"), "\uFFFD\uFFFD\uFFFD\uFFFD");  // > U+10FFFF
  EXPECT_EQ(replace_invalid("\xF0\x9F\x98"), "\uFFFD");  // truncated at the end
  EXPECT_EQ(replace_invalid("\xF0\x9F\x98\x80"), "\U0001F600");
  EXPECT_EQ(utf8::stable_prefix("ab\xF0\x9F\x98"), 2u);
  EXPECT_EQ(utf8::stable_prefix("ab\xF0\x41"), 4u);  // ill-formed: final, not waiting
  EXPECT_EQ(utf8::stable_prefix("\xE4\xBD"), 0u);
  EXPECT_TRUE(utf8::valid("\xE4\xBD\xA0 ok"));
  EXPECT_FALSE(utf8::valid("\xE4\xBD"));
}

TEST(TokenizerBase64, RoundTripAndStrictness) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng r(seed);
  for (int n = 0; n < 40; ++n) {
    std::string b;
    for (int i = 0; i < n; ++i) b.push_back(static_cast<char>(r.next_u64()));
    EXPECT_EQ(base64_decode(base64_encode(b)), b);
  }
  EXPECT_EQ(base64_encode("\xe4\xbd\xa0"), "5L2g");
  for (const char* bad : {"QQ=", "Q===", "QQ=A", "Q!==", "QR==" /* non-zero pad bits */})
    EXPECT_FALSE(base64_decode(bad).has_value()) << bad;
}

// tiktoken's byte_pair_merge, quadratic and obviously right, for comparison.
std::vector<int64_t> naive_bpe(const BpeRanks& ranks, std::string_view piece) {
  if (auto r = ranks.rank(piece)) return {*r};
  std::vector<std::string> parts;
  for (char c : piece) parts.emplace_back(1, c);
  for (;;) {
    int64_t best = -1;
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i)
      if (auto r = ranks.rank(parts[i] + parts[i + 1]); r && (best < 0 || *r < best))
        best = *r, at = i;
    if (best < 0) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + static_cast<long>(at) + 1);
  }
  std::vector<int64_t> out;
  for (const auto& p : parts) out.push_back(*ranks.rank(p));
  return out;
}

TEST(TokenizerBpe, MergesLowestRankLeftmostAndShortcutsWholeTokens) {
  BpeRanks r;
  for (int b = 0; b < 256; ++b) r.add(std::string(1, static_cast<char>(b)), b);
  r.add("bc", 256), r.add("ab", 257), r.add("cd", 258), r.add("abcd", 259), r.add("aa", 260);
  const auto enc = [&](std::string_view p) {
    std::vector<int64_t> out;
    r.encode_piece(p, out);
    return out;
  };
  EXPECT_EQ(enc("abcd"), (std::vector<int64_t>{259}));  // the piece is a token: emitted whole
  EXPECT_EQ(enc("xabcd"), (std::vector<int64_t>{'x', 'a', 256, 'd'}));  // "bc" merges first
  EXPECT_EQ(enc("aaa"), (std::vector<int64_t>{260, 'a'}));              // leftmost on ties
  EXPECT_EQ(enc("aaaaa"), (std::vector<int64_t>{260, 260, 'a'}));
  EXPECT_FALSE(r.add("zz", 256));  // duplicate rank
  EXPECT_FALSE(r.add("ab", 999));  // duplicate bytes
}

TEST(TokenizerBpe, HeapMergeEqualsTiktokensScan) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng r(seed);
  const std::vector<std::string> tokens = train_bpe(synth_tokenizer_sample(), 768);
  BpeRanks ranks;
  for (size_t i = 0; i < tokens.size(); ++i) ranks.add(tokens[i], static_cast<int64_t>(i));
  const std::string_view sample = synth_tokenizer_sample();
  for (int i = 0; i < 500; ++i) {
    // Slices of the training text (many merges apply) and random bytes.
    const size_t len = 1 + r.next_u64() % 40, at = r.next_u64() % (sample.size() - len);
    std::string p(sample.substr(at, len));
    if (i % 4 == 0)
      for (auto& c : p) c = "aeht "[r.next_u64() % 5];
    std::vector<int64_t> got;
    ranks.encode_piece(p, got);
    ASSERT_EQ(got, naive_bpe(ranks, p)) << p;
  }
}

TEST(TokenizerLoad, SyntheticLayoutMirrorsK3) {
  const Tokenizer& t = synth_tok();
  EXPECT_FALSE(t.byte_fallback());
  EXPECT_EQ(t.vocab_size(), kTinyVocabSize);
  EXPECT_EQ(t.token_id("[BOS]"), 768);
  EXPECT_EQ(t.token_id("[EOS]"), 769);
  EXPECT_EQ(t.token_id("<|end_of_msg|>"), 770);
  EXPECT_EQ(t.token_id("<|sep|>"), 773);
  EXPECT_EQ(t.token_id("<|media_pad|>"), 768 + 21);
  EXPECT_EQ(t.token_id("[PAD]"), 1023);
  EXPECT_EQ(t.token_id("<|reserved_token_800|>"), 800);
  EXPECT_FALSE(t.token_id("<|reserved_token_1023|>").has_value());  // 1023 is [PAD]
  EXPECT_FALSE(t.token_id("hello").has_value());
  EXPECT_TRUE(t.is_special(768));
  EXPECT_TRUE(t.is_special(1023));
  EXPECT_FALSE(t.is_special(767));
  EXPECT_EQ(t.decode({770, 768}), "<|end_of_msg|>[BOS]");
  EXPECT_THROW(t.decode({1024}), Error);
  EXPECT_THROW(t.decode({-1}), Error);
}

TEST(TokenizerEncode, RoundTripsCorpusAndRandomText) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng r(seed);
  const Tokenizer& t = synth_tok();
  std::vector<std::string> texts = test::tokenizer_corpus();
  for (int i = 0; i < 300; ++i) texts.push_back(test::random_text(r, r.next_u64() % 120));
  for (int i = 0; i < 30; ++i) {  // arbitrary bytes round-trip too
    std::string b;
    for (size_t k = r.next_u64() % 64; k > 0; --k) b.push_back(static_cast<char>(r.next_u64()));
    texts.push_back(b);
  }
  for (const auto& s : texts) {
    const auto ids = t.encode(s);
    for (int64_t id : ids) ASSERT_LT(id, 768) << "a special from allow_special=false: " << s;
    ASSERT_EQ(t.decode(ids), s);
    ASSERT_EQ(t.decode(t.encode(s, true)), s);
  }
  // Merges are used: English compresses well below a token per byte.
  const std::string en = "The model reads a prompt one token at a time and writes the next token.";
  EXPECT_LT(t.encode(en).size(), en.size() / 2);
}

TEST(TokenizerEncode, SpecialTokensOnlyWhenAllowed) {
  const Tokenizer& t = synth_tok();
  const std::string s = "hi<|end_of_msg|><|open|>x[BOS]<|reserved_token_900|><|nope|>";
  const auto with = t.encode(s, true);
  const std::vector<int64_t> specials_seen = [&] {
    std::vector<int64_t> v;
    for (int64_t id : with)
      if (t.is_special(id)) v.push_back(id);
    return v;
  }();
  EXPECT_EQ(specials_seen, (std::vector<int64_t>{770, 771, 768, 900}));
  EXPECT_EQ(t.decode(with), s);
  for (int64_t id : t.encode(s, false)) EXPECT_FALSE(t.is_special(id));
  // Text around a special is encoded as if the special were not there.
  const auto a = t.encode("hello"), b = t.encode(" world");
  std::vector<int64_t> want = a;
  want.push_back(773);
  want.insert(want.end(), b.begin(), b.end());
  EXPECT_EQ(t.encode("hello<|sep|> world", true), want);
}

TEST(TokenizerEncode, LongInputsStayLinear) {
  const Tokenizer& t = synth_tok();
  std::string big;
  Rng r(7);
  while (big.size() < (1u << 20)) big += test::random_text(r, 200) + " ";
  big += std::string(60000, ' ') + std::string(60000, 'a') + std::string(30000, '!');
  const auto ids = t.encode(big, true);
  EXPECT_EQ(t.decode(ids), big);
}

TEST(TokenizerStream, NeverEmitsHalfACharacter) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng r(seed);
  const Tokenizer& t = synth_tok();
  // U+1F600 fed one byte token at a time: nothing until the fourth byte.
  StreamDecoder d(t);
  EXPECT_EQ(d.push(0xF0), "");
  EXPECT_EQ(d.push(0x9F), "");
  EXPECT_EQ(d.push(0x98), "");
  EXPECT_EQ(d.push(0x80), "\U0001F600");
  EXPECT_EQ(d.push(0xE4), "");
  EXPECT_EQ(d.push(770), "\uFFFD<|end_of_msg|>");  // a special ends the pending character
  EXPECT_EQ(d.push(0xE4), "");
  EXPECT_EQ(d.flush(), "\uFFFD");
  // Real encodings (CJK splits across tokens) and random id sequences: every piece is valid
  // UTF-8, and the pieces add up to the replaced one-shot decode.
  std::vector<std::vector<int64_t>> seqs;
  for (const auto& s : test::tokenizer_corpus()) seqs.push_back(t.encode(s));
  for (int i = 0; i < 200; ++i) {
    std::vector<int64_t> ids;
    for (size_t k = r.next_u64() % 30; k > 0; --k)
      ids.push_back(static_cast<int64_t>(r.next_u64() % t.vocab_size()));
    seqs.push_back(ids);
  }
  for (const auto& ids : seqs) {
    StreamDecoder s(t);
    std::string all;
    for (int64_t id : ids) {
      const std::string piece = s.push(id);
      ASSERT_TRUE(utf8::valid(piece));
      all += piece;
    }
    const std::string rest = s.flush();
    ASSERT_TRUE(utf8::valid(rest));
    ASSERT_EQ(all + rest, utf8::replace_invalid(t.decode(ids)));
  }
}

void write(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

// A rank file of the 256 bytes, then extra lines.
std::string byte_ranks(const std::string& extra = "") {
  std::string s;
  for (int b = 0; b < 256; ++b)
    s += base64_encode(std::string(1, char(b))) + " " + std::to_string(b) + "\n";
  return s + extra;
}

void expect_load_error(const std::string& name, const std::string& ranks, const std::string& config,
                       const std::string& want) {
  const fs::path dir = test::temp_dir("tok_err_" + name);
  fs::create_directories(dir);
  if (!ranks.empty()) write(dir / "tiktoken.model", ranks);
  if (!config.empty()) write(dir / "tokenizer_config.json", config);
  try {
    Tokenizer::load(dir.string());
    ADD_FAILURE() << name << ": loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << name << ": " << e.what();
  }
  fs::remove_all(dir);
}

TEST(TokenizerLoad, MalformedFilesNameTheLine) {
  expect_load_error("fields", byte_ranks("YWI= 256 x\n"), "", "tiktoken.model line 257: expected");
  expect_load_error("base64", byte_ranks("\nY!I= 256\n"), "",
                    "tiktoken.model line 258: bad base64");
  expect_load_error("rank", byte_ranks("YWI= -3\n"), "", "line 257: rank \"-3\" is not an integer");
  expect_load_error("dup_rank", byte_ranks("YWI= 7\n"), "",
                    "line 257: duplicate rank 7 (also on line 8)");
  expect_load_error("dup_token", byte_ranks("YQ== 256\n"), "",
                    "line 257: duplicate token \"YQ==\"");
  expect_load_error("no_byte", "YQ== 0\n", "", "no token for the byte 0x0");
  expect_load_error("json", byte_ranks(), "{\n \"added_tokens_decoder\": {,\n}",
                    "tokenizer_config.json: invalid JSON");
  expect_load_error("json_line", byte_ranks(), "{\n \"added_tokens_decoder\": {,\n}", "line 2");
  expect_load_error("clash", byte_ranks(),
                    R"({"added_tokens_decoder": {"65": {"content": "[BOS]"}}})",
                    "added_tokens_decoder[\"65\"]: special id 65 clashes with BPE rank 65");
  expect_load_error(
      "dup_special", byte_ranks(),
      R"({"added_tokens_decoder": {"256": {"content": "[X]"}, "257": {"content": "[X]"}}})",
      "special token \"[X]\" already has id 256");
  expect_load_error("key", byte_ranks(), R"({"added_tokens_decoder": {"x1": {"content": "[X]"}}})",
                    "added_tokens_decoder[\"x1\"]: the key is not a token id");
  expect_load_error("fallback_clash", "", R"({"added_tokens_decoder": {"10": {"content": "[X]"}}})",
                    "clashes with a byte token");
}

TEST(TokenizerFallback, BytesAndNamedSpecials) {
  const fs::path dir = test::temp_dir("tok_fallback");
  fs::create_directories(dir);
  auto t = Tokenizer::load(dir.string());
  EXPECT_TRUE(t->byte_fallback());
  EXPECT_EQ(t->vocab_size(), 256);
  EXPECT_EQ(t->encode("h\xc3\xa9"), (std::vector<int64_t>{'h', 0xc3, 0xa9}));
  EXPECT_EQ(t->decode({'h', 0xc3, 0xa9, 300}), "h\xc3\xa9<|300|>");
  EXPECT_TRUE(t->is_special(300));
  EXPECT_FALSE(t->is_special(255));
  write(dir / "tokenizer_config.json",
        R"({"added_tokens_decoder": {"258": {"content": "<|end_of_msg|>"}}})");
  t = Tokenizer::load(dir.string());
  EXPECT_EQ(t->token_id("<|end_of_msg|>"), 258);
  EXPECT_EQ(t->encode("a<|end_of_msg|>", true), (std::vector<int64_t>{'a', 258}));
  EXPECT_EQ(t->encode("a<|end_of_msg|>").size(), 15u);
  EXPECT_EQ(t->decode({258, 259}), "<|end_of_msg|><|259|>");
  EXPECT_THROW(Tokenizer::load((dir / "missing").string()), Error);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace k3
