#include "serve/backend_generate.h"

#include <memory>

#include "model/config.h"

namespace k3::serve {

cpu::GenerateResult generate_on(StepBackend& backend, const cpu::GenerateRequest& req,
                                const std::function<void(int64_t)>& on_token) {
  const std::unique_ptr<SlotState> state = backend.new_state();
  return cpu::generate_loop(
      req, backend.vocab_size(), backend.config().eos_token_ids, backend.max_context(),
      [&](const std::vector<int64_t>& prompt, float* logits) {
        const StepRow row{state.get(), prompt, logits};
        backend.forward({&row, 1});
      },
      [&](int64_t tok, float* logits) {
        const StepRow row{state.get(), {&tok, 1}, logits};
        backend.forward({&row, 1});
      },
      on_token);
}

}  // namespace k3::serve
