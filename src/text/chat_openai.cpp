// OpenAI chat `messages` JSON -> ChatMessage. Request errors name the message index and field so
// the server can return them verbatim as a 400.
#include <string>

#include "core/error.h"
#include "text/chat.h"

namespace k3 {
namespace {

using nlohmann::json;

[[noreturn]] void bad(size_t i, std::string_view field, std::string_view what) {
  fail("messages[", i, "].", field, ": ", what);
}

const char* type_name(const json& v) {
  return v.type_name();
}

// Optional string field: absent or null -> "", string -> value, anything else -> error.
std::string opt_string(const json& m, size_t i, const char* field) {
  auto it = m.find(field);
  if (it == m.end() || it->is_null()) return {};
  if (!it->is_string()) bad(i, field, std::string("expected a string, got ") + type_name(*it));
  return it->get<std::string>();
}

// content: a string, or an array of {type: "text", text: string} parts (concatenated; K3 has no
// separator between parts). Returns false when absent or null.
bool read_content(const json& m, size_t i, std::string& out) {
  auto it = m.find("content");
  if (it == m.end() || it->is_null()) return false;
  if (it->is_string()) {
    out = it->get<std::string>();
    return true;
  }
  if (!it->is_array())
    bad(i, "content", std::string("expected a string or an array of parts, got ") + type_name(*it));
  for (size_t j = 0; j < it->size(); ++j) {
    const json& part = (*it)[j];
    const std::string f = "content[" + std::to_string(j) + "]";
    if (!part.is_object()) bad(i, f, "expected an object");
    auto type = part.find("type");
    if (type == part.end() || !type->is_string()) bad(i, f + ".type", "missing or not a string");
    if (*type != "text")
      bad(i, f + ".type",
          "unsupported content part '" + type->get<std::string>() + "' (only text is supported)");
    auto text = part.find("text");
    if (text == part.end() || !text->is_string()) bad(i, f + ".text", "missing or not a string");
    out += text->get<std::string>();
  }
  return true;
}

ToolCall read_tool_call(const json& tc, size_t i, size_t j) {
  const std::string f = "tool_calls[" + std::to_string(j) + "]";
  if (!tc.is_object()) bad(i, f, "expected an object");
  ToolCall call;
  if (auto id = tc.find("id"); id != tc.end() && !id->is_null()) {
    if (!id->is_string()) bad(i, f + ".id", "expected a string");
    call.id = id->get<std::string>();
  }
  if (auto type = tc.find("type"); type != tc.end() && !type->is_null() && *type != "function")
    bad(i, f + ".type", "only 'function' tool calls are supported");
  auto fn = tc.find("function");
  if (fn == tc.end() || !fn->is_object()) bad(i, f + ".function", "missing or not an object");
  auto name = fn->find("name");
  if (name == fn->end() || !name->is_string() || name->get<std::string>().empty())
    bad(i, f + ".function.name", "missing or not a non-empty string");
  call.name = name->get<std::string>();
  auto args = fn->find("arguments");
  if (args == fn->end() || args->is_null()) {
    call.arguments = "{}";
  } else if (args->is_string()) {
    call.arguments = args->get<std::string>();  // kept verbatim; rendering checks it
  } else if (args->is_object()) {
    // OpenAI sends a string (whose key order is kept); an object has already lost its order in
    // nlohmann::json and renders with sorted keys.
    call.arguments = args->dump();
  } else {
    bad(i, f + ".function.arguments", "expected a JSON object or a JSON string");
  }
  return call;
}

}  // namespace

std::vector<ChatMessage> parse_openai_messages(const json& messages) {
  K3_CHECK(messages.is_array(), "messages: expected an array, got ", messages.type_name());
  std::vector<ChatMessage> out;
  out.reserve(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    if (!m.is_object()) fail("messages[", i, "]: expected an object, got ", m.type_name());
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) bad(i, "role", "missing or not a string");
    ChatMessage msg;
    msg.role = role->get<std::string>();
    if (msg.role == "developer") msg.role = "system";  // OpenAI's newer name for system
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool")
      bad(i, "role", "'" + msg.role + "' is not one of system, user, assistant, tool");
    msg.name = opt_string(m, i, "name");
    const bool has_content = read_content(m, i, msg.content);

    if (msg.role == "assistant") {
      msg.reasoning_content = opt_string(m, i, "reasoning_content");
      if (msg.reasoning_content.empty()) msg.reasoning_content = opt_string(m, i, "reasoning");
      if (auto tcs = m.find("tool_calls"); tcs != m.end() && !tcs->is_null()) {
        if (!tcs->is_array()) bad(i, "tool_calls", "expected an array");
        for (size_t j = 0; j < tcs->size(); ++j)
          msg.tool_calls.push_back(read_tool_call((*tcs)[j], i, j));
      }
      if (!has_content && msg.tool_calls.empty() && msg.reasoning_content.empty())
        bad(i, "content", "missing (an assistant message needs content or tool_calls)");
    } else {
      if (!has_content) bad(i, "content", "missing");
      if (auto tcs = m.find("tool_calls"); tcs != m.end() && !tcs->is_null())
        bad(i, "tool_calls", "only assistant messages carry tool calls");
      if (msg.role == "tool") msg.tool_call_id = opt_string(m, i, "tool_call_id");
    }
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace k3
