// The two generation endpoints: request -> engine request -> JSON response or SSE stream.
// Handlers throw ApiError (and k3::Error for invalid input); the server turns both into
// OpenAI-shaped error answers.
#pragma once

#include <cstdint>
#include <string>

#include <httplib.h>

#include "serve/engine.h"
#include "serve/text_codec.h"

namespace k3::serve {

struct ServeContext {
  Engine& engine;
  const TextCodec& codec;
  std::string model_name;  // --served-model-name, or the model directory's basename
  std::string model_path;  // accepted as a model name too
  int64_t max_model_len = 0;
};

// POST /v1/completions
void handle_completion(const ServeContext& ctx, const httplib::Request& req,
                       httplib::Response& res);
// POST /v1/chat/completions
void handle_chat(const ServeContext& ctx, const httplib::Request& req, httplib::Response& res);

}  // namespace k3::serve
