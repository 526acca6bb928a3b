#include "serve/engine.h"

#include <algorithm>
#include <cstdio>

#include "serve/stop_matcher.h"

namespace k3::serve {

struct Engine::Seq {
  Seq(GenerationRequest r, std::unique_ptr<TokenStream> d)
      : req(std::move(r)), detok(std::move(d)), stop(req.stop), sampler(req.sampling) {}

  std::shared_ptr<RequestStream> out = std::make_shared<RequestStream>();
  GenerationRequest req;
  std::unique_ptr<TokenStream> detok;
  StopMatcher stop;
  cpu::Sampler sampler;
  int slot = -1;
  size_t prefilled = 0;     // prompt tokens consumed
  int64_t next_token = -1;  // sampled last step, fed next step
  int64_t generated = 0;
  bool done = false;
  Clock::time_point arrival = Clock::now(), first_token, last_token;
};

bool RequestStream::next(StreamEvent& ev, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  const bool news =
      cv_.wait_for(lock, timeout, [&] { return !text_.empty() || (finished_ && !delivered_); });
  if (!news) return false;
  ev = StreamEvent{};
  ev.text = std::move(text_);
  text_.clear();
  if (finished_ && !delivered_) {
    delivered_ = true;
    ev.finished = true;
    ev.finish_reason = final_.finish_reason;
    ev.error = final_.error;
    ev.prompt_tokens = final_.prompt_tokens;
    ev.completion_tokens = final_.completion_tokens;
  }
  return true;
}

void RequestStream::push_text(const std::string& text) {
  if (text.empty()) return;
  {
    std::lock_guard lock(mu_);
    text_ += text;
  }
  cv_.notify_all();
}

void RequestStream::push_final(StreamEvent final_event) {
  {
    std::lock_guard lock(mu_);
    if (finished_) return;
    final_ = std::move(final_event);
    finished_ = true;
  }
  cv_.notify_all();
}

Engine::Engine(std::unique_ptr<StepBackend> backend, std::shared_ptr<const TextCodec> codec,
               EngineOptions opt, Metrics& metrics)
    : backend_(std::move(backend)), codec_(std::move(codec)), opt_(opt), metrics_(metrics) {
  K3_CHECK(backend_ && codec_, "Engine: a backend and a tokenizer are required");
  K3_CHECK(opt_.max_num_seqs >= 1, "max_num_seqs must be >= 1, got ", opt_.max_num_seqs);
  K3_CHECK(opt_.max_waiting >= 0, "the waiting-queue limit must be >= 0, got ", opt_.max_waiting);
  // Decode rows take one token each; the rest of the budget must fit at least one prompt token.
  K3_CHECK(opt_.max_num_batched_tokens >= opt_.max_num_seqs, "max_num_batched_tokens (",
           opt_.max_num_batched_tokens, ") must be >= max_num_seqs (", opt_.max_num_seqs, ")");
  // The slot pool is allocated once; requests reuse it (reset), never grow it.
  for (int i = 0; i < opt_.max_num_seqs; ++i) {
    slots_.push_back(backend_->new_state());
    free_slots_.push_back(opt_.max_num_seqs - 1 - i);  // pop_back hands out slot 0 first
  }
  logits_.resize(static_cast<size_t>(opt_.max_num_seqs * backend_->vocab_size()));
  publish_queue();
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  stop();
}

std::shared_ptr<RequestStream> Engine::submit(GenerationRequest req) {
  const int64_t vocab = backend_->vocab_size();
  K3_CHECK(!req.prompt.empty(), "the prompt is empty");
  for (size_t i = 0; i < req.prompt.size(); ++i)
    K3_CHECK(req.prompt[i] >= 0 && req.prompt[i] < vocab, "prompt token ", i, " is ", req.prompt[i],
             ", outside the vocabulary [0, ", vocab, ")");
  K3_CHECK(req.max_tokens >= 1, "max_tokens must be >= 1, got ", req.max_tokens);
  const int64_t total = static_cast<int64_t>(req.prompt.size()) + req.max_tokens;
  K3_CHECK(total <= backend_->max_context(), "prompt (", req.prompt.size(),
           " tokens) + max_tokens (", req.max_tokens, ") exceeds the context length ",
           backend_->max_context());
  auto seq = std::make_unique<Seq>(std::move(req), codec_->stream());  // validates sampling
  std::shared_ptr<RequestStream> out = seq->out;
  {
    std::lock_guard lock(mu_);
    if (stopping_) throw EngineOverloaded("the server is shutting down");
    if (waiting_.size() >= free_slots_.size() + static_cast<size_t>(opt_.max_waiting))
      throw EngineOverloaded("the server is overloaded: " + std::to_string(waiting_.size()) +
                             " requests are waiting for a decode slot; retry later");
    waiting_.push_back(std::move(seq));
    publish_queue();
  }
  cv_.notify_all();
  return out;
}

void Engine::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Engine::publish_queue() {
  metrics_.set_queue(running_count_.load(), static_cast<int64_t>(waiting_.size()));
}

void Engine::admit() {
  // Cancelled requests leave the queue without taking a slot.
  for (auto& w : waiting_)
    if (w->out->cancelled()) finish(*w, "abort", "cancelled by the client");
  std::erase_if(waiting_, [](const auto& w) { return w->done; });
  while (!free_slots_.empty() && !waiting_.empty()) {
    std::unique_ptr<Seq> s = std::move(waiting_.front());
    waiting_.pop_front();
    s->slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[static_cast<size_t>(s->slot)]->reset();  // no state from the previous owner
    metrics_.add_prompt_tokens(static_cast<int64_t>(s->req.prompt.size()));
    running_.push_back(std::move(s));
  }
  running_count_ = static_cast<int64_t>(running_.size());
  publish_queue();
}

void Engine::loop() {
  const auto drop_finished = [this] {
    std::erase_if(running_, [](const auto& s) { return s->done; });
    running_count_ = static_cast<int64_t>(running_.size());
    std::lock_guard lock(mu_);
    publish_queue();
  };
  while (true) {
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !waiting_.empty() || !running_.empty(); });
      if (stopping_) break;
      admit();
    }
    for (auto& s : running_)
      if (s->out->cancelled()) finish(*s, "abort", "cancelled by the client");
    drop_finished();
    if (running_.empty()) continue;
    step();
    drop_finished();
  }
  std::deque<std::unique_ptr<Seq>> waiting;
  {
    std::lock_guard lock(mu_);
    waiting.swap(waiting_);
  }
  for (auto& s : running_) finish(*s, "abort", "the server is shutting down");
  for (auto& s : waiting) finish(*s, "abort", "the server is shutting down");
  drop_finished();
}

void Engine::step() {
  const int64_t vocab = backend_->vocab_size();
  std::vector<StepRow> rows;
  std::vector<Seq*> owners;  // rows[i] belongs to owners[i]
  int64_t budget = opt_.max_num_batched_tokens;
  // Decode rows first: a long prompt must not stall requests that are already streaming.
  for (auto& s : running_) {
    if (s->prefilled < s->req.prompt.size()) continue;
    rows.push_back({slots_[static_cast<size_t>(s->slot)].get(), {&s->next_token, 1}, nullptr});
    owners.push_back(s.get());
    --budget;
  }
  for (auto& s : running_) {
    const size_t left = s->req.prompt.size() - s->prefilled;
    if (left == 0 || budget <= 0) continue;
    const size_t n = std::min(left, static_cast<size_t>(budget));
    rows.push_back({slots_[static_cast<size_t>(s->slot)].get(),
                    {s->req.prompt.data() + s->prefilled, n},
                    nullptr});
    owners.push_back(s.get());
    s->prefilled += n;
    budget -= static_cast<int64_t>(n);
  }
  // Logits only where a token gets sampled: decode rows and prompt chunks that end the prompt.
  for (size_t i = 0; i < rows.size(); ++i)
    if (owners[i]->prefilled == owners[i]->req.prompt.size())
      rows[i].logits = logits_.data() + i * static_cast<size_t>(vocab);
  try {
    backend_->forward(rows);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k3 serve: step failed for %zu requests: %s\n", rows.size(), e.what());
    for (Seq* s : owners) finish(*s, "error", e.what());
    return;
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].logits) continue;
    Seq& s = *owners[i];
    try {
      on_token(s, s.sampler.sample(rows[i].logits, vocab));
    } catch (const std::exception& e) {
      finish(s, "error", e.what());
    }
  }
}

void Engine::on_token(Seq& s, int64_t tok) {
  const auto now = Clock::now();
  if (++s.generated == 1) {
    s.first_token = now;
    metrics_.observe_ttft(std::chrono::duration<double>(now - s.arrival).count());
  }
  s.last_token = now;
  metrics_.add_generation_tokens(1);
  const auto has = [tok](const std::vector<int64_t>& v) {
    return std::find(v.begin(), v.end(), tok) != v.end();
  };
  if (has(s.req.stop_token_ids) || (!s.req.ignore_eos && has(s.req.eos_ids))) {
    std::string text = s.stop.feed(s.detok->flush());  // the stop token itself is not text
    emit(s, text + s.stop.flush());
    finish(s, "stop");
    return;
  }
  std::string text = s.stop.feed(s.detok->push(tok));
  if (!s.stop.matched() && s.generated >= s.req.max_tokens) {
    text += s.stop.feed(s.detok->flush());
    text += s.stop.flush();
    emit(s, text);
    finish(s, s.stop.matched() ? "stop" : "length");
    return;
  }
  emit(s, text);
  if (s.stop.matched()) {
    finish(s, "stop");
    return;
  }
  s.next_token = tok;
}

void Engine::emit(Seq& s, const std::string& text) {
  s.out->push_text(text);
}

void Engine::finish(Seq& s, const std::string& reason, const std::string& error) {
  if (s.done) return;
  s.done = true;
  StreamEvent ev;
  ev.finished = true;
  ev.finish_reason = reason;
  ev.error = error;
  ev.prompt_tokens = static_cast<int64_t>(s.req.prompt.size());
  ev.completion_tokens = s.generated;
  metrics_.add_finished(reason);
  if (s.generated > 0)
    metrics_.observe_e2e(std::chrono::duration<double>(s.last_token - s.arrival).count());
  if (s.generated > 1)
    metrics_.observe_tpot(std::chrono::duration<double>(s.last_token - s.first_token).count() /
                          static_cast<double>(s.generated - 1));
  // The slot is free before the reader hears of the end, so a client that submits again right
  // away finds it (and the metrics already count the finish).
  if (s.slot >= 0) {
    std::lock_guard lock(mu_);  // free_slots_ is shared with submit()
    free_slots_.push_back(s.slot);
    s.slot = -1;
  }
  s.out->push_final(std::move(ev));
}

}  // namespace k3::serve
