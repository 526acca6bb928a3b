// The HTTP front end of `k3 serve` (cpp-httplib): OpenAI routes, /health, /metrics. Every
// handler answers; nothing a client sends escapes as an exception (unknown problems become a
// 500 JSON error), unknown routes are 404 and known routes with the wrong method 405, all in
// OpenAI's error shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "serve/engine.h"
#include "serve/metrics.h"
#include "serve/text_codec.h"

namespace k3::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                   // 0: any free port
  std::string model_name;            // what /v1/models lists and requests must name
  std::string model_path;            // accepted as a name too
  int64_t max_model_len = 0;         // the context limit requests are checked against
  size_t max_body_bytes = 16 << 20;  // larger bodies get 413
  int http_threads = 64;             // connections served at once (streams hold one each)
};

class Server {
 public:
  Server(Engine& engine, const TextCodec& codec, Metrics& metrics, ServerOptions opt);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds host:port; returns the port (the chosen one for port 0). k3::Error when it cannot.
  int bind();
  // Serves until stop(), in the calling thread.
  void run();
  // From any thread: stops accepting and returns run() once open handlers finish.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3::serve
