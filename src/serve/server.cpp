#include "serve/server.h"

#include <chrono>
#include <csignal>

#include <httplib.h>

#include "serve/generation_handlers.h"
#include "serve/openai_api.h"
#include "serve/openai_response.h"

namespace k3::serve {
namespace {

using json = nlohmann::json;
using Handler = httplib::Server::Handler;

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump(error_json(e)), "application/json");
}

// Every route runs inside this: whatever a handler throws becomes an OpenAI-shaped answer.
// k3::Error is what input validation below the API layer raises (tokenizer, chat format,
// engine checks), so it is the client's fault: 400.
template <typename F>
Handler guarded(F f) {
  return [f](const httplib::Request& req, httplib::Response& res) {
    try {
      f(req, res);
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const EngineOverloaded& e) {
      send_error(res, ApiError(503, e.what(), "", "server_error"));
    } catch (const Error& e) {
      send_error(res, ApiError(400, e.what()));
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, std::string("internal error: ") + e.what()));
    } catch (...) {
      send_error(res, ApiError(500, "internal error"));
    }
  };
}

std::string status_message(const httplib::Request& req, int status, size_t max_body) {
  switch (status) {
    case 400:
      return "malformed HTTP request";
    case 404:
      return "no route for " + req.method + " " + req.path;
    case 413:
      return "the request body is too large (the limit is " + std::to_string(max_body) + " bytes)";
    case 414:
      return "the request URI is too long";
    default:
      return "HTTP error " + std::to_string(status);
  }
}

}  // namespace

struct Server::Impl {
  Impl(Engine& e, const TextCodec& c, Metrics& m, ServerOptions o)
      : ctx{e, c, o.model_name, o.model_path, o.max_model_len}, metrics(m), opt(std::move(o)) {}

  void routes();
  json model_card() const {
    return {{"id", opt.model_name},
            {"object", "model"},
            {"created", created},
            {"owned_by", "k3"},
            {"root", opt.model_path},
            {"parent", nullptr},
            {"max_model_len", opt.max_model_len}};
  }

  httplib::Server http;
  ServeContext ctx;
  Metrics& metrics;
  ServerOptions opt;
  int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
};

void Server::Impl::routes() {
  const Handler health = guarded([](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  const Handler metrics_h = guarded([this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  const Handler models = guarded([this](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump({{"object", "list"}, {"data", json::array({model_card()})}}),
                    "application/json");
  });
  const Handler model = guarded([this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches.size() > 1 ? std::string(req.matches[1]) : "";
    if (id != opt.model_name && id != opt.model_path)
      throw ApiError(404, "The model `" + id + "` does not exist.", "model",
                     "invalid_request_error", "model_not_found");
    res.set_content(dump(model_card()), "application/json");
  });
  const Handler completions = guarded([this](const httplib::Request& req, httplib::Response& res) {
    handle_completion(ctx, req, res);
  });
  const Handler chat = guarded(
      [this](const httplib::Request& req, httplib::Response& res) { handle_chat(ctx, req, res); });

  struct Route {
    const char* pattern;
    const char* method;
    Handler handler;
  };
  const Route table[] = {{"/health", "GET", health},
                         {"/metrics", "GET", metrics_h},
                         {"/v1/models", "GET", models},
                         {R"(/v1/models/(.+))", "GET", model},
                         {"/v1/completions", "POST", completions},
                         {"/v1/chat/completions", "POST", chat}};
  for (const Route& r : table) {
    const std::string allowed = r.method;
    const Handler wrong = [allowed](const httplib::Request& req, httplib::Response& res) {
      res.set_header("Allow", allowed);
      send_error(res, ApiError(405, "method " + req.method + " is not allowed on " + req.path +
                                        "; use " + allowed));
    };
    const bool get = allowed == "GET";
    http.Get(r.pattern, get ? r.handler : wrong);
    http.Post(r.pattern, get ? wrong : r.handler);
    http.Put(r.pattern, wrong);
    http.Patch(r.pattern, wrong);
    http.Delete(r.pattern, wrong);
  }

  // Errors httplib produces itself (no route, body too large, unparsable request) get the
  // OpenAI shape too; answers a handler already wrote are left alone.
  const size_t max_body = opt.max_body_bytes;
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [max_body](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        send_error(res, ApiError(res.status, status_message(req, res.status, max_body)));
        return httplib::Server::HandlerResponse::Handled;
      }));
  http.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
        send_error(res, ApiError(500, "internal error"));
      });
}

Server::Server(Engine& engine, const TextCodec& codec, Metrics& metrics, ServerOptions opt)
    : impl_(std::make_unique<Impl>(engine, codec, metrics, std::move(opt))) {
  // A client that disconnects mid-write must cost an EPIPE, not the process.
  std::signal(SIGPIPE, SIG_IGN);
  const int threads = impl_->opt.http_threads;
  K3_CHECK(threads >= 1, "http_threads must be >= 1, got ", threads);
  impl_->http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  impl_->http.set_payload_max_length(impl_->opt.max_body_bytes);
  impl_->http.set_keep_alive_max_count(1000);
  impl_->routes();
}

Server::~Server() = default;

int Server::bind() {
  const ServerOptions& o = impl_->opt;
  int port = o.port;
  if (port == 0) {
    port = impl_->http.bind_to_any_port(o.host);
    K3_CHECK(port > 0, "cannot listen on ", o.host, " (any port)");
  } else {
    K3_CHECK(impl_->http.bind_to_port(o.host, port), "cannot listen on ", o.host, ":", port,
             " (in use, or not an address of this machine)");
  }
  return port;
}

void Server::run() {
  impl_->http.listen_after_bind();
}

void Server::stop() {
  impl_->http.stop();
}

}  // namespace k3::serve
