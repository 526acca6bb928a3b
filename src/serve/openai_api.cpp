#include "serve/openai_api.h"

#include <cmath>
#include <limits>

#include "core/error.h"

namespace k3::serve {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxStops = 16, kMaxStopBytes = 512, kMaxStopTokenIds = 256;

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, param);
}

const char* type_name(const json& v) {
  return v.type_name();  // "string", "number", "boolean", "array", "object", "null"
}

// A present, non-null field (null means "not given", as the OpenAI API treats it).
const json* field(const json& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

double number(const json& v, const char* key) {
  // nlohmann keeps booleans apart from numbers, so `true` is rejected here too.
  if (!v.is_number()) bad(key, std::string(key) + " must be a number, got " + type_name(v));
  const double d = v.get<double>();
  if (!std::isfinite(d)) bad(key, std::string(key) + " must be finite");
  return d;
}

int64_t integer(const json& v, const char* key) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      bad(key, std::string(key) + " is too large");
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  // 16.0 is an integer to most JSON producers (JavaScript has no other kind).
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15)
      return static_cast<int64_t>(d);
  }
  bad(key, std::string(key) + " must be an integer, got " +
               (v.is_number() ? std::string("a fractional number") : std::string(type_name(v))));
}

bool boolean(const json& v, const char* key) {
  if (!v.is_boolean()) bad(key, std::string(key) + " must be a boolean, got " + type_name(v));
  return v.get<bool>();
}

std::string string(const json& v, const char* key) {
  if (!v.is_string()) bad(key, std::string(key) + " must be a string, got " + type_name(v));
  return v.get<std::string>();
}

std::vector<std::string> stop_list(const json& v) {
  std::vector<std::string> out;
  if (v.is_string()) {
    out.push_back(v.get<std::string>());
  } else if (v.is_array()) {
    for (const auto& s : v) {
      if (!s.is_string()) bad("stop", "stop must be a string or an array of strings");
      out.push_back(s.get<std::string>());
    }
  } else {
    bad("stop", std::string("stop must be a string or an array of strings, got ") + type_name(v));
  }
  std::erase_if(out, [](const std::string& s) { return s.empty(); });  // matches nothing
  // Bounded so that matching stays cheap per token (OpenAI allows 4).
  if (out.size() > kMaxStops) bad("stop", "at most " + std::to_string(kMaxStops) + " stop strings");
  for (const auto& s : out)
    if (s.size() > kMaxStopBytes)
      bad("stop", "stop strings must be at most " + std::to_string(kMaxStopBytes) + " bytes");
  return out;
}

// Features whose absence would change the answer are refused rather than ignored.
void refuse_unsupported(const json& body) {
  if (const json* n = field(body, "n")) {
    const int64_t v = integer(*n, "n");
    if (v > 1) bad("n", "n > 1 is not supported");
    if (v < 1) bad("n", "n must be >= 1, got " + std::to_string(v));
  }
  if (const json* b = field(body, "best_of"); b && integer(*b, "best_of") > 1)
    bad("best_of", "best_of > 1 is not supported");
  if (const json* e = field(body, "echo"); e && boolean(*e, "echo"))
    bad("echo", "echo is not supported");
  if (const json* s = field(body, "suffix"); s && !string(*s, "suffix").empty())
    bad("suffix", "suffix is not supported");
  if (const json* l = field(body, "logprobs")) {
    const bool on = l->is_boolean() ? l->get<bool>() : integer(*l, "logprobs") > 0;
    if (on) bad("logprobs", "logprobs are not supported");
  }
}

GenerationParams parse_common(const json& body, bool chat) {
  if (!body.is_object()) bad("", "the request body must be a JSON object");
  refuse_unsupported(body);
  GenerationParams g;
  if (const json* m = field(body, "model")) g.model = string(*m, "model");
  // Chat: max_completion_tokens supersedes the deprecated max_tokens. Completions default to
  // 16 tokens (OpenAI's default); chat to the rest of the context.
  if (!chat) g.max_tokens = 16;
  for (const char* key : {"max_tokens", "max_completion_tokens"})
    if (const json* v = field(body, key)) {
      const int64_t n = integer(*v, key);
      if (n < 1) bad(key, std::string(key) + " must be >= 1, got " + std::to_string(n));
      g.max_tokens = n;
    }
  if (const json* v = field(body, "temperature")) {
    const double t = number(*v, "temperature");
    if (t < 0) bad("temperature", "temperature must be >= 0, got " + v->dump());
    g.temperature = static_cast<float>(t);
  }
  if (const json* v = field(body, "top_p")) {
    const double p = number(*v, "top_p");
    if (!(p > 0 && p <= 1)) bad("top_p", "top_p must be in (0, 1], got " + v->dump());
    g.top_p = static_cast<float>(p);
  }
  if (const json* v = field(body, "top_k")) {
    const int64_t k = integer(*v, "top_k");
    if (k < -1) bad("top_k", "top_k must be -1 (off), 0 (off) or positive, got " + v->dump());
    g.top_k = k <= 0 ? 0 : static_cast<int>(std::min<int64_t>(k, 1 << 30));
  }
  if (const json* v = field(body, "seed"))
    g.seed = static_cast<uint64_t>(integer(*v, "seed"));  // negative seeds wrap, still distinct
  if (const json* v = field(body, "stop")) g.stop = stop_list(*v);
  if (const json* v = field(body, "stop_token_ids")) {
    if (!v->is_array()) bad("stop_token_ids", "stop_token_ids must be an array of integers");
    if (v->size() > kMaxStopTokenIds)
      bad("stop_token_ids", "at most " + std::to_string(kMaxStopTokenIds) + " stop_token_ids");
    for (const auto& id : *v) {
      const int64_t t = integer(id, "stop_token_ids");
      if (t < 0) bad("stop_token_ids", "stop_token_ids must be >= 0");
      g.stop_token_ids.push_back(t);
    }
  }
  if (const json* v = field(body, "ignore_eos")) g.ignore_eos = boolean(*v, "ignore_eos");
  if (const json* v = field(body, "stream")) g.stream = boolean(*v, "stream");
  if (const json* v = field(body, "stream_options")) {
    if (!v->is_object()) bad("stream_options", "stream_options must be an object");
    if (const json* u = field(*v, "include_usage"))
      g.include_usage = boolean(*u, "stream_options.include_usage");
  }
  return g;
}

std::vector<int64_t> token_ids(const json& arr) {
  std::vector<int64_t> ids;
  for (const auto& t : arr) {
    const int64_t id = integer(t, "prompt");
    if (id < 0) bad("prompt", "prompt token ids must be >= 0, got " + std::to_string(id));
    ids.push_back(id);
  }
  return ids;
}

}  // namespace

ApiError::ApiError(int status_, std::string message, std::string param_, std::string type_,
                   std::string code_)
    : std::runtime_error(std::move(message)),
      status(status_),
      type(type_.empty() ? (status_ >= 500 ? "server_error" : "invalid_request_error") : type_),
      param(std::move(param_)),
      code(std::move(code_)) {}

json error_json(const ApiError& e) {
  json err = {{"message", e.what()}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) err["param"] = e.param;
  err["code"] = e.code.empty() ? json(e.status) : json(e.code);
  return {{"error", err}};
}

json parse_json_body(std::string_view body) {
  // Deeply nested values are refused while parsing: later recursive walks over client JSON
  // (dumping tool schemas, say) must not be able to exhaust the stack.
  constexpr int kMaxDepth = 64;
  bool too_deep = false;
  const json::parser_callback_t depth_check = [&](int depth, json::parse_event_t, json&) {
    if (depth > kMaxDepth) too_deep = true;
    return !too_deep;
  };
  json doc;
  try {
    doc = json::parse(body, depth_check);
  } catch (const json::parse_error& e) {
    bad("", std::string("the request body is not valid JSON: ") + e.what());
  }
  if (too_deep)
    bad("", "the request body nests deeper than " + std::to_string(kMaxDepth) + " levels");
  if (!doc.is_object()) bad("", "the request body must be a JSON object");
  return doc;
}

CompletionRequest parse_completion_request(const json& body) {
  CompletionRequest r;
  r.gen = parse_common(body, false);
  const json* p = field(body, "prompt");
  if (!p) bad("prompt", "prompt is required");
  if (p->is_string()) {
    r.prompt_text = p->get<std::string>();
  } else if (p->is_array()) {
    if (p->empty()) bad("prompt", "prompt must not be empty");
    if ((*p)[0].is_string() || (*p)[0].is_array()) {
      if (p->size() > 1)
        bad("prompt", "batched prompts (" + std::to_string(p->size()) +
                          ") are not supported; send one request per prompt");
      const json& one = (*p)[0];
      if (one.is_string())
        r.prompt_text = one.get<std::string>();
      else
        r.prompt_ids = token_ids(one);
    } else {
      r.prompt_ids = token_ids(*p);
    }
    if (!r.prompt_text && r.prompt_ids.empty()) bad("prompt", "prompt must not be empty");
  } else {
    bad("prompt",
        std::string("prompt must be a string or an array of token ids, got ") + type_name(*p));
  }
  return r;
}

ChatRequest parse_chat_request(const json& body) {
  ChatRequest r;
  r.gen = parse_common(body, true);
  const json* m = field(body, "messages");
  if (!m) bad("messages", "messages is required");
  if (!m->is_array() || m->empty()) bad("messages", "messages must be a non-empty array");
  try {
    r.messages = parse_openai_messages(*m);
  } catch (const std::exception& e) {  // k3::Error, or a JSON type error: the client's input
    bad("messages", e.what());
  }
  if (const json* t = field(body, "tools")) {
    if (!t->is_array()) bad("tools", "tools must be an array");
    r.chat.tools = *t;
  }
  if (const json* c = field(body, "tool_choice")) {
    if (!c->is_string())
      bad("tool_choice",
          "tool_choice naming a function is not supported; use auto, none or "
          "required");
    r.chat.tool_choice = c->get<std::string>();
  }
  if (const json* f = field(body, "response_format")) r.chat.response_format = *f;
  if (const json* a = field(body, "add_generation_prompt"))
    r.chat.add_generation_prompt = boolean(*a, "add_generation_prompt");
  if (const json* k = field(body, "chat_template_kwargs")) {
    if (!k->is_object()) bad("chat_template_kwargs", "chat_template_kwargs must be an object");
    for (const char* key : {"thinking", "enable_thinking"})
      if (const json* v = field(*k, key)) r.chat.thinking = boolean(*v, key);
    if (const json* v = field(*k, "thinking_effort"))
      r.chat.thinking_effort = string(*v, "thinking_effort");
  }
  return r;
}

int64_t completion_budget(int64_t prompt_tokens, std::optional<int64_t> max_tokens,
                          int64_t max_model_len) {
  const std::string limit =
      "This model's maximum context length is " + std::to_string(max_model_len) + " tokens. ";
  if (prompt_tokens >= max_model_len)
    throw ApiError(400,
                   limit + "However, the prompt is " + std::to_string(prompt_tokens) +
                       " tokens, which leaves no room for a completion.",
                   "messages");
  if (!max_tokens) return max_model_len - prompt_tokens;
  if (prompt_tokens + *max_tokens > max_model_len)
    throw ApiError(400,
                   limit + "However, you requested " + std::to_string(prompt_tokens + *max_tokens) +
                       " tokens (" + std::to_string(prompt_tokens) + " in the prompt, " +
                       std::to_string(*max_tokens) +
                       " in the completion). Please reduce the length of the prompt or "
                       "max_tokens.",
                   "max_tokens");
  return *max_tokens;
}

}  // namespace k3::serve
