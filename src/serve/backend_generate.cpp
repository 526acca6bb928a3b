#include "serve/backend_generate.h"

#include <memory>

#include "core/error.h"
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

namespace {

// One request of a StepBackend as a speculative target.
class BackendTarget final : public spec::SpecTarget {
 public:
  explicit BackendTarget(StepBackend& b) : b_(b), state_(b.new_state()) {
    K3_CHECK(b.supports_verify(), "speculative decoding is not supported by this backend");
  }
  const ModelConfig& config() const override { return b_.config(); }
  int64_t max_context() const override { return b_.max_context(); }
  void prefill(std::span<const int64_t> prompt, float* logits, float* hidden) override {
    const StepRow row{state_.get(), prompt, logits, hidden};
    b_.forward({&row, 1});
  }
  void verify(std::span<const int64_t> tokens, float* logits, float* hidden) override {
    const VerifyRow row{state_.get(), tokens, logits, hidden};
    b_.verify({&row, 1});
  }
  void commit(int64_t consumed) override { b_.commit(*state_, consumed); }

 private:
  StepBackend& b_;
  std::unique_ptr<SlotState> state_;
};

}  // namespace

spec::SpecGenerateResult speculative_generate_on(StepBackend& backend,
                                                 const cpu::GenerateRequest& req,
                                                 spec::Drafter& drafter, int n,
                                                 const std::function<void(int64_t)>& on_token) {
  BackendTarget target(backend);
  return spec::speculative_generate(target, req, drafter, n, on_token);
}

}  // namespace k3::serve
