// Text for the tokenizer tests: a fixed corpus of the cases the pre-tokenizer distinguishes,
// and random strings over scripts and character classes that matter to Kimi's regex. Random
// code points come from ranges assigned since long before Unicode 15 (ICU 72's tables), so
// the Rust regex inside tiktoken classifies them the same way.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/rng.h"
#include "text/utf8.h"

namespace k3::test {

inline std::vector<std::string> tokenizer_corpus() {
  return {
      "",
      "Hello world",
      "The Kimi K3 model",
      "  leading and trailing spaces  ",
      "tabs\tand\nnewlines\r\nand\r\n\r\nblank lines\n\n\n",
      "I'm here; you're there; we've been; they'll go; she'd say; it's; don't",
      "I'M HERE; YOU'RE THERE; WE'VE BEEN; THEY'LL GO; SHE'D SAY; IT'S; DON'T",
      "mIxEd'Re cAsE'Ll wOrDs'S 'S 's x's",
      "long s: it'\u017f, kelvin: \u212a, titlecase: \u01c5ungla \u01c8",
      "numbers 1 12 123 1234 12345 1234567 3.14159 -42 1e-5 \u0661\u0662\u0663\u0664 \uff11\uff12",
      "roman \u2160\u2161\u2162 superscripts x\u00b2 y\u00b3 fractions \u00bd",
      "\u4e2d\u6587\u6d4b\u8bd5 English MIX caf\u00e9 e\u0301 a\u4e2d b\u6587c",
      "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
      "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001\u3072\u3089\u304c\u306a",
      "\u3007\u3005 \u4e00\u3005 Han-script non-letters",
      "\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4",
      "emoji \U0001f600\U0001f600 \U0001f680! \u2764\ufe0f "
      "\U0001f468\u200d\U0001f469\u200d\U0001f467",
      "combining: a\u0300\u0301\u0302 \u0300start n\u0303o",
      "whitespace kinds:\u000b\u000c\u0085\u00a0\u1680\u2028\u2029\u3000|\u001c\u001f|",
      "  \n  \n\n   x   \n",
      "x   ",
      "def f(x):\n    return x + 1\n",
      "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
      "\\frac{1}{2} + \\alpha_{i} = 0.5",
      "{\"role\": \"user\", \"content\": \"hi\"}",
      "URL: http://example.com/a?b=c&d=e#f",
      "!!! ??? ... --- ___ *** ### $$$ %%% ^^^",
      "<|end_of_msg|><|open|>message<|sep|>hi<|close|>message<|sep|>[BOS][EOS]",
      "specials touching text<|sep|>after and [PAD]and [UNK] <|not_a_token|> <| |>",
      "<|reserved_token_800|> <|reserved_token_1023|> <|reserved_token_767|>",
      "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35 \u0645\u0631\u062d\u0628\u0627 "
      "\u0928\u092e\u0938\u094d\u0924\u0947 "
      "\u041f\u0440\u0438\u0432\u0435\u0442 \u0393\u03b5\u03b9\u03ac",
      "modifier letters \u02b0\u02b2 \u02c6 and \u00aa\u00ba ordinals",
      "replacement \ufffd char",
  };
}

// n random code points, with contractions and runs of one class mixed in.
inline std::string random_text(Rng& r, size_t n) {
  struct Range {
    uint32_t lo, hi;
  };
  static const Range kRanges[] = {
      {'a', 'z'},       {'A', 'Z'},       {'0', '9'},       {' ', ' '},         {'!', '/'},
      {':', '@'},       {'[', '`'},       {'{', '~'},       {'\t', '\r'},       {0x1c, 0x1f},
      {0x85, 0x85},     {0xa0, 0xa0},     {0x2000, 0x200a}, {0x2028, 0x2029},   {0x3000, 0x3000},
      {0xc0, 0xff},     {0x100, 0x17f},   {0x1c4, 0x1cc},   {0x2b0, 0x2ff},     {0x300, 0x36f},
      {0x391, 0x3c9},   {0x410, 0x44f},   {0x627, 0x64a},   {0x660, 0x669},     {0x905, 0x939},
      {0xe01, 0xe3a},   {0x2160, 0x2188}, {0x3005, 0x3007}, {0x3041, 0x3096},   {0x30a1, 0x30fa},
      {0x4e00, 0x9fff}, {0xac00, 0xd7a3}, {0xff10, 0xff5a}, {0x1f600, 0x1f64f}, {0x20000, 0x2a6d6},
      {0x200d, 0x200d}, {0xfe0f, 0xfe0f}, {0xfffd, 0xfffd}, {0x2018, 0x201f},   {0x212a, 0x212a},
  };
  static const char* kSuffixes[] = {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d",
                                    "'S", "'T", "'RE", "'Ve", "'M", "'lL", "'D"};
  std::string out;
  const Range* run = nullptr;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t u = r.next_u64();
    if (u % 16 == 0) {
      out += kSuffixes[(u >> 8) % (sizeof kSuffixes / sizeof *kSuffixes)];
      continue;
    }
    if (!run || u % 4 == 0) run = &kRanges[(u >> 8) % (sizeof kRanges / sizeof *kRanges)];
    const uint32_t cp = run->lo + static_cast<uint32_t>((u >> 32) % (run->hi - run->lo + 1));
    utf8::append(out, cp);
  }
  return out;
}

}  // namespace k3::test
