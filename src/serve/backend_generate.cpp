#include "serve/backend_generate.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "core/error.h"
#include "model/config.h"

namespace k3::serve {

cpu::GenerateResult generate_on(StepBackend& backend, const cpu::GenerateRequest& req,
                                const std::function<void(int64_t)>& on_token) {
  K3_CHECK(!req.prompt.empty(), "the prompt is empty");
  K3_CHECK(req.max_new_tokens >= 0, "max_new_tokens must be >= 0, got ", req.max_new_tokens);
  const int64_t total = static_cast<int64_t>(req.prompt.size()) + req.max_new_tokens;
  K3_CHECK(total <= backend.max_context(), "prompt (", req.prompt.size(),
           " tokens) + max_new_tokens (", req.max_new_tokens, ") exceeds the context length ",
           backend.max_context());
  const auto& eos = backend.config().eos_token_ids;
  using clock = std::chrono::steady_clock;

  cpu::GenerateResult res;
  res.finish_reason = "length";
  const std::unique_ptr<SlotState> state = backend.new_state();
  cpu::Sampler sampler(req.sampling);
  std::vector<float> logits(static_cast<size_t>(backend.vocab_size()));
  const auto t0 = clock::now();
  const StepRow prefill{state.get(), req.prompt, logits.data()};
  backend.forward({&prefill, 1});
  const auto t1 = clock::now();
  res.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  for (int i = 0; i < req.max_new_tokens; ++i) {
    const int64_t tok = sampler.sample(logits.data(), backend.vocab_size());
    res.tokens.push_back(tok);
    if (on_token) on_token(tok);
    if (!req.ignore_eos && std::find(eos.begin(), eos.end(), tok) != eos.end()) {
      res.finish_reason = "stop";
      break;
    }
    if (i + 1 < req.max_new_tokens) {
      const StepRow row{state.get(), {&res.tokens.back(), 1}, logits.data()};
      backend.forward({&row, 1});
    }
  }
  res.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return res;
}

}  // namespace k3::serve
