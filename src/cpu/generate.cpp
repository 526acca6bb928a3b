#include "cpu/generate.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "core/error.h"

namespace k3::cpu {

GenerateResult generate_loop(const GenerateRequest& req, int64_t vocab,
                             const std::vector<int64_t>& eos, int64_t max_context,
                             const PrefillFn& prefill, const StepFn& step,
                             const std::function<void(int64_t)>& on_token) {
  K3_CHECK(!req.prompt.empty(), "the prompt is empty");
  K3_CHECK(req.max_new_tokens >= 0, "max_new_tokens must be >= 0, got ", req.max_new_tokens);
  const int64_t total = static_cast<int64_t>(req.prompt.size()) + req.max_new_tokens;
  K3_CHECK(total <= max_context, "prompt (", req.prompt.size(), " tokens) + max_new_tokens (",
           req.max_new_tokens, ") exceeds the context length ", max_context);
  using clock = std::chrono::steady_clock;

  GenerateResult res;
  res.finish_reason = "length";
  Sampler sampler(req.sampling);
  std::vector<float> logits(static_cast<size_t>(vocab));  // [vocab]
  const auto t0 = clock::now();
  prefill(req.prompt, logits.data());
  const auto t1 = clock::now();
  res.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  for (int i = 0; i < req.max_new_tokens; ++i) {
    const int64_t tok = sampler.sample(logits.data(), vocab);
    res.tokens.push_back(tok);
    if (on_token) on_token(tok);
    if (!req.ignore_eos && std::find(eos.begin(), eos.end(), tok) != eos.end()) {
      res.finish_reason = "stop";
      break;
    }
    if (i + 1 < req.max_new_tokens) step(tok, logits.data());
  }
  res.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return res;
}

GenerateResult generate(const CpuBackbone& model, const GenerateRequest& req,
                        const std::function<void(int64_t)>& on_token) {
  DecodeState st = model.new_state();
  return generate_loop(
      req, model.config().vocab_size, model.config().eos_token_ids, model.max_context(),
      [&](const std::vector<int64_t>& prompt, float* logits) {
        for (int64_t t : prompt) model.step(st, t, logits);
      },
      [&](int64_t tok, float* logits) { model.step(st, tok, logits); }, on_token);
}

}  // namespace k3::cpu
