#include "serve/engine.h"

#include <algorithm>
#include <cstdio>

#include "serve/stop_matcher.h"
#include "spec/draft_model.h"
#include "spec/drafter.h"
#include "spec/rejection.h"

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
  // Speculative decoding: the drafter, the context it reads (prompt + generated), this step's
  // verify row (last token + drafts) and the stream for acceptance / residual draws.
  std::unique_ptr<spec::Drafter> drafter;
  std::vector<int64_t> context;
  spec::DraftTokens drafts;
  std::vector<int64_t> verify_tokens;
  std::vector<float> hidden;  // [rows][hidden] of this step, when the drafter reads them
  Rng spec_rng{req.sampling.seed ^ 0x5bd1e995u};
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

std::unique_ptr<spec::Drafter> Engine::make_drafter(const cpu::SamplingParams& sampling) {
  // The backend's own (a GPU draft model), else the generic one.
  std::unique_ptr<spec::Drafter> d = backend_->make_drafter(opt_.speculative, sampling);
  return d ? std::move(d) : spec::make_drafter(opt_.speculative, opt_.draft_model.get(), sampling);
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
  const int n_spec = opt_.speculative.num_speculative_tokens;
  K3_CHECK(n_spec >= 0, "num_speculative_tokens must be >= 0, got ", n_spec);
  if (n_spec > 0) {
    K3_CHECK(backend_->supports_verify(), "speculative decoding is not supported by this backend");
    // An unknown method or a missing draft model fails here, not per request.
    make_drafter({});
  }
  // The slot pool is allocated once; requests reuse it (reset), never grow it.
  for (int i = 0; i < opt_.max_num_seqs; ++i) {
    slots_.push_back(backend_->new_state());
    free_slots_.push_back(opt_.max_num_seqs - 1 - i);  // pop_back hands out slot 0 first
  }
  // A row's logits take [q][vocab] for a verify row; q = 1 without speculation.
  logits_.resize(static_cast<size_t>(opt_.max_num_seqs) * static_cast<size_t>(1 + n_spec) *
                 static_cast<size_t>(backend_->vocab_size()));
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
    if (opt_.speculative.num_speculative_tokens > 0) {
      s->drafter = make_drafter(s->req.sampling);
      s->context = s->req.prompt;
    }
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
  const auto row_logits = static_cast<size_t>(1 + opt_.speculative.num_speculative_tokens) *
                          static_cast<size_t>(vocab);  // logits_ per row
  std::vector<StepRow> rows;
  std::vector<Seq*> owners;  // rows[i] belongs to owners[i]
  std::vector<VerifyRow> vrows;
  std::vector<Seq*> vowners;  // vrows[i] belongs to vowners[i]
  int64_t budget = opt_.max_num_batched_tokens;
  int64_t decoders = 0;
  for (auto& s : running_)
    if (s->prefilled == s->req.prompt.size()) ++decoders;
  // Decode rows first: a long prompt must not stall requests that are already streaming. With
  // speculation, a request with drafts verifies 1 + drafts tokens; drafts only use budget that
  // leaves every later decode row its one token, and never run past max_tokens.
  for (auto& s : running_) {
    if (s->prefilled < s->req.prompt.size()) continue;
    SlotState* state = slots_[static_cast<size_t>(s->slot)].get();
    s->drafts = {};
    if (s->drafter) {
      const int64_t room =
          std::min<int64_t>({opt_.speculative.num_speculative_tokens,
                             s->req.max_tokens - s->generated - 1, budget - decoders});
      try {
        if (room > 0) s->drafts = s->drafter->propose(s->context, static_cast<int>(room));
      } catch (const std::exception& e) {
        --decoders;
        finish(*s, "error", e.what());
        continue;
      }
    }
    --decoders;
    if (s->drafts.tokens.empty()) {
      rows.push_back({state, {&s->next_token, 1}, nullptr});
      owners.push_back(s.get());
      --budget;
      continue;
    }
    s->verify_tokens.assign(1, s->next_token);
    s->verify_tokens.insert(s->verify_tokens.end(), s->drafts.tokens.begin(),
                            s->drafts.tokens.end());
    vrows.push_back({state, s->verify_tokens, nullptr});
    vowners.push_back(s.get());
    budget -= static_cast<int64_t>(s->verify_tokens.size());
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
      rows[i].logits = logits_.data() + i * row_logits;
  for (size_t i = 0; i < vrows.size(); ++i)
    vrows[i].logits = logits_.data() + (rows.size() + i) * row_logits;
  // A draft model reads the target's hidden state after every token the target keeps.
  const auto H = static_cast<size_t>(backend_->config().hidden_size);
  const auto wants_hidden = [](const Seq* s) { return s->drafter && s->drafter->needs_hidden(); };
  for (size_t i = 0; i < rows.size(); ++i)
    if (wants_hidden(owners[i])) {
      owners[i]->hidden.resize(rows[i].tokens.size() * H);
      rows[i].hidden = owners[i]->hidden.data();
    }
  for (size_t i = 0; i < vrows.size(); ++i)
    if (wants_hidden(vowners[i])) {
      vowners[i]->hidden.resize(vrows[i].tokens.size() * H);
      vrows[i].hidden = vowners[i]->hidden.data();
    }
  try {
    backend_->step(rows, vrows);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k3 serve: step failed for %zu requests: %s\n", rows.size() + vrows.size(),
                 e.what());
    for (Seq* s : owners) finish(*s, "error", e.what());
    for (Seq* s : vowners) finish(*s, "error", e.what());
    return;
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].hidden)
      owners[i]->drafter->observe(rows[i].hidden, static_cast<int64_t>(rows[i].tokens.size()));
    if (!rows[i].logits) continue;
    Seq& s = *owners[i];
    try {
      on_token(s, s.sampler.sample(rows[i].logits, vocab));
    } catch (const std::exception& e) {
      finish(s, "error", e.what());
    }
  }
  for (size_t i = 0; i < vrows.size(); ++i) {
    Seq& s = *vowners[i];
    try {
      accept_verified(s, vrows[i].logits);
    } catch (const std::exception& e) {
      finish(s, "error", e.what());
    }
  }
}

void Engine::accept_verified(Seq& s, const float* logits) {
  // logits: [1 + drafts][vocab] fp32.
  const spec::Verdict v =
      spec::rejection_sample(logits, backend_->vocab_size(), s.req.sampling, s.drafts, s.spec_rng);
  backend_->commit(*slots_[static_cast<size_t>(s.slot)], 1 + v.accepted);
  if (s.drafter->needs_hidden()) s.drafter->observe(s.hidden.data(), 1 + v.accepted);
  metrics_.add_spec_decode(static_cast<int64_t>(s.drafts.tokens.size()), v.accepted);
  // Stop conditions apply token by token: the rest of an accepted run after a stop is dropped.
  for (int64_t tok : v.tokens) {
    on_token(s, tok);
    if (s.done) break;
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
  if (s.drafter) s.context.push_back(tok);
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
