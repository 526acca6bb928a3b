// The serving engine: one scheduler thread owns the backend and a fixed pool of max_num_seqs
// decode-state slots. Requests wait in a FIFO queue and are admitted to free slots between steps;
// every step advances each running request by one token (decode) or by a chunk of its prompt
// (prefill), so requests join and leave the batch at step boundaries (continuous batching).
// Results flow back through a per-request RequestStream that the HTTP thread reads.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "cpu/sampling.h"
#include "runtime/deploy_config.h"
#include "serve/metrics.h"
#include "serve/step_backend.h"
#include "serve/text_codec.h"

namespace k3::spec {
class DraftModel;
}

namespace k3::serve {

struct EngineOptions {
  int max_num_seqs = 16;             // decode slots (the batch)
  int max_waiting = 256;             // queued requests beyond the free slots before refusing
  int max_num_batched_tokens = 256;  // tokens per step: decode rows first, then prompt chunks
  // num_speculative_tokens > 0: decode rows become verify rows of 1 + drafts tokens (the backend
  // must support verify); drafts are cut to fit the step's token budget.
  SpeculativeConfig speculative = {};
  // The loaded speculative_config.model for method draft_model (shared by every request), unless
  // the backend drafts with its own (StepBackend::make_drafter: the CUDA backend's GPU draft).
  std::shared_ptr<const spec::DraftModel> draft_model = nullptr;
};

struct GenerationRequest {
  std::vector<int64_t> prompt;
  int64_t max_tokens = 16;
  cpu::SamplingParams sampling;
  bool ignore_eos = false;
  std::vector<int64_t> eos_ids;         // end the request unless ignore_eos; not in the text
  std::vector<int64_t> stop_token_ids;  // always end the request; not in the text
  std::vector<std::string> stop;        // stop strings on the text; not in the text
};

// What a reader gets: text generated since its last read, and once the request is over, why.
struct StreamEvent {
  std::string text;
  bool finished = false;
  std::string finish_reason;  // stop | length | abort | error
  std::string error;          // the reason, for finish_reason error / abort
  int64_t prompt_tokens = 0, completion_tokens = 0;
};

// Thread-safe hand-off between the scheduler (writer) and one HTTP handler (reader).
class RequestStream {
 public:
  // Waits up to `timeout`; on news, moves everything pending into `ev` (texts concatenated).
  bool next(StreamEvent& ev, std::chrono::milliseconds timeout);
  // From any thread: the scheduler drops the request before its next step and frees its slot.
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  friend class Engine;
  void push_text(const std::string& text);
  void push_final(StreamEvent final_event);

  std::mutex mu_;
  std::condition_variable cv_;
  std::string text_;
  bool finished_ = false, delivered_ = false;
  StreamEvent final_;
  std::atomic<bool> cancelled_{false};
};

// The queue is full or the engine is stopping: the HTTP layer answers 503.
class EngineOverloaded : public Error {
 public:
  using Error::Error;
};

class Engine {
 public:
  Engine(std::unique_ptr<StepBackend> backend, std::shared_ptr<const TextCodec> codec,
         EngineOptions opt, Metrics& metrics);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request. k3::Error for an invalid one (empty prompt, ids out of range, too long,
  // bad sampling); EngineOverloaded when the queue is full or the engine stopped.
  std::shared_ptr<RequestStream> submit(GenerationRequest req);
  // Ends every request with finish_reason abort and joins the scheduler; idempotent.
  void stop();

  const StepBackend& backend() const { return *backend_; }
  const EngineOptions& options() const { return opt_; }

 private:
  struct Seq;
  using Clock = std::chrono::steady_clock;

  void loop();
  void admit();  // under mu_
  void step();   // one batched forward over the running requests
  void on_token(Seq& s, int64_t token);
  void accept_verified(Seq& s, const float* logits);  // logits: [q][vocab] of its verify row
  void finish(Seq& s, const std::string& reason, const std::string& error = {});
  // A request's drafter: the backend's own, else spec::make_drafter's.
  std::unique_ptr<spec::Drafter> make_drafter(const cpu::SamplingParams& sampling);
  void emit(Seq& s, const std::string& text);
  void publish_queue();  // under mu_

  std::unique_ptr<StepBackend> backend_;
  std::shared_ptr<const TextCodec> codec_;
  EngineOptions opt_;
  Metrics& metrics_;

  std::mutex mu_;  // guards waiting_, free_slots_, stopping_
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Seq>> waiting_;
  std::vector<int> free_slots_;
  bool stopping_ = false;
  std::atomic<int64_t> running_count_{0};  // running_.size(), readable from any thread

  // Scheduler thread only.
  std::vector<std::unique_ptr<SlotState>> slots_;
  std::vector<std::unique_ptr<Seq>> running_;
  std::vector<float> logits_;  // [rows][vocab]
  std::thread thread_;
};

}  // namespace k3::serve
