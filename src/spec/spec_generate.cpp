#include "spec/spec_generate.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "core/error.h"
#include "spec/rejection.h"
#include "spec/verify_cpu.h"

namespace k3::spec {

namespace {

// The CPU reference backbone as a target: verify and commit are cpu_verify / cpu_commit.
class CpuTarget final : public SpecTarget {
 public:
  explicit CpuTarget(const cpu::CpuBackbone& m) : m_(m), st_(m.new_state()) {}
  const ModelConfig& config() const override { return m_.config(); }
  int64_t max_context() const override { return m_.max_context(); }
  void prefill(std::span<const int64_t> prompt, float* logits, float* hidden) override {
    const auto H = static_cast<size_t>(m_.config().hidden_size);
    if (!hidden) {
      const std::vector<float> l =
          m_.prefill(st_, std::vector<int64_t>(prompt.begin(), prompt.end()));
      std::copy(l.begin(), l.end(), logits);
      return;
    }
    for (size_t i = 0; i < prompt.size(); ++i)
      m_.step_hidden(st_, prompt[i], logits, hidden + i * H);
  }
  void verify(std::span<const int64_t> tokens, float* logits, float* hidden) override {
    cpu_verify(m_, st_, tokens, logits, scratch_, hidden);
  }
  void commit(int64_t consumed) override { cpu_commit(st_, scratch_, consumed); }

 private:
  const cpu::CpuBackbone& m_;
  cpu::DecodeState st_;
  VerifyScratch scratch_;
};

}  // namespace

SpecGenerateResult speculative_generate(const cpu::CpuBackbone& model,
                                        const cpu::GenerateRequest& req, Drafter& drafter, int n,
                                        const std::function<void(int64_t)>& on_token) {
  CpuTarget target(model);
  return speculative_generate(target, req, drafter, n, on_token);
}

SpecGenerateResult speculative_generate(SpecTarget& model, const cpu::GenerateRequest& req,
                                        Drafter& drafter, int n,
                                        const std::function<void(int64_t)>& on_token) {
  K3_CHECK(!req.prompt.empty(), "the prompt is empty");
  K3_CHECK(req.max_new_tokens >= 0, "max_new_tokens must be >= 0, got ", req.max_new_tokens);
  K3_CHECK(n >= 1, "num_speculative_tokens must be >= 1, got ", n);
  const int64_t total = static_cast<int64_t>(req.prompt.size()) + req.max_new_tokens;
  K3_CHECK(total <= model.max_context(), "prompt (", req.prompt.size(),
           " tokens) + max_new_tokens (", req.max_new_tokens, ") exceeds the context length ",
           model.max_context());
  const auto& eos = model.config().eos_token_ids;
  const int64_t vocab = model.config().vocab_size;
  using clock = std::chrono::steady_clock;

  SpecGenerateResult out;
  cpu::GenerateResult& res = out.result;
  res.finish_reason = "length";
  cpu::Sampler sampler(req.sampling);        // the first token, as in cpu::generate
  Rng rng(req.sampling.seed ^ 0x5bd1e995u);  // acceptance and residual draws
  const auto H = static_cast<size_t>(model.config().hidden_size);
  const bool hidden = drafter.needs_hidden();
  std::vector<float> hid;  // [rows][H] final-normed hidden states, for a draft model
  const auto t0 = clock::now();
  std::vector<float> logits(static_cast<size_t>(vocab));
  if (hidden) hid.resize(req.prompt.size() * H);
  model.prefill(req.prompt, logits.data(), hidden ? hid.data() : nullptr);
  if (hidden) drafter.observe(hid.data(), static_cast<int64_t>(req.prompt.size()));
  const auto t1 = clock::now();
  res.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();

  std::vector<int64_t> context = req.prompt;  // prompt + generated
  // Emits one token; false when the run ends with it.
  const auto emit = [&](int64_t tok) {
    res.tokens.push_back(tok);
    context.push_back(tok);
    if (on_token) on_token(tok);
    if (!req.ignore_eos && std::find(eos.begin(), eos.end(), tok) != eos.end()) {
      res.finish_reason = "stop";
      return false;
    }
    return static_cast<int>(res.tokens.size()) < req.max_new_tokens;
  };
  bool running = req.max_new_tokens > 0 && emit(sampler.sample(logits.data(), vocab));
  std::vector<int64_t> rows;
  while (running) {
    // At most one token per remaining slot: q = 1 + drafts <= tokens still allowed.
    const int left = req.max_new_tokens - static_cast<int>(res.tokens.size());
    DraftTokens d = drafter.propose(context, std::min(n, left - 1));
    rows.assign(1, context.back());
    rows.insert(rows.end(), d.tokens.begin(), d.tokens.end());
    logits.resize(rows.size() * static_cast<size_t>(vocab));
    if (hidden) hid.resize(rows.size() * H);
    model.verify(rows, logits.data(), hidden ? hid.data() : nullptr);
    const Verdict v = rejection_sample(logits.data(), vocab, req.sampling, d, rng);
    model.commit(1 + v.accepted);
    if (hidden) drafter.observe(hid.data(), 1 + v.accepted);  // the kept tokens only
    if (!d.tokens.empty()) {
      ++out.stats.steps;
      out.stats.draft_tokens += static_cast<int64_t>(d.tokens.size());
      out.stats.accepted += v.accepted;
    }
    for (int64_t tok : v.tokens)
      if (!(running = emit(tok))) break;
  }
  res.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return out;
}

}  // namespace k3::spec
