// Speculative generation (on the CPU reference or any executor behind SpecTarget): after the
// first sampled token, each step drafts
// up to n tokens, verifies them in one q = 1 + n row step and emits the accepted drafts plus
// the target's own token. Greedy output equals cpu::generate's; sampled output has the same
// distribution (not the same draws). eos and max_new_tokens are honoured inside a run.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "cpu/generate.h"
#include "model/config.h"
#include "spec/drafter.h"

namespace k3::spec {

struct SpecStats {
  int64_t steps = 0;         // verify steps that carried at least one draft
  int64_t draft_tokens = 0;  // tokens proposed
  int64_t accepted = 0;      // drafts accepted
  // Tokens per verify step with drafts: accepted / steps + 1 (vLLM's mean acceptance length).
  double mean_acceptance_length() const {
    return steps > 0 ? 1.0 + static_cast<double>(accepted) / static_cast<double>(steps) : 0.0;
  }
};

struct SpecGenerateResult {
  cpu::GenerateResult result;
  SpecStats stats;
};

// The model a speculative loop verifies with: one request's state on some executor (the CPU
// reference here, any serve::StepBackend in serve/backend_generate.h).
class SpecTarget {
 public:
  virtual ~SpecTarget() = default;
  virtual const ModelConfig& config() const = 0;
  virtual int64_t max_context() const = 0;
  // Feeds the prompt; logits after its last token ([vocab]); hidden (null, or [prompt][hidden]):
  // the final-normed hidden state after every token.
  virtual void prefill(std::span<const int64_t> prompt, float* logits, float* hidden) = 0;
  // A verify step of q = tokens.size(): logits [q][vocab], hidden null or [q][hidden].
  virtual void verify(std::span<const int64_t> tokens, float* logits, float* hidden) = 0;
  // Keeps the first `consumed` tokens of the last verify step.
  virtual void commit(int64_t consumed) = 0;
};

// num_speculative_tokens: n >= 1 drafts per step at most.
SpecGenerateResult speculative_generate(SpecTarget& target, const cpu::GenerateRequest& req,
                                        Drafter& drafter, int num_speculative_tokens,
                                        const std::function<void(int64_t token)>& on_token = {});
// On the CPU reference backbone.
SpecGenerateResult speculative_generate(const cpu::CpuBackbone& model,
                                        const cpu::GenerateRequest& req, Drafter& drafter,
                                        int num_speculative_tokens,
                                        const std::function<void(int64_t token)>& on_token = {});

}  // namespace k3::spec
