#include "serve/openai_response.h"

#include <chrono>
#include <random>

namespace k3::serve {

using json = nlohmann::json;

namespace {

json tool_call_json(const ToolCall& c) {
  return {{"id", c.id},
          {"type", "function"},
          {"function", {{"name", c.name}, {"arguments", c.arguments}}}};
}

json reason_or_null(const std::string& r) {
  return r.empty() ? json(nullptr) : json(r);
}

}  // namespace

ResponseIds new_response_ids(const std::string& prefix, const std::string& model) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static const char* hex = "0123456789abcdef";
  std::string id = prefix + "-";
  for (int i = 0; i < 24; ++i) id += hex[rng() & 15];
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return {id, std::chrono::duration_cast<std::chrono::seconds>(now).count(), model};
}

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

json completion_response(const ResponseIds& ids, const std::string& text,
                         const std::string& finish_reason, const Usage& u) {
  json choice = {{"index", 0},
                 {"text", text},
                 {"logprobs", nullptr},
                 {"finish_reason", reason_or_null(finish_reason)}};
  return {{"id", ids.id},       {"object", "text_completion"},      {"created", ids.created},
          {"model", ids.model}, {"choices", json::array({choice})}, {"usage", usage_json(u)}};
}

json completion_chunk(const ResponseIds& ids, const std::string& text,
                      const std::string& finish_reason, bool include_usage) {
  json choice = {{"index", 0},
                 {"text", text},
                 {"logprobs", nullptr},
                 {"finish_reason", reason_or_null(finish_reason)}};
  json j = {{"id", ids.id},
            {"object", "text_completion"},
            {"created", ids.created},
            {"model", ids.model},
            {"choices", json::array({choice})}};
  if (include_usage) j["usage"] = nullptr;
  return j;
}

json chat_response(const ResponseIds& ids, const AssistantOutput& out,
                   const std::string& finish_reason, const Usage& u) {
  json msg = {{"role", "assistant"}, {"content", out.content}};
  msg["reasoning_content"] =
      out.reasoning_content.empty() ? json(nullptr) : json(out.reasoning_content);
  if (!out.tool_calls.empty()) {
    json calls = json::array();
    for (const auto& c : out.tool_calls) calls.push_back(tool_call_json(c));
    msg["tool_calls"] = calls;
  } else {
    msg["tool_calls"] = json::array();
  }
  const std::string reason =
      finish_reason == "stop" && !out.tool_calls.empty() ? "tool_calls" : finish_reason;
  json choice = {{"index", 0},
                 {"message", msg},
                 {"logprobs", nullptr},
                 {"finish_reason", reason_or_null(reason)}};
  return {{"id", ids.id},       {"object", "chat.completion"},      {"created", ids.created},
          {"model", ids.model}, {"choices", json::array({choice})}, {"usage", usage_json(u)}};
}

json chat_chunk(const ResponseIds& ids, const json& delta, const std::string& finish_reason,
                bool include_usage) {
  json choice = {{"index", 0},
                 {"delta", delta},
                 {"logprobs", nullptr},
                 {"finish_reason", reason_or_null(finish_reason)}};
  json j = {{"id", ids.id},
            {"object", "chat.completion.chunk"},
            {"created", ids.created},
            {"model", ids.model},
            {"choices", json::array({choice})}};
  if (include_usage) j["usage"] = nullptr;
  return j;
}

json chat_delta(const AssistantDelta& d, int* next_tool_index) {
  json delta = json::object();
  if (!d.reasoning_content.empty()) delta["reasoning_content"] = d.reasoning_content;
  if (!d.content.empty()) delta["content"] = d.content;
  if (!d.tool_calls.empty()) {
    json calls = json::array();
    for (const auto& c : d.tool_calls) {
      json call = tool_call_json(c);
      call["index"] = (*next_tool_index)++;
      calls.push_back(call);
    }
    delta["tool_calls"] = calls;
  }
  return delta;
}

json usage_chunk(const ResponseIds& ids, const char* object, const Usage& u) {
  return {{"id", ids.id},       {"object", object},         {"created", ids.created},
          {"model", ids.model}, {"choices", json::array()}, {"usage", usage_json(u)}};
}

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string sse_event(const json& j) {
  return "data: " + dump(j) + "\n\n";
}

}  // namespace k3::serve
