#include "parallel/parallel_generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace k3::parallel {

cpu::GenerateResult generate(const ParallelCpuBackbone& model, const cpu::GenerateRequest& req,
                             const std::function<void(int64_t)>& on_token) {
  K3_CHECK(!req.prompt.empty(), "the prompt is empty");
  K3_CHECK(req.max_new_tokens >= 0, "max_new_tokens must be >= 0, got ", req.max_new_tokens);
  const int64_t total = static_cast<int64_t>(req.prompt.size()) + req.max_new_tokens;
  K3_CHECK(total <= model.max_context(), "prompt (", req.prompt.size(),
           " tokens) + max_new_tokens (", req.max_new_tokens, ") exceeds the context length ",
           model.max_context());
  const auto& eos = model.config().eos_token_ids;
  using clock = std::chrono::steady_clock;

  cpu::GenerateResult res;
  res.finish_reason = "length";
  ParallelState st = model.new_state(0);
  cpu::Sampler sampler(req.sampling);
  std::vector<float> logits(static_cast<size_t>(model.config().vocab_size));  // [vocab]
  const auto t0 = clock::now();
  for (int64_t t : req.prompt) model.step({&st}, {t}, logits.data());
  const auto t1 = clock::now();
  res.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  for (int i = 0; i < req.max_new_tokens; ++i) {
    const int64_t tok = sampler.sample(logits.data(), model.config().vocab_size);
    res.tokens.push_back(tok);
    if (on_token) on_token(tok);
    if (!req.ignore_eos && std::find(eos.begin(), eos.end(), tok) != eos.end()) {
      res.finish_reason = "stop";
      break;
    }
    if (i + 1 < req.max_new_tokens) model.step({&st}, {tok}, logits.data());
  }
  res.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return res;
}

}  // namespace k3::parallel
