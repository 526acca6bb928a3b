// OpenAI response bodies: completions, chat completions, their streaming chunks, the usage
// chunk of stream_options.include_usage, and the model list. Text is always valid UTF-8 here
// (the detokenizer guarantees it); dump() still replaces bad bytes rather than throwing.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "text/chat.h"

namespace k3::serve {

struct Usage {
  int64_t prompt_tokens = 0, completion_tokens = 0;
};

// Identity of one response: every chunk of a stream repeats it.
struct ResponseIds {
  std::string id;       // cmpl-... | chatcmpl-...
  int64_t created = 0;  // unix seconds
  std::string model;
};
ResponseIds new_response_ids(const std::string& prefix, const std::string& model);

nlohmann::json usage_json(const Usage& u);

nlohmann::json completion_response(const ResponseIds& ids, const std::string& text,
                                   const std::string& finish_reason, const Usage& u);
// finish_reason "" -> null (not the last chunk). include_usage adds "usage": null, as OpenAI
// does on every chunk but the final usage chunk.
nlohmann::json completion_chunk(const ResponseIds& ids, const std::string& text,
                                const std::string& finish_reason, bool include_usage);

// finish_reason "stop" becomes "tool_calls" when the output has tool calls.
nlohmann::json chat_response(const ResponseIds& ids, const AssistantOutput& out,
                             const std::string& finish_reason, const Usage& u);
nlohmann::json chat_chunk(const ResponseIds& ids, const nlohmann::json& delta,
                          const std::string& finish_reason, bool include_usage);
// The delta of an AssistantDelta; tool calls numbered from *next_tool_index on.
nlohmann::json chat_delta(const AssistantDelta& d, int* next_tool_index);

// The final chunk of stream_options.include_usage: empty choices, the usage.
nlohmann::json usage_chunk(const ResponseIds& ids, const char* object, const Usage& u);

// One server-sent event: "data: <json>\n\n".
std::string sse_event(const nlohmann::json& j);
std::string dump(const nlohmann::json& j);

}  // namespace k3::serve
