#include "text/pretokenizer.h"

#include <unicode/regex.h>
#include <unicode/uchar.h>

#include <string>

#include "core/error.h"
#include "text/utf8.h"

namespace k3 {

// The eight alternatives of pat_str, joined with '|' as tokenization_kimi.py joins them.
const char kKimiPattern[] =
    R"re([\p{Han}]+)re"
    "|"
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*)re"
    R"re([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)re"
    "|"
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)re"
    R"re([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)re"
    "|"
    R"re(\p{N}{1,3})re"
    "|"
    R"re( ?[^\s\p{L}\p{N}]+[\r\n]*)re"
    "|"
    R"re(\s*[\r\n]+)re"
    "|"
    R"re(\s+(?!\S))re"
    "|"
    R"re(\s+)re";

namespace {

// Python's str.isspace: general category Zs or bidi class WS, B or S (so U+001C..U+001F and
// U+0085 count, unlike regex \s for the former).
bool py_isspace(uint32_t cp) {
  const auto c = static_cast<UChar32>(cp);
  if (u_charType(c) == U_SPACE_SEPARATOR) return true;
  const UCharDirection d = u_charDirection(c);
  return d == U_WHITE_SPACE_NEUTRAL || d == U_BLOCK_SEPARATOR || d == U_SEGMENT_SEPARATOR;
}

}  // namespace

std::vector<std::string_view> kimi_chunks(std::string_view text) {
  constexpr size_t kWindow = 400000;  // TIKTOKEN_MAX_ENCODE_CHARS
  constexpr size_t kMaxRun = 25000;   // MAX_NO_WHITESPACES_CHARS
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < text.size()) {
    // One window; the run state starts afresh in each, as in the Python loop.
    size_t slice = i, run = 0, cps = 0;
    bool in_space = false;
    while (i < text.size() && cps < kWindow) {
      const utf8::Seq q = utf8::next(text, i);
      const bool ok = q.kind == utf8::SeqKind::Valid;
      const bool space = ok && py_isspace(q.cp);
      if (cps == 0) in_space = space;
      if (space != in_space) {
        run = 1;
        in_space = space;
      } else if (++run > kMaxRun) {
        out.push_back(text.substr(slice, i - slice));
        slice = i;
        run = 1;
      }
      i += static_cast<size_t>(q.len);
      ++cps;
    }
    out.push_back(text.substr(slice, i - slice));
  }
  return out;
}

struct PreTokenizer::Impl {
  std::unique_ptr<icu::RegexPattern> re;
};

PreTokenizer::PreTokenizer(std::string_view pattern) : impl_(std::make_unique<Impl>()) {
  UErrorCode st = U_ZERO_ERROR;
  UParseError pe{};
  const icu::UnicodeString p = icu::UnicodeString::fromUTF8(
      icu::StringPiece(pattern.data(), static_cast<int32_t>(pattern.size())));
  impl_->re.reset(icu::RegexPattern::compile(p, 0, pe, st));
  if (U_FAILURE(st))
    fail("pre-tokenizer regex does not compile (ICU ", u_errorName(st), " at offset ", pe.offset,
         "): ", pattern);
}

PreTokenizer::~PreTokenizer() = default;

std::vector<std::string_view> PreTokenizer::split(std::string_view text) const {
  std::vector<std::string_view> out;
  if (text.empty()) return out;
  const utf8::Utf16 u = utf8::to_utf16(text);
  K3_CHECK(u.text.size() < (1u << 31), "text of ", text.size(), " bytes is too long to split");
  // A read-only alias of u.text: no copy; u outlives the matcher.
  const icu::UnicodeString input(false, u.text.data(), static_cast<int32_t>(u.text.size()));
  UErrorCode st = U_ZERO_ERROR;
  std::unique_ptr<icu::RegexMatcher> m(impl_->re->matcher(input, st));
  // Long single pieces (a 25000-space run) backtrack over their length: lift ICU's 8 MB
  // default stack cap rather than fail on them.
  if (U_SUCCESS(st)) m->setStackLimit(0, st);
  while (U_SUCCESS(st) && m->find(st)) {
    const int32_t a = m->start(st), b = m->end(st);
    if (U_FAILURE(st)) break;
    const uint32_t from = u.offsets[static_cast<size_t>(a)], to = u.offsets[static_cast<size_t>(b)];
    out.push_back(text.substr(from, to - from));
  }
  if (U_FAILURE(st))
    fail("pre-tokenizer regex failed on a ", text.size(), "-byte text: ICU ", u_errorName(st));
  return out;
}

}  // namespace k3
