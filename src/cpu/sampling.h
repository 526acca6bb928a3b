// Token sampling: greedy, temperature, top-k, top-p, reproducible from a seed.
#pragma once

#include <cstdint>
#include <vector>

#include "core/rng.h"

namespace k3::cpu {

struct SamplingParams {
  float temperature = 0.0f;  // <= 0: greedy (argmax, lowest id on ties)
  int top_k = 0;             // <= 0: off
  float top_p = 1.0f;        // in (0, 1]; 1: off
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // Picks a token from logits[vocab]: temperature, then top-k, then top-p (nucleus over the
  // sorted probabilities, always keeping the first), then one draw from this sampler's stream.
  int64_t sample(const float* logits, int64_t vocab);
  const SamplingParams& params() const { return p_; }

 private:
  SamplingParams p_;
  Rng rng_;
};

// The sampler's kept candidates before the draw (temperature > 0, logits without NaN): token ids
// in descending scaled logit (ties by lower id) after top-k and top-p, and their softmax
// probabilities over the top-k set (not renormalised over the nucleus), in double. The one
// definition of the pipeline: the sampler draws from it, speculative verification reads it.
struct KeptDistribution {
  std::vector<int64_t> order;  // [kept] token ids
  std::vector<double> prob;    // [kept]
};
KeptDistribution kept_distribution(const float* logits, int64_t vocab, const SamplingParams& p);

// Index of the largest logit (lowest index on ties).
int64_t argmax(const float* logits, int64_t n);

// The sampling pipeline with the draw supplied: u in [0, 1) is the one uniform Sampler::sample
// would take from its stream (temperature 0 ignores it: greedy). Sampler::sample is exactly
// sample_from_uniform(logits, vocab, params(), its next uniform()). Raises k3::Error on bad
// params, u outside [0, 1), NaN logits, or no finite largest scaled logit.
int64_t sample_from_uniform(const float* logits, int64_t vocab, const SamplingParams& p, double u);

}  // namespace k3::cpu
