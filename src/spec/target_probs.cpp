#include "spec/target_probs.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace k3::spec {

std::vector<double> target_probs(const float* logits, int64_t vocab, const cpu::SamplingParams& p) {
  // logits: [vocab] fp32.
  K3_CHECK(vocab > 0, "sampling over an empty vocabulary");
  std::vector<double> out(static_cast<size_t>(vocab), 0.0);  // [vocab]
  if (p.temperature <= 0.0f) {
    out[static_cast<size_t>(cpu::argmax(logits, vocab))] = 1.0;  // argmax checks for NaN
    return out;
  }
  for (int64_t i = 0; i < vocab; ++i)
    if (std::isnan(logits[i])) fail("sampling: logit ", i, " is NaN");
  // The sampler's own pipeline, renormalised over the kept tokens.
  const cpu::KeptDistribution d = cpu::kept_distribution(logits, vocab, p);
  double mass = 0.0;
  for (double q : d.prob) mass += q;
  for (size_t i = 0; i < d.order.size(); ++i)
    out[static_cast<size_t>(d.order[i])] = d.prob[i] / mass;
  return out;
}

int64_t draw_from(const std::vector<double>& probs, double u) {
  double mass = 0.0;
  for (double q : probs) mass += q;
  K3_CHECK(mass > 0.0, "speculative sampling: a distribution with no mass");
  const double target = u * mass;
  double cum = 0.0;
  int64_t last_nonzero = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.0) continue;
    last_nonzero = static_cast<int64_t>(i);
    cum += probs[i];
    if (target < cum) return last_nonzero;
  }
  return last_nonzero;  // only through rounding of the running sum
}

}  // namespace k3::spec
