// OpenAI request parsing and validation for /v1/completions and /v1/chat/completions. Every
// field a client sends is type-checked here; problems become ApiError (an OpenAI-shaped 4xx),
// never an exception that reaches the HTTP layer unexplained. Unknown fields are ignored, as
// OpenAI-compatible servers do, so newer clients keep working.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/chat.h"

namespace k3::serve {

// An error answer: HTTP status and the fields of {"error": {message, type, param, code}}.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string type = {},
           std::string code = {});
  int status;
  std::string type;   // invalid_request_error (4xx) | server_error (5xx) unless given
  std::string param;  // the offending field, "" when none
  std::string code;
};

nlohmann::json error_json(const ApiError& e);

// The body as a JSON object, or ApiError 400 naming the parse error.
nlohmann::json parse_json_body(std::string_view body);

// Fields shared by both endpoints, validated.
struct GenerationParams {
  std::string model;                  // "" when absent
  std::optional<int64_t> max_tokens;  // max_completion_tokens, else max_tokens; >= 1
  float temperature = 1.0f;           // OpenAI's default; 0 = greedy
  float top_p = 1.0f;                 // (0, 1]
  int top_k = 0;                      // 0 = off (-1 accepted as off, vLLM's spelling)
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  std::vector<int64_t> stop_token_ids;  // vLLM extension
  bool ignore_eos = false;              // vLLM extension
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

struct CompletionRequest {
  GenerationParams gen;
  std::optional<std::string> prompt_text;  // a string prompt ...
  std::vector<int64_t> prompt_ids;         // ... or token ids
};

struct ChatRequest {
  GenerationParams gen;
  std::vector<ChatMessage> messages;
  ChatOptions chat;
};

CompletionRequest parse_completion_request(const nlohmann::json& body);
ChatRequest parse_chat_request(const nlohmann::json& body);

// The context check, with the numbers a client needs: prompt + completion within max_model_len.
// Returns the completion budget (max_tokens, or what is left of the context when absent).
int64_t completion_budget(int64_t prompt_tokens, std::optional<int64_t> max_tokens,
                          int64_t max_model_len);

}  // namespace k3::serve
