// Drafters propose the next tokens of a request for the target model to verify. One drafter
// object per request (a draft model keeps per-request state); the n-gram drafter needs no model.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "runtime/deploy_config.h"
#include "spec/rejection.h"

namespace k3::spec {

class Drafter {
 public:
  virtual ~Drafter() = default;
  // Up to n tokens that may follow `context` (prompt + generated so far, ending with the last
  // sampled token, which the verify step feeds first). Fewer, or none, when it has no guess.
  virtual DraftTokens propose(std::span<const int64_t> context, int n) = 0;
  // Draft models read the target's hidden states: when needs_hidden(), the caller reports the
  // final-normed hidden state ([n][hidden] fp32) of every token the target consumed and kept,
  // in order (prompt tokens, then each step's committed tokens), before the next propose().
  virtual bool needs_hidden() const { return false; }
  virtual void observe(const float* hidden, int64_t n) {}
};

// Prompt lookup (vLLM method "ngram"): find the longest suffix of the context, from
// prompt_lookup_max down to prompt_lookup_min tokens, that also occurs earlier (the most recent
// earlier occurrence wins), and propose the tokens that followed it. Deterministic: q one-hot.
class NgramDrafter final : public Drafter {
 public:
  NgramDrafter(int prompt_lookup_min, int prompt_lookup_max);
  DraftTokens propose(std::span<const int64_t> context, int n) override;

 private:
  int min_, max_;
};

class DraftModel;

// The drafter speculative_config names: ngram, or draft_model (then `draft` is the loaded
// speculative_config.model and `sampling` the request's, for the draft's own draws).
// k3::Error for a method this build cannot run or a missing draft model.
std::unique_ptr<Drafter> make_drafter(const SpeculativeConfig& cfg,
                                      const DraftModel* draft = nullptr,
                                      const cpu::SamplingParams& sampling = {});

}  // namespace k3::spec
