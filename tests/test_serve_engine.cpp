// The serving engine over a deterministic fake backend: batched results equal solo results
// (slots reused without stale state, chunked prefill), stop conditions, cancellation frees the
// slot, a full queue refuses, invalid requests are errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "model/config.h"
#include "serve/engine.h"

namespace {

using namespace k3::serve;
using namespace std::chrono_literals;

// Logits are a hash of every token the state consumed, so any stale or misrouted state shows.
class FakeSlot final : public SlotState {
 public:
  void reset() override { *this = FakeSlot(); }
  int64_t position() const override { return pos; }
  uint64_t h = 1469598103934665603ull;
  int64_t pos = 0;
};

class FakeBackend final : public StepBackend {
 public:
  FakeBackend(int64_t vocab, std::chrono::microseconds delay) : delay_(delay) {
    cfg_.vocab_size = vocab;
  }
  const k3::ModelConfig& config() const override { return cfg_; }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t max_context() const override { return 4096; }
  std::unique_ptr<SlotState> new_state() const override { return std::make_unique<FakeSlot>(); }
  void forward(std::span<const StepRow> rows) override {
    std::this_thread::sleep_for(delay_);
    max_rows = std::max<int>(max_rows, static_cast<int>(rows.size()));
    for (const StepRow& r : rows) {
      auto& s = dynamic_cast<FakeSlot&>(*r.state);
      for (int64_t t : r.tokens) {
        s.h = (s.h ^ static_cast<uint64_t>(t)) * 1099511628211ull;
        ++s.pos;
      }
      if (!r.logits) continue;
      for (int64_t v = 0; v < cfg_.vocab_size; ++v)
        r.logits[v] =
            static_cast<float>(((s.h ^ (s.h >> 29)) * static_cast<uint64_t>(v + 1)) >> 58);
    }
  }
  std::atomic<int> max_rows{0};

 private:
  k3::ModelConfig cfg_;
  std::chrono::microseconds delay_;
};

// Token id -> "<id> ", so tests read the generated ids back from the text; no special tokens.
class FakeCodec final : public TextCodec {
 public:
  std::vector<int64_t> encode(std::string_view text, bool) const override {
    std::vector<int64_t> ids;
    for (char c : text) ids.push_back(static_cast<unsigned char>(c) % 60);
    return ids;
  }
  std::unique_ptr<TokenStream> stream() const override {
    struct S final : TokenStream {
      std::string push(int64_t id) override { return std::to_string(id) + " "; }
      std::string flush() override { return {}; }
    };
    return std::make_unique<S>();
  }
  std::optional<int64_t> special_id(std::string_view) const override { return std::nullopt; }
  std::string name() const override { return "fake"; }
};

struct Rig {
  explicit Rig(EngineOptions o, std::chrono::microseconds delay = 0us) {
    auto b = std::make_unique<FakeBackend>(64, delay);
    backend = b.get();
    engine = std::make_unique<Engine>(std::move(b), std::make_shared<FakeCodec>(), o, metrics);
  }
  Metrics metrics;
  FakeBackend* backend = nullptr;
  std::unique_ptr<Engine> engine;
};

StreamEvent run_to_end(RequestStream& s) {
  std::string text;
  for (int i = 0; i < 1000; ++i) {
    StreamEvent ev;
    if (!s.next(ev, 10ms)) continue;
    text += ev.text;
    if (ev.finished) {
      ev.text = text;
      return ev;
    }
  }
  ADD_FAILURE() << "the request did not finish";
  return {};
}

GenerationRequest request(int prompt_len, int max_tokens, int salt = 0) {
  GenerationRequest r;
  for (int i = 0; i < prompt_len; ++i) r.prompt.push_back((i * 7 + salt) % 60);
  r.max_tokens = max_tokens;
  return r;
}

TEST(ServeEngine, BatchedResultsEqualSoloResults) {
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 12; ++i) reqs.push_back(request(1 + 3 * i, 10 + i, i));
  std::vector<std::string> solo;
  {
    Rig one({1, 0, 4});
    for (const auto& r : reqs) {
      const StreamEvent ev = run_to_end(*one.engine->submit(r));
      EXPECT_EQ(ev.finish_reason, "length");
      EXPECT_EQ(ev.completion_tokens, r.max_tokens);
      EXPECT_EQ(ev.prompt_tokens, static_cast<int64_t>(r.prompt.size()));
      solo.push_back(ev.text);
    }
  }
  // 4 slots for 12 requests (slots get reused), prompts prefilled in chunks of a few tokens.
  Rig rig({4, 64, 6});
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : reqs) streams.push_back(rig.engine->submit(r));
  for (size_t i = 0; i < reqs.size(); ++i) {
    const StreamEvent ev = run_to_end(*streams[i]);
    EXPECT_EQ(ev.text, solo[i]) << "request " << i;
    EXPECT_EQ(ev.completion_tokens, reqs[i].max_tokens);
  }
  EXPECT_GT(rig.backend->max_rows.load(), 1);  // requests really shared steps
  EXPECT_LE(rig.backend->max_rows.load(), 4);
}

std::vector<int64_t> ids_of(const std::string& text) {
  std::vector<int64_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    const size_t sp = text.find(' ', i);
    ids.push_back(std::stoll(text.substr(i, sp - i)));
    i = sp + 1;
  }
  return ids;
}

std::string text_of(const std::vector<int64_t>& ids, size_t n) {
  std::string t;
  for (size_t i = 0; i < n; ++i) t += std::to_string(ids[i]) + " ";
  return t;
}

TEST(ServeEngine, StopConditions) {
  Rig rig({2, 8, 16});
  const GenerationRequest base = request(5, 30);
  const StreamEvent free_run = run_to_end(*rig.engine->submit(base));
  const std::vector<int64_t> ids = ids_of(free_run.text);
  ASSERT_EQ(ids.size(), 30u);

  // An eos id ends the request, counted but not in the text; ignore_eos runs through it.
  const int64_t eos = ids[4];
  const size_t first = static_cast<size_t>(std::find(ids.begin(), ids.end(), eos) - ids.begin());
  GenerationRequest e = base;
  e.eos_ids = {eos};
  const StreamEvent stopped = run_to_end(*rig.engine->submit(e));
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_EQ(stopped.completion_tokens, static_cast<int64_t>(first + 1));
  EXPECT_EQ(stopped.text, text_of(ids, first));
  e.ignore_eos = true;
  const StreamEvent ignored = run_to_end(*rig.engine->submit(e));
  EXPECT_EQ(ignored.finish_reason, "length");
  EXPECT_EQ(ignored.text, free_run.text);
  // stop_token_ids apply even with ignore_eos.
  e.stop_token_ids = {eos};
  EXPECT_EQ(run_to_end(*rig.engine->submit(e)).text, text_of(ids, first));

  // A stop string cuts the text before its first occurrence, even across tokens.
  GenerationRequest s = base;
  const std::string stop = std::to_string(ids[10]) + " " + std::to_string(ids[11]);
  s.stop = {stop};
  const StreamEvent cut = run_to_end(*rig.engine->submit(s));
  EXPECT_EQ(cut.finish_reason, "stop");
  EXPECT_EQ(cut.text, free_run.text.substr(0, free_run.text.find(stop)));
}

TEST(ServeEngine, SeededSamplingIsReproducible) {
  Rig rig({4, 16, 16});
  GenerationRequest r = request(4, 24);
  r.sampling = {1.0f, 0, 1.0f, 5};
  const std::string a = run_to_end(*rig.engine->submit(r)).text;
  const std::string b = run_to_end(*rig.engine->submit(r)).text;
  r.sampling.seed = 6;
  const std::string c = run_to_end(*rig.engine->submit(r)).text;
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(ServeEngine, CancelFreesTheSlot) {
  Rig rig({1, 4, 16}, 1000us);
  auto s = rig.engine->submit(request(3, 2000));
  StreamEvent ev;
  ASSERT_TRUE(s->next(ev, 2s));  // it is running
  EXPECT_EQ(rig.metrics.running(), 1);
  s->cancel();
  const StreamEvent end = run_to_end(*s);
  EXPECT_EQ(end.finish_reason, "abort");
  EXPECT_LT(end.completion_tokens, 2000);
  for (int i = 0; i < 100 && rig.metrics.running() != 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(rig.metrics.running(), 0);
  // The one slot serves the next request.
  EXPECT_EQ(run_to_end(*rig.engine->submit(request(3, 5))).finish_reason, "length");
  EXPECT_NE(rig.metrics.render().find("k3_request_success_total{finished_reason=\"abort\"} 1"),
            std::string::npos);
}

TEST(ServeEngine, FullQueueRefusesAndStopAborts) {
  Rig rig({1, 1, 16}, 2000us);
  auto a = rig.engine->submit(request(3, 500));
  auto b = rig.engine->submit(request(3, 500));
  EXPECT_THROW(rig.engine->submit(request(3, 5)), EngineOverloaded);
  rig.engine->stop();
  EXPECT_EQ(run_to_end(*a).finish_reason, "abort");
  EXPECT_EQ(run_to_end(*b).finish_reason, "abort");
  EXPECT_THROW(rig.engine->submit(request(3, 5)), EngineOverloaded);
}

TEST(ServeEngine, InvalidRequestsAreErrors) {
  Rig rig({2, 0, 16});
  EXPECT_THROW(rig.engine->submit(request(0, 5)), k3::Error);  // empty prompt
  GenerationRequest r = request(3, 5);
  r.prompt[1] = 64;  // outside the vocabulary
  EXPECT_THROW(rig.engine->submit(r), k3::Error);
  EXPECT_THROW(rig.engine->submit(request(3, 0)), k3::Error);
  EXPECT_THROW(rig.engine->submit(request(100, 4000)), k3::Error);  // over the context
  GenerationRequest t = request(3, 5);
  t.sampling.top_p = 0;
  EXPECT_THROW(rig.engine->submit(t), k3::Error);
  EXPECT_THROW(Rig({4, 0, 2}), k3::Error);  // a step must fit every decode row
}

}  // namespace
