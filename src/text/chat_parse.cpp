// Parsing K3 assistant output into OpenAI fields. Two layers: a lexer that turns decoded text into
// text runs and complete XTML tags (holding back anything that could still become a marker), and
// a channel state machine (think -> response -> tools -> message close). The one-shot parser is the
// streaming parser fed once, so both agree for any chunking. Model output never throws: what
// cannot be read as a tool call is returned as content, verbatim.
#include <optional>
#include <utility>

#include "text/chat.h"

namespace k3 {
namespace {

using ordered_json = nlohmann::ordered_json;

// A tag header longer than this is not a tag (K3 headers are a name and two short attributes);
// bounding it also bounds how much text streaming holds back.
constexpr size_t kMaxHeader = 1024;
constexpr std::string_view kTokens[] = {xtml::kOpen, xtml::kClose, xtml::kSep, xtml::kEndOfMsg};
enum Tok { kOpenTok, kCloseTok, kSepTok, kEomTok };

struct Lexeme {
  enum Kind { kText, kOpen, kClose, kEom } kind;
  std::string name;   // tag name (open / close)
  std::string attrs;  // the rest of an open tag's header
  std::string raw;    // the exact source text
};

std::pair<size_t, int> find_token(std::string_view s, size_t from) {
  for (size_t p = s.find("<|", from); p != std::string_view::npos; p = s.find("<|", p + 1))
    for (int k = 0; k < 4; ++k)
      if (s.compare(p, kTokens[k].size(), kTokens[k]) == 0) return {p, k};
  return {std::string_view::npos, -1};
}

// Length of the longest suffix of s[from:] that is a proper prefix of a special token.
size_t held_suffix(std::string_view s, size_t from) {
  size_t best = 0;
  for (std::string_view t : kTokens)
    for (size_t n = std::min(t.size() - 1, s.size() - from); n > best; --n)
      if (s.substr(s.size() - n) == t.substr(0, n)) {
        best = n;
        break;
      }
  return best;
}

class Lexer {
 public:
  std::vector<Lexeme> feed(std::string_view text, bool final) {
    buf_ += text;
    std::vector<Lexeme> out;
    const std::string_view s = buf_;
    size_t pos = 0;
    auto emit_text = [&](size_t end) {
      if (end > pos) out.push_back({Lexeme::kText, {}, {}, std::string(s.substr(pos, end - pos))});
      pos = end;
    };
    while (pos < s.size()) {
      const auto [at, tok] = find_token(s, pos);
      if (tok < 0) {
        const size_t keep = held_suffix(s, pos);
        // At the end a dangling "<|..." is a truncated marker: drop it rather than show it.
        const bool drop = final && keep >= 2;
        emit_text(s.size() - (final && !drop ? 0 : keep));
        if (drop) pos = s.size();
        break;
      }
      emit_text(at);
      const size_t len = kTokens[tok].size();
      if (tok == kEomTok || tok == kSepTok) {
        // A stray <|sep|> is kept as text; it cannot be part of a marker any more.
        out.push_back(
            {tok == kEomTok ? Lexeme::kEom : Lexeme::kText, {}, {}, std::string(kTokens[tok])});
        pos = at + len;
        continue;
      }
      const size_t head = at + len;
      const auto [next, next_tok] = find_token(s, head);
      if (next_tok < 0 && s.size() - head <= kMaxHeader) {
        if (final) pos = s.size();  // truncated tag: dropped
        break;                      // else wait for the rest of the header
      }
      if (next_tok != kSepTok || next - head > kMaxHeader) {
        emit_text(head);  // not a tag: the opener is text, scanning goes on after it
        continue;
      }
      const std::string_view header = s.substr(head, next - head);
      const size_t sp = std::min(header.find(' '), header.size());
      out.push_back({tok == kOpenTok ? Lexeme::kOpen : Lexeme::kClose,
                     std::string(header.substr(0, sp)), std::string(header.substr(sp)),
                     std::string(s.substr(at, next + kTokens[kSepTok].size() - at))});
      pos = next + kTokens[kSepTok].size();
    }
    buf_.erase(0, pos);
    return out;
  }

 private:
  std::string buf_;
};

bool is_blank(std::string_view s) {
  for (char c : s)
    if (!(c == ' ' || (c >= '\t' && c <= '\r'))) return false;
  return true;
}

std::string unescape_attr(std::string_view v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v.compare(i, 6, "&quot;") == 0) {
      out += '"';
      i += 5;
    } else if (v.compare(i, 5, "&amp;") == 0) {
      out += '&';
      i += 4;
    } else {
      out += v[i];
    }
  }
  return out;
}

// ` key="value" key2="value2"` -> pairs; nullopt when malformed.
std::optional<std::vector<std::pair<std::string, std::string>>> parse_attrs(std::string_view s) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t i = 0;
  while (true) {
    while (i < s.size() && s[i] == ' ') ++i;
    if (i == s.size()) return out;
    const size_t eq = s.find("=\"", i);
    if (eq == std::string_view::npos || eq == i) return std::nullopt;
    const size_t end = s.find('"', eq + 2);
    if (end == std::string_view::npos) return std::nullopt;
    const std::string_view key = s.substr(i, eq - i);
    if (key.find(' ') != std::string_view::npos) return std::nullopt;
    out.emplace_back(std::string(key), unescape_attr(s.substr(eq + 2, end - eq - 2)));
    i = end + 1;
  }
}

std::string attr(const std::vector<std::pair<std::string, std::string>>& attrs,
                 std::string_view key) {
  for (const auto& [k, v] : attrs)
    if (k == key) return v;
  return {};
}

bool is_tag(const Lexeme& x, Lexeme::Kind kind, std::string_view name) {
  return x.kind == kind && x.name == name;
}

}  // namespace

struct AssistantStreamParser::State {
  enum Phase {
    kReasoning,
    kAfterThink,
    kResponse,
    kAfterResponse,
    kTools,
    kCall,
    kArg,
    kJson,
    kAfterTools,
    kRaw,
    kDone
  };
  Lexer lex;
  Phase phase = kReasoning;
  AssistantDelta out;           // what the current feed() returns
  bool seen_reasoning = false;  // any reasoning text yet (a repeated opening tag is skipped)
  bool seen_content = false;
  size_t calls_done = 0;
  // The tool call being read; `raw` is its source text, returned as content if it breaks.
  std::string raw, call_name, call_index, arg_key, arg_type, value;
  ordered_json call_args;

  void reasoning(std::string_view t) {
    out.reasoning_content += t;
    seen_reasoning = seen_reasoning || !t.empty();
  }
  void content(std::string_view t) {
    out.content += t;
    seen_content = seen_content || !t.empty();
  }
  void malformed() {
    content(raw);
    raw.clear();
    phase = kRaw;
  }
  bool ends_message(const Lexeme& x) {
    if (x.kind != Lexeme::kEom && !is_tag(x, Lexeme::kClose, "message")) return false;
    phase = kDone;
    return true;
  }

  void finish_call() {
    ToolCall call;
    call.name = call_name;
    const bool numeric =
        !call_index.empty() && call_index.find_first_not_of("0123456789") == std::string::npos;
    call.id =
        "functions." + call_name + ":" + (numeric ? call_index : std::to_string(calls_done + 1));
    call.arguments = call_args.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
    out.tool_calls.push_back(std::move(call));
    ++calls_done;
    raw.clear();
    phase = kTools;
  }

  // Typed argument: strings are raw text, other types compact JSON; a value that is not valid
  // JSON for its type is kept as a string rather than losing the call.
  void finish_argument() {
    ordered_json v;
    if (arg_type == "null") {
      v = nullptr;
    } else if (arg_type != "string") {
      v = ordered_json::parse(value, nullptr, false);
      if (v.is_discarded()) v = value;
    } else {
      v = value;
    }
    call_args[arg_key] = std::move(v);
    phase = kCall;
  }

  void on(const Lexeme& x) {
    const bool text = x.kind == Lexeme::kText;
    switch (phase) {
      case kReasoning:
        if (text) {
          reasoning(x.raw);
        } else if (is_tag(x, Lexeme::kClose, "think")) {
          phase = kAfterThink;
        } else if (is_tag(x, Lexeme::kOpen, "think") && !seen_reasoning) {
          return;  // the prompt's opener, repeated by the model
        } else if (is_tag(x, Lexeme::kOpen, "response")) {
          phase = kResponse;  // think was never closed
        } else if (is_tag(x, Lexeme::kOpen, "tools")) {
          phase = kTools;
        } else if (!ends_message(x)) {
          reasoning(x.raw);
        }
        return;
      case kAfterThink:
      case kAfterResponse:
      case kAfterTools:
        if (text) {
          // Whitespace between channels is dropped; real text is content (a missing opener).
          const size_t first = x.raw.find_first_not_of(" \t\n\r\f\v");
          if (first == std::string::npos) return;
          phase = kResponse;
          content(std::string_view(x.raw).substr(first));
        } else if (is_tag(x, Lexeme::kOpen, "response")) {
          phase = kResponse;
        } else if (is_tag(x, Lexeme::kOpen, "tools")) {
          phase = kTools;
        } else if (!ends_message(x)) {
          phase = kResponse;
          content(x.raw);
        }
        return;
      case kResponse:
        if (text) {
          content(x.raw);
        } else if (is_tag(x, Lexeme::kClose, "response")) {
          phase = kAfterResponse;
        } else if (is_tag(x, Lexeme::kOpen, "response") && !seen_content) {
          return;  // the prompt's opener, repeated by the model
        } else if (is_tag(x, Lexeme::kOpen, "tools")) {
          phase = kTools;  // response was never closed
        } else if (!ends_message(x)) {
          content(x.raw);
        }
        return;
      case kTools:
        raw += x.raw;
        if (text && is_blank(x.raw)) return;
        if (is_tag(x, Lexeme::kClose, "tools")) {
          raw.clear();
          phase = kAfterTools;
        } else if (is_tag(x, Lexeme::kOpen, "call")) {
          const auto attrs = parse_attrs(x.attrs);
          raw = x.raw;
          call_name = attrs ? attr(*attrs, "tool") : "";
          if (call_name.empty()) return malformed();
          call_index = attr(*attrs, "index");
          call_args = ordered_json::object();
          phase = kCall;
        } else if (!ends_message(x)) {
          malformed();
        }
        return;
      case kCall:
        raw += x.raw;
        if (text && is_blank(x.raw)) return;
        if (is_tag(x, Lexeme::kClose, "call")) {
          finish_call();
        } else if (is_tag(x, Lexeme::kOpen, "argument")) {
          const auto attrs = parse_attrs(x.attrs);
          arg_key = attrs ? attr(*attrs, "key") : "";
          if (arg_key.empty()) return malformed();
          arg_type = attr(*attrs, "type");
          value.clear();
          phase = kArg;
        } else if (is_tag(x, Lexeme::kOpen, "json")) {
          value.clear();
          phase = kJson;
        } else {
          malformed();
        }
        return;
      case kArg:
      case kJson:
        raw += x.raw;
        if (text) {
          value += x.raw;
        } else if (phase == kArg && is_tag(x, Lexeme::kClose, "argument")) {
          finish_argument();
        } else if (phase == kJson && is_tag(x, Lexeme::kClose, "json")) {
          // A raw JSON object block stands for all the call's arguments.
          ordered_json v = ordered_json::parse(value, nullptr, false);
          if (!v.is_object()) return malformed();
          call_args = std::move(v);
          phase = kCall;
        } else {
          malformed();
        }
        return;
      case kRaw:
        if (is_tag(x, Lexeme::kClose, "tools"))
          phase = kAfterTools;
        else if (!ends_message(x))
          content(x.raw);
        return;
      case kDone:
        return;  // the turn is over; anything after it is not part of this message
    }
  }

  AssistantDelta take() { return std::exchange(out, AssistantDelta{}); }
};

AssistantStreamParser::AssistantStreamParser(bool thinking) : s_(std::make_unique<State>()) {
  s_->phase = thinking ? State::kReasoning : State::kResponse;
}
AssistantStreamParser::~AssistantStreamParser() = default;
AssistantStreamParser::AssistantStreamParser(AssistantStreamParser&&) noexcept = default;
AssistantStreamParser& AssistantStreamParser::operator=(AssistantStreamParser&&) noexcept = default;

AssistantDelta AssistantStreamParser::feed(std::string_view text) {
  for (const Lexeme& x : s_->lex.feed(text, false)) s_->on(x);
  return s_->take();
}

AssistantDelta AssistantStreamParser::finish() {
  for (const Lexeme& x : s_->lex.feed({}, true)) s_->on(x);
  // A tool call cut off before it closed (max_tokens) is returned as text, not dropped.
  const auto p = s_->phase;
  if ((p == State::kTools || p == State::kCall || p == State::kArg || p == State::kJson) &&
      !is_blank(s_->raw))
    s_->content(s_->raw);
  s_->raw.clear();
  return s_->take();
}

bool AssistantStreamParser::done() const {
  return s_->phase == State::kDone;
}

AssistantOutput parse_assistant_output(std::string_view generated, bool thinking) {
  AssistantStreamParser p(thinking);
  AssistantDelta a = p.feed(generated);
  AssistantDelta b = p.finish();
  AssistantOutput out{std::move(a.content), std::move(a.reasoning_content),
                      std::move(a.tool_calls)};
  out.content += b.content;
  out.reasoning_content += b.reasoning_content;
  for (ToolCall& c : b.tool_calls) out.tool_calls.push_back(std::move(c));
  return out;
}

}  // namespace k3
