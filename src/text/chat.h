// Kimi K3 chat format ("XTML"): prompt rendering, OpenAI message parsing, and parsing of the
// assistant's output (reasoning / content / tool calls), one-shot and streaming.
//
// Source of the format: K3 ships no Jinja chat template. Its prompt is built in Python by
// `encoding_k3.py` (`build_chat_segments`) in the moonshotai/Kimi-K3 model repository, called
// from `tokenization_kimi.py`'s `apply_chat_template`. That file is not in our reference corpus;
// this implementation follows the K3 tech report's chat-template appendix and several ports that
// state they mirror `encoding_k3.py` byte for byte (listed in DESIGN.md). Every token string the
// format uses is in the one table below, so a correction happens in one place.
//
// Shape (every tag is `<|open|>name attrs<|sep|>` ... `<|close|>name<|sep|>`):
//   <|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>
//   <|open|>message role="assistant"<|sep|><|open|>think<|sep|>...<|close|>think<|sep|>
//     <|open|>response<|sep|>...<|close|>response<|sep|>
//     <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
//       <|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>
//     <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace k3 {

// The special tokens of the chat format with their K3 tokenizer ids (tiktoken ranks 163584+).
// The single place these strings are spelled; everything else builds on xtml::kOpen etc.
struct ChatSpecialToken {
  std::string_view text;
  int64_t id;
};
namespace xtml {
inline constexpr std::string_view kOpen = "<|open|>";
inline constexpr std::string_view kClose = "<|close|>";
inline constexpr std::string_view kSep = "<|sep|>";
inline constexpr std::string_view kEndOfMsg = "<|end_of_msg|>";
inline constexpr std::string_view kEos = "[EOS]";  // pretraining end of text
inline constexpr ChatSpecialToken kTokens[] = {
    {"[BOS]", 163584}, {kEos, 163585},   {kEndOfMsg, 163586},
    {kOpen, 163587},   {kClose, 163588}, {kSep, 163589},
};
inline constexpr int64_t kEndOfMsgId = 163586;
}  // namespace xtml

struct ToolCall {
  std::string id;  // "functions.<name>:<index>" for parsed output (index is K3's 1-based)
  std::string name;
  std::string arguments;  // JSON text (an object)
};

struct ChatMessage {
  std::string role;  // system | user | assistant | tool
  std::string content;
  std::string reasoning_content;     // assistant only
  std::vector<ToolCall> tool_calls;  // assistant only
  std::string tool_call_id;          // tool only: binds the result to an assistant ToolCall::id
  std::string name;  // optional `name` attribute; for tool messages, the tool's name
};

struct ChatOptions {
  bool add_generation_prompt = true;
  bool thinking = true;                            // false = K3's instruct mode
  nlohmann::json tools = nlohmann::json::array();  // OpenAI tools array
  // Extensions with upstream defaults. thinking_effort: "low" | "high" | "max" (apply_chat_template
  // defaults to "max"), "" = no effort message; only rendered when thinking.
  std::string thinking_effort = "max";
  std::string tool_choice = "auto";  // "auto" | "none" | "required" (named choice: map upstream)
  nlohmann::json response_format = nullptr;  // OpenAI response_format: text|json_object|json_schema
};

// A run of prompt text: `special` runs hold only format tokens (encode with allow_special); the
// others hold text that must be encoded as ordinary text, so a user typing "<|end_of_msg|>" cannot
// end a turn. Upstream encodes each segment separately; the split mirrors it.
struct ChatSegment {
  std::string text;
  bool special = false;
};

// Renders to the prompt text (special tokens as their strings; the tokenizer encodes with
// allow_special). Throws k3::Error for requests K3 cannot render (unknown role, tool result with
// no resolvable tool, non-object tool arguments, bad option values).
std::string render_chat(const std::vector<ChatMessage>& msgs, const ChatOptions& opt);
std::vector<ChatSegment> render_chat_segments(const std::vector<ChatMessage>& msgs,
                                              const ChatOptions& opt);

// Parses OpenAI chat messages JSON (content as string or array of {type:text,text}; tool_calls;
// tool role; "developer" is read as system) -> messages. Errors (bad role, missing content,
// non-text parts, wrong types) are k3::Error naming the message index and field.
std::vector<ChatMessage> parse_openai_messages(const nlohmann::json& messages);

// The end-of-turn token string ("<|end_of_msg|>", id 163586) and all stop strings of the format.
std::string_view end_of_turn_token();
const std::vector<std::string>& chat_stop_strings();

struct AssistantOutput {
  std::string content;
  std::string reasoning_content;
  std::vector<ToolCall> tool_calls;
};
// `generated` is the decoded completion with special tokens kept as strings; it starts inside the
// channel the prompt opened (think when `thinking`, else response). Never throws: malformed or
// unclosed tool calls fall back to content.
AssistantOutput parse_assistant_output(std::string_view generated, bool thinking);

// Streaming: feed decoded text deltas, get OpenAI-style deltas without ever emitting part of a
// marker; totals equal parse_assistant_output on the concatenated text for any chunking.
struct AssistantDelta {
  std::string content;
  std::string reasoning_content;
  std::vector<ToolCall> tool_calls;  // complete calls once closed
  bool empty() const { return content.empty() && reasoning_content.empty() && tool_calls.empty(); }
};
class AssistantStreamParser {
 public:
  explicit AssistantStreamParser(bool thinking);
  ~AssistantStreamParser();
  AssistantStreamParser(AssistantStreamParser&&) noexcept;
  AssistantStreamParser& operator=(AssistantStreamParser&&) noexcept;
  AssistantDelta feed(std::string_view text);
  AssistantDelta finish();  // flushes held text; call once at the end of generation
  // True once the message is closed (<|close|>message<|sep|> or <|end_of_msg|>): stop decoding.
  bool done() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace k3
