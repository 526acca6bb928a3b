// Verification of drafted tokens against the target model's logits. Greedy: accept drafts while
// they equal the target argmax, then emit the target argmax (correction or bonus). Sampled: the
// standard speculative sampling rule (accept draft x with probability min(1, p(x)/q(x)), else
// draw from normalize(max(0, p - q)); a bonus draw from the last p when all are accepted), which
// leaves the distribution of every emitted token equal to the target's.
#pragma once

#include <cstdint>
#include <vector>

#include "core/rng.h"
#include "cpu/sampling.h"

namespace k3::spec {

struct DraftTokens {
  std::vector<int64_t> tokens;             // [n] proposed continuation
  std::vector<std::vector<double>> probs;  // [n][vocab] draft distributions q; empty: one-hot
};

struct Verdict {
  int accepted = 0;             // drafts accepted, in [0, n]
  std::vector<int64_t> tokens;  // [accepted + 1]: the accepted drafts, then the target's token
};

// target_logits: [n + 1][vocab] fp32, row i = the target's logits after consuming the last
// sampled token and drafts[0, i). Greedy (temperature 0) consumes no draws from `rng`.
Verdict rejection_sample(const float* target_logits, int64_t vocab,
                         const cpu::SamplingParams& params, const DraftTokens& drafts, Rng& rng);

}  // namespace k3::spec
