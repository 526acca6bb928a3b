// K3 prompt rendering (a port of the facts of `encoding_k3.build_chat_segments`, see chat.h) and
// OpenAI message parsing.
#include "text/chat.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "core/error.h"

namespace k3 {
namespace {

using ordered_json = nlohmann::ordered_json;
using Attrs = std::vector<std::pair<std::string_view, std::string>>;

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); });
}

std::string_view strip(std::string_view s) {
  while (!s.empty() && is_blank(s.substr(0, 1))) s.remove_prefix(1);
  while (!s.empty() && is_blank(s.substr(s.size() - 1))) s.remove_suffix(1);
  return s;
}

// Attribute values escape `&` first, then `"`; `<` and `>` stay literal (the markup's brackets are
// tokens, not characters).
std::string escape_attr(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '&')
      out += "&amp;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

// Upstream's `_json_compact` (tool schemas, response schemas): sorted keys, "," and ":".
std::string json_compact(const nlohmann::json& v) {
  return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Upstream renders non-string tool arguments with Python's default json.dumps: ", " and ": "
// separators, key order as given, UTF-8 unescaped.
void python_dump(const ordered_json& v, std::string& out) {
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [k, x] : v.items()) {
      if (!first) out += ", ";
      first = false;
      out += ordered_json(k).dump(-1, ' ', false, ordered_json::error_handler_t::replace);
      out += ": ";
      python_dump(x, out);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) out += ", ";
      python_dump(v[i], out);
    }
    out += ']';
  } else {
    out += v.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  }
}

const char* xtml_type(const ordered_json& v) {
  if (v.is_boolean()) return "boolean";
  if (v.is_null()) return "null";
  if (v.is_number()) return "number";
  if (v.is_string()) return "string";
  if (v.is_object()) return "object";
  return "array";
}

// Builds the segment list; the split points follow upstream (one segment per attribute piece)
// because each segment is BPE-encoded on its own there.
class Builder {
 public:
  std::vector<ChatSegment> out;

  void control(std::string_view t) { push(t, true); }
  void text(std::string_view t) { push(t, false); }
  void open(std::string_view tag, const Attrs& attrs = {}) {
    control(xtml::kOpen);
    text(tag);
    for (const auto& [k, v] : attrs) {
      text(std::string(" ") + std::string(k));
      text("=\"");
      text(escape_attr(v));
      text("\"");
    }
    control(xtml::kSep);
  }
  void close(std::string_view tag) {
    control(xtml::kClose);
    text(tag);
    control(xtml::kSep);
  }
  void end_message() {
    close("message");
    control(xtml::kEndOfMsg);
  }
  // A system turn synthesized from a request option (tools, effort, tool_choice, format).
  void option_message(std::string_view type, std::string_view body) {
    open("message", {{"role", "system"}, {"type", std::string(type)}});
    text(strip(body));
    end_message();
  }

 private:
  void push(std::string_view t, bool special) {
    if (!t.empty()) out.push_back({std::string(t), special});
  }
};

void render_tool_call(Builder& b, const ToolCall& call, size_t index, size_t msg_index) {
  K3_CHECK(!call.name.empty(), "chat message ", msg_index, ": tool call ", index,
           " has no function name");
  b.open("call", {{"tool", call.name}, {"index", std::to_string(index)}});
  if (!is_blank(call.arguments)) {
    ordered_json args = ordered_json::parse(call.arguments, nullptr, false);
    if (args.is_discarded()) {
      // Arguments that are not JSON are shown back verbatim in a json block.
      b.open("json", {{"type", "object"}});
      b.text(call.arguments);
      b.close("json");
    } else {
      K3_CHECK(args.is_object(), "chat message ", msg_index, ": tool call '", call.name,
               "' arguments must be a JSON object");
      for (const auto& [key, value] : args.items()) {
        b.open("argument", {{"key", key}, {"type", xtml_type(value)}});
        if (value.is_string()) {
          b.text(value.get_ref<const std::string&>());
        } else {
          std::string s;
          python_dump(value, s);
          b.text(s);
        }
        b.close("argument");
      }
    }
  }
  b.close("call");
}

void render_assistant(Builder& b, const ChatMessage& m, bool thinking, size_t msg_index) {
  // The think channel is structural: always present in thinking mode (history keeps its
  // reasoning: K3 only supports preserved thinking), absent in instruct mode.
  if (thinking) {
    b.open("think");
    if (!is_blank(m.reasoning_content)) b.text(m.reasoning_content);
    b.close("think");
  }
  b.open("response");
  b.text(m.content);
  b.close("response");
  if (!m.tool_calls.empty()) {
    b.open("tools");
    for (size_t i = 0; i < m.tool_calls.size(); ++i)
      render_tool_call(b, m.tool_calls[i], i + 1, msg_index);
    b.close("tools");
  }
}

// K3 binds tool results to calls by position (index attribute), OpenAI by tool_call_id. Each run
// of tool messages that all match the preceding assistant's call ids is sorted into call order and
// takes the call's name; a run that does not fully match is left as sent.
std::vector<ChatMessage> order_tool_results(const std::vector<ChatMessage>& msgs) {
  std::vector<ChatMessage> out;
  const std::vector<ToolCall>* calls = nullptr;
  for (size_t i = 0; i < msgs.size();) {
    if (msgs[i].role != "tool") {
      if (msgs[i].role == "assistant") calls = &msgs[i].tool_calls;
      out.push_back(msgs[i++]);
      continue;
    }
    std::vector<std::pair<size_t, size_t>> run;  // (call position, message index)
    bool all_matched = calls != nullptr;
    for (; i < msgs.size() && msgs[i].role == "tool"; ++i) {
      size_t pos = 0;
      while (calls && pos < calls->size() &&
             (msgs[i].tool_call_id.empty() || (*calls)[pos].id != msgs[i].tool_call_id))
        ++pos;
      if (!calls || pos == calls->size()) all_matched = false;
      run.emplace_back(pos, i);
    }
    if (all_matched) std::stable_sort(run.begin(), run.end());
    for (const auto& [pos, idx] : run) {
      out.push_back(msgs[idx]);
      if (all_matched) out.back().name = (*calls)[pos].name;
    }
  }
  return out;
}

void render_options_after(Builder& b, const ChatOptions& opt) {
  if (opt.tool_choice == "required") {
    b.option_message("tool-choice",
                     "The system is invoked with `tool_choice=required`.\n"
                     "You MUST call tools in the next message.");
  } else if (opt.tool_choice == "none") {
    b.option_message("tool-choice",
                     "The system is invoked with `tool_choice=none`.\n"
                     "You MUST NOT call any tools in the next message.");
  } else {
    K3_CHECK(opt.tool_choice == "auto" || opt.tool_choice.empty(), "tool_choice '", opt.tool_choice,
             "' is not one of auto, none, required");
  }
  const nlohmann::json& rf = opt.response_format;
  if (rf.is_null()) return;
  K3_CHECK(rf.is_object() && rf.contains("type") && rf["type"].is_string(),
           "response_format must be an object with a string 'type'");
  const std::string type = rf["type"].get<std::string>();
  const std::string head = "The system is invoked with `response_format=" + type +
                           "`.\nYour response must be raw JSON data without markdown code "
                           "blocks (```json) or any additional formatting.";
  if (type == "json_object") {
    b.option_message("response-format", head);
  } else if (type == "json_schema") {
    nlohmann::json schema = nullptr;
    if (rf.contains("json_schema") && rf["json_schema"].is_object()) {
      const auto& js = rf["json_schema"];
      schema = js.contains("schema")        ? js["schema"]
               : js.contains("json_schema") ? js["json_schema"]
                                            : js;
    }
    b.option_message("response-format", head +
                                            "\nThe JSON data must match the following schema:\n"
                                            "```json\n" +
                                            json_compact(schema) + "\n```");
  } else {
    K3_CHECK(type == "text", "response_format type '", type,
             "' is not one of text, json_object, json_schema");
  }
}

}  // namespace

std::vector<ChatSegment> render_chat_segments(const std::vector<ChatMessage>& msgs_in,
                                              const ChatOptions& opt) {
  Builder b;
  // Global options first: they rarely change, so the KV-cache prefix survives across requests.
  K3_CHECK(opt.tools.is_array() || opt.tools.is_null(), "tools must be an array");
  if (opt.tools.is_array() && !opt.tools.empty()) {
    b.option_message(
        "tool-declare",
        "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n" +
            json_compact(opt.tools) + "\n```");
  }
  if (opt.thinking && !opt.thinking_effort.empty()) {
    // Upstream accepts these three although the message text names four levels.
    const std::string& e = opt.thinking_effort;
    K3_CHECK(e == "low" || e == "high" || e == "max", "thinking_effort '", e,
             "' is not one of low, high, max");
    b.option_message("thinking-effort",
                     "`thinking_effort` guides on how much to think in your thinking channel "
                     "(not including the response channel), supported values include `low`, "
                     "`medium`, `high`, and `max`.\nNow the system is invoked with "
                     "`thinking_effort=" +
                         e + "`.");
  }

  const std::vector<ChatMessage> msgs = order_tool_results(msgs_in);
  const std::vector<ToolCall>* calls = nullptr;
  size_t tool_index = 0;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const ChatMessage& m = msgs[i];
    if (m.role == "tool") {
      ++tool_index;
      std::string tool = m.name;
      if (tool.empty() && calls && tool_index <= calls->size())
        tool = (*calls)[tool_index - 1].name;
      K3_CHECK(!tool.empty(), "chat message ", i,
               " (tool): needs a name or a matching tool call in the preceding assistant message");
      b.open("message", {{"role", "tool"}, {"tool", tool}, {"index", std::to_string(tool_index)}});
      b.text(m.content);
      b.end_message();
      continue;
    }
    K3_CHECK(m.role == "system" || m.role == "user" || m.role == "assistant", "chat message ", i,
             ": unknown role '", m.role, "'");
    Attrs attrs = {{"role", m.role}};
    if (!m.name.empty()) attrs.emplace_back("name", m.name);
    b.open("message", attrs);
    if (m.role == "assistant") {
      calls = &m.tool_calls;
      tool_index = 0;
      render_assistant(b, m, opt.thinking, i);
    } else {
      b.text(m.content);
    }
    b.end_message();
  }

  // One-shot options after the conversation, so changing them per request keeps the history cached.
  render_options_after(b, opt);
  if (opt.add_generation_prompt) {
    // The turn is handed over unclosed; the opened channel selects thinking or instruct mode.
    b.open("message", {{"role", "assistant"}});
    b.open(opt.thinking ? "think" : "response");
  }
  return std::move(b.out);
}

std::string render_chat(const std::vector<ChatMessage>& msgs, const ChatOptions& opt) {
  std::string out;
  for (const ChatSegment& s : render_chat_segments(msgs, opt)) out += s.text;
  return out;
}

std::string_view end_of_turn_token() {
  return xtml::kEndOfMsg;
}

const std::vector<std::string>& chat_stop_strings() {
  // <|end_of_msg|> ends every turn (config eos_token_id); [EOS] guards against base-model drift.
  static const std::vector<std::string> stops = {std::string(xtml::kEndOfMsg),
                                                 std::string(xtml::kEos)};
  return stops;
}

}  // namespace k3
