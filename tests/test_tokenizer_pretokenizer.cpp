// Kimi's pre-tokenizer on ICU: the pieces of pat_str on the cases it distinguishes, the
// character classes of the compiled pattern against their Unicode definitions on every code
// point, and tokenization_kimi.py's chunking of long runs.
#include <gtest/gtest.h>
#include <unicode/uchar.h>
#include <unicode/uscript.h>

#include <string>
#include <vector>

#include "test_util.h"
#include "text/pretokenizer.h"
#include "text/utf8.h"
#include "text_samples.h"

namespace k3 {
namespace {

std::vector<std::string> pieces(std::string_view text) {
  static const PreTokenizer pre;
  std::vector<std::string> out;
  for (const auto p : pre.split(text)) out.emplace_back(p);
  return out;
}
using Pieces = std::vector<std::string>;

TEST(TokenizerPreTokenizer, KimiPatternPieces) {
  EXPECT_EQ(pieces("Hello world"), (Pieces{"Hello", " world"}));
  // Contractions attach to the word, case-insensitively.
  EXPECT_EQ(pieces("it's THEY'RE we'Ve I'M don't"),
            (Pieces{"it's", " THEY'RE", " we'Ve", " I'M", " don't"}));
  EXPECT_EQ(pieces("x 's"), (Pieces{"x", " '", "s"}));
  // Han runs are their own pieces; the class intersections keep Han out of words.
  EXPECT_EQ(pieces("\u4e2d\u6587abc"), (Pieces{"\u4e2d\u6587", "abc"}));
  EXPECT_EQ(pieces("a\u4e2d"), (Pieces{"a", "\u4e2d"}));
  EXPECT_EQ(pieces("\u65e5\u672c\u8a9e\u306e\u30c6"),
            (Pieces{"\u65e5\u672c\u8a9e", "\u306e\u30c6"}));
  EXPECT_EQ(pieces("12345"), (Pieces{"123", "45"}));
  EXPECT_EQ(pieces("e\u0301t\u00e9"), (Pieces{"e\u0301t\u00e9"}));  // marks stay in the word
  EXPECT_EQ(pieces("a  b"), (Pieces{"a", " ", " b"}));
  EXPECT_EQ(pieces("a\n\nb"), (Pieces{"a", "\n\n", "b"}));
  EXPECT_EQ(pieces("x   "), (Pieces{"x", "   "}));
  EXPECT_EQ(pieces(" \U0001f600!?\n"), (Pieces{" \U0001f600!?\n"}));
  // \s is Unicode White_Space (VT and NEL included), as in tiktoken's Rust regex.
  EXPECT_EQ(pieces("a\x0b\xc2\x85"
                   "b"),
            (Pieces{"a", "\x0b",
                    "\xc2\x85"
                    "b"}));
  // Ill-formed bytes match as U+FFFD (a symbol) and keep their bytes.
  EXPECT_EQ(pieces("ab\xff\xfe"
                   "cd"),
            (Pieces{"ab", "\xff\xfe", "cd"}));
}

TEST(TokenizerPreTokenizer, PiecesTileRandomText) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng r(seed);
  for (int i = 0; i < 300; ++i) {
    std::string t = test::random_text(r, r.next_u64() % 80);
    if (i % 3 == 0 && !t.empty()) t[r.next_u64() % t.size()] ^= 0x80;  // ill-formed bytes too
    std::string joined;
    for (const auto& p : pieces(t)) {
      EXPECT_FALSE(p.empty());
      joined += p;
    }
    ASSERT_EQ(joined, t);
  }
}

TEST(TokenizerPreTokenizer, KimiChunksCutLongRuns) {
  const std::string a(30000, 'a'), sp(25001, ' ');
  const std::string text = a + sp + "b";
  const auto chunks = kimi_chunks(text);
  // 25000 a | the other 5000 a and 25000 spaces (the run restarts at the first space) | " b"
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].size(), 25000u);
  EXPECT_EQ(chunks[1].size(), 5000u + 25000u);
  EXPECT_EQ(chunks[2], " b");
  std::string joined;
  for (const auto c : chunks) joined += c;
  EXPECT_EQ(joined, text);
  // Python's isspace: U+001C is whitespace for the cut (though not regex \s).
  const auto fs_chunks = kimi_chunks(std::string(25001, '\x1c'));
  EXPECT_EQ(fs_chunks.size(), 2u);
  // 400000-code-point windows, counted in code points, not bytes.
  std::string han;
  for (int i = 0; i < 400001; ++i) han += "\u4e2d";
  const auto w = kimi_chunks(han);
  ASSERT_EQ(w.size(), 17u);  // 16 runs of 25000 in the first window, then the last character
  EXPECT_EQ(w[15].size(), 25000u * 3);
  EXPECT_EQ(w.back(), "\u4e2d");
}

// Each probe joins "<probe char>" + c into one piece exactly when c is in one class of the
// pattern, so the compiled classes (the && intersections, \s, \p{Han}) can be held against
// ICU's character properties: all of the BMP and every 7th astral code point.
TEST(TokenizerPreTokenizer, CharacterClassesMatchTheirDefinitions) {
  const PreTokenizer pre;
  const auto joined = [&](const char* probe, uint32_t c) {
    std::string s = probe;
    utf8::append(s, c);
    return pre.split(s).size() == 1;
  };
  int checked = 0;
  for (uint32_t c = 0; c <= 0x10FFFF; c += c < 0x10000 ? 1 : 7) {
    if (c >= 0xD800 && c <= 0xDFFF) continue;
    const auto cp = static_cast<UChar32>(c);
    const int gc = u_charType(cp);
    UErrorCode st = U_ZERO_ERROR;
    const bool han = uscript_getScript(cp, &st) == USCRIPT_HAN;
    const bool lu_lt = gc == U_UPPERCASE_LETTER || gc == U_TITLECASE_LETTER;
    const bool lm_lo = gc == U_MODIFIER_LETTER || gc == U_OTHER_LETTER;
    const bool ll = gc == U_LOWERCASE_LETTER;
    const bool mark =
        gc == U_NON_SPACING_MARK || gc == U_ENCLOSING_MARK || gc == U_COMBINING_SPACING_MARK;
    const bool number =
        gc == U_DECIMAL_DIGIT_NUMBER || gc == U_LETTER_NUMBER || gc == U_OTHER_NUMBER;
    const bool space = u_hasBinaryProperty(cp, UCHAR_WHITE_SPACE);
    const bool letter = lu_lt || lm_lo || ll;
    // [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]: continues a lower-case word.
    ASSERT_EQ(joined("x", c), (ll || lm_lo || mark) && !han) << std::hex << c;
    // Either word class (the upper one adds Lu, Lt) continues a capitalised word.
    ASSERT_EQ(joined("X", c), (letter || mark) && !han) << std::hex << c;
    // [\p{Han}]+ (script Han, letters or not).
    ASSERT_EQ(joined("\u4e2d", c), han) << std::hex << c;
    // [^\s\p{L}\p{N}]+[\r\n]*: punctuation runs, with \s the Unicode White_Space property
    // (a word may also start with the "!", as the optional non-letter before it).
    const bool punct = !space && !letter && !number;
    ASSERT_EQ(joined("!", c), punct || ((letter || mark) && !han) || c == '\r' || c == '\n')
        << std::hex << c;
    ++checked;
  }
  EXPECT_GT(checked, 200000);
}

}  // namespace
}  // namespace k3
