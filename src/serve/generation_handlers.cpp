#include "serve/generation_handlers.h"

#include <optional>
#include <random>

#include "model/config.h"
#include "serve/openai_api.h"
#include "serve/openai_response.h"
#include "serve/peer_socket.h"

namespace k3::serve {
namespace {

using json = nlohmann::json;
// How often a waiting handler checks that its client is still connected.
constexpr auto kPoll = std::chrono::milliseconds(50);

void check_model(const ServeContext& ctx, const GenerationParams& g) {
  if (!g.model.empty() && g.model != ctx.model_name && g.model != ctx.model_path)
    throw ApiError(
        404,
        "The model `" + g.model + "` does not exist; this server serves `" + ctx.model_name + "`.",
        "model", "invalid_request_error", "model_not_found");
}

GenerationRequest engine_request(const ServeContext& ctx, const GenerationParams& g,
                                 std::vector<int64_t> prompt) {
  GenerationRequest r;
  r.max_tokens =
      completion_budget(static_cast<int64_t>(prompt.size()), g.max_tokens, ctx.max_model_len);
  r.prompt = std::move(prompt);
  // No seed: a fresh one per request, so temperature > 0 samples differently each time.
  r.sampling = {g.temperature, g.top_k, g.top_p, g.seed ? *g.seed : std::random_device{}()};
  r.ignore_eos = g.ignore_eos;
  r.eos_ids = ctx.engine.backend().config().eos_token_ids;
  r.stop_token_ids = g.stop_token_ids;
  r.stop = g.stop;
  return r;
}

std::shared_ptr<RequestStream> submit(const ServeContext& ctx, GenerationRequest r) {
  try {
    return ctx.engine.submit(std::move(r));
  } catch (const EngineOverloaded& e) {
    throw ApiError(503, e.what(), "", "server_error", "overloaded");
  }
}

PeerWatch peer_of(const httplib::Request& req) {
  return PeerWatch(req.local_addr, req.local_port, req.remote_addr, req.remote_port);
}

// Non-streaming: everything up to the end. A client that leaves cancels the request; the wait
// continues until the engine confirms, so its slot is free when the handler returns.
StreamEvent collect(RequestStream& s, const PeerWatch& peer) {
  StreamEvent total;
  auto next_check = std::chrono::steady_clock::now() + kPoll;
  while (true) {
    StreamEvent ev;
    if (s.next(ev, kPoll)) {
      total.text += ev.text;
      if (ev.finished) {
        ev.text = std::move(total.text);
        return ev;
      }
    }
    // Checked on a clock, not only when idle: tokens may arrive faster than the poll interval.
    if (const auto now = std::chrono::steady_clock::now(); now >= next_check) {
      next_check = now + kPoll;
      if (!s.cancelled() && peer.closed()) s.cancel();
    }
  }
}

ApiError failure(const StreamEvent& ev) {
  if (ev.finish_reason == "error") return ApiError(500, "generation failed: " + ev.error);
  return ApiError(503, "the request was aborted: " + ev.error, "", "server_error");
}

void check_finished(const StreamEvent& ev) {
  if (ev.finish_reason == "error" || ev.finish_reason == "abort") throw failure(ev);
}

Usage usage_of(const StreamEvent& ev) {
  return {ev.prompt_tokens, ev.completion_tokens};
}

// State of one SSE response, shared by httplib's content provider and its releaser.
struct SseState {
  std::shared_ptr<RequestStream> stream;
  PeerWatch peer;
  ResponseIds ids;
  bool include_usage = false;
  std::optional<AssistantStreamParser> chat;  // set for chat streams
  int tool_index = 0;
  bool started = false, done = false;
};

std::string chat_events(SseState& st, const AssistantDelta& d) {
  if (d.empty()) return {};
  return sse_event(chat_chunk(st.ids, chat_delta(d, &st.tool_index), "", st.include_usage));
}

// The SSE text for one engine event: content chunks, then at the end the finish chunk, the
// usage chunk (include_usage) and [DONE]. Failures end the stream with an error event.
std::string render(SseState& st, const StreamEvent& ev) {
  std::string out;
  if (!st.started && st.chat) {  // the role comes first, as OpenAI sends it
    out += sse_event(
        chat_chunk(st.ids, {{"role", "assistant"}, {"content", ""}}, "", st.include_usage));
  }
  st.started = true;
  if (!ev.text.empty()) {
    if (st.chat)
      out += chat_events(st, st.chat->feed(ev.text));
    else
      out += sse_event(completion_chunk(st.ids, ev.text, "", st.include_usage));
  }
  if (!ev.finished) return out;
  if (ev.finish_reason == "error" || ev.finish_reason == "abort") {
    out += sse_event(error_json(failure(ev)));
  } else {
    if (st.chat) {
      out += chat_events(st, st.chat->finish());
      const std::string reason =
          ev.finish_reason == "stop" && st.tool_index > 0 ? "tool_calls" : ev.finish_reason;
      out += sse_event(chat_chunk(st.ids, json::object(), reason, st.include_usage));
    } else {
      out += sse_event(completion_chunk(st.ids, "", ev.finish_reason, st.include_usage));
    }
    if (st.include_usage)
      out += sse_event(
          usage_chunk(st.ids, st.chat ? "chat.completion.chunk" : "text_completion", usage_of(ev)));
  }
  out += "data: [DONE]\n\n";
  return out;
}

// Streams the request as server-sent events. httplib calls the provider in this connection's
// thread until it calls sink.done() or returns false; a failed write or a closed peer cancels
// the request, and so does the releaser when the stream ends any other way.
void stream_response(httplib::Response& res, std::shared_ptr<SseState> st) {
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [st](size_t, httplib::DataSink& sink) {
        try {
          StreamEvent ev;
          const bool news =
              st->stream->next(ev, st->started ? kPoll : std::chrono::milliseconds(0));
          if (!news && st->started) {
            if (!st->peer.closed()) return true;  // nothing yet: httplib calls again
            st->stream->cancel();
            return false;
          }
          const std::string out = render(*st, ev);
          if (!out.empty() && !sink.write(out.data(), out.size())) {
            st->stream->cancel();
            return false;
          }
          if (ev.finished) {
            st->done = true;
            sink.done();
          }
          return true;
        } catch (...) {  // nothing may escape into httplib's worker thread
          st->stream->cancel();
          return false;
        }
      },
      [st](bool) {
        if (!st->done) st->stream->cancel();
      });
}

std::shared_ptr<SseState> sse_state(std::shared_ptr<RequestStream> s, const httplib::Request& req,
                                    const ResponseIds& ids, const GenerationParams& g) {
  auto st = std::make_shared<SseState>();
  st->stream = std::move(s);
  st->peer = peer_of(req);
  st->ids = ids;
  st->include_usage = g.include_usage;
  return st;
}

}  // namespace

void handle_completion(const ServeContext& ctx, const httplib::Request& req,
                       httplib::Response& res) {
  const CompletionRequest r = parse_completion_request(parse_json_body(req.body));
  check_model(ctx, r.gen);
  std::vector<int64_t> prompt = r.prompt_ids;
  if (r.prompt_text) {
    // Text prompts start with BOS, as `k3 generate` does; token-id prompts are taken as given.
    const int64_t bos = ctx.engine.backend().config().bos_token_id;
    if (bos >= 0) prompt.push_back(bos);
    const std::vector<int64_t> ids = ctx.codec.encode(*r.prompt_text, true);
    prompt.insert(prompt.end(), ids.begin(), ids.end());
  }
  const int64_t vocab = ctx.engine.backend().vocab_size();
  for (int64_t id : prompt)
    if (id >= vocab)
      throw ApiError(400,
                     "prompt token id " + std::to_string(id) + " is outside the vocabulary (" +
                         std::to_string(vocab) + " tokens)",
                     "prompt");
  auto stream = submit(ctx, engine_request(ctx, r.gen, std::move(prompt)));
  const ResponseIds ids = new_response_ids("cmpl", ctx.model_name);
  if (r.gen.stream) return stream_response(res, sse_state(stream, req, ids, r.gen));
  const StreamEvent ev = collect(*stream, peer_of(req));
  check_finished(ev);
  res.set_content(dump(completion_response(ids, ev.text, ev.finish_reason, usage_of(ev))),
                  "application/json");
}

void handle_chat(const ServeContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const ChatRequest r = parse_chat_request(parse_json_body(req.body));
  check_model(ctx, r.gen);
  std::vector<ChatSegment> segments;
  try {
    segments = render_chat_segments(r.messages, r.chat);
  } catch (const std::exception& e) {  // what K3's format cannot render is the client's input
    throw ApiError(400, e.what(), "messages");
  }
  std::vector<int64_t> prompt;
  for (const ChatSegment& s : segments) {
    // Only the format's own markup may become special tokens; message text never does.
    const std::vector<int64_t> ids = ctx.codec.encode(s.text, s.special);
    prompt.insert(prompt.end(), ids.begin(), ids.end());
  }
  GenerationRequest g = engine_request(ctx, r.gen, std::move(prompt));
  // The turn ends at the format's end-of-turn token; a tokenizer without it (the byte-level
  // fallback) matches its text instead.
  for (const std::string& s : chat_stop_strings()) {
    if (const auto id = ctx.codec.special_id(s))
      g.eos_ids.push_back(*id);
    else if (!g.ignore_eos)
      g.stop.push_back(s);
  }
  auto stream = submit(ctx, std::move(g));
  const ResponseIds ids = new_response_ids("chatcmpl", ctx.model_name);
  if (r.gen.stream) {
    auto st = sse_state(stream, req, ids, r.gen);
    st->chat.emplace(r.chat.thinking);
    return stream_response(res, st);
  }
  const StreamEvent ev = collect(*stream, peer_of(req));
  check_finished(ev);
  const AssistantOutput out = parse_assistant_output(ev.text, r.chat.thinking);
  res.set_content(dump(chat_response(ids, out, ev.finish_reason, usage_of(ev))),
                  "application/json");
}

}  // namespace k3::serve
