// Speculative generation on the CPU reference: after the first sampled token, each step drafts
// up to n tokens, verifies them in one q = 1 + n row step and emits the accepted drafts plus
// the target's own token. Greedy output equals cpu::generate's; sampled output has the same
// distribution (not the same draws). eos and max_new_tokens are honoured inside a run.
#pragma once

#include <cstdint>
#include <functional>

#include "cpu/generate.h"
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

// num_speculative_tokens: n >= 1 drafts per step at most.
SpecGenerateResult speculative_generate(const cpu::CpuBackbone& model,
                                        const cpu::GenerateRequest& req, Drafter& drafter,
                                        int num_speculative_tokens,
                                        const std::function<void(int64_t token)>& on_token = {});

}  // namespace k3::spec
