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
  // Same order and arithmetic as cpu::Sampler::sample: scaled logits in double, candidates in
  // descending z with ties by lower id, softmax over the top-k, then the nucleus prefix.
  std::vector<double> z(static_cast<size_t>(vocab));  // [vocab]
  for (int64_t i = 0; i < vocab; ++i)
    z[static_cast<size_t>(i)] = static_cast<double>(logits[i]) / p.temperature;
  int64_t kept = p.top_k > 0 ? std::min<int64_t>(p.top_k, vocab) : vocab;
  std::vector<int64_t> order(static_cast<size_t>(vocab));  // token ids, [vocab]
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + kept, order.end(), [&z](int64_t a, int64_t b) {
    const double za = z[static_cast<size_t>(a)], zb = z[static_cast<size_t>(b)];
    if (za != zb) return za > zb;
    return a < b;
  });
  const double zmax = z[static_cast<size_t>(order[0])];
  if (std::isinf(zmax))
    fail("sampling: the largest logit is ", logits[order[0]], "; no distribution to sample");
  std::vector<double> prob(static_cast<size_t>(kept));  // [kept], in `order`
  double total = 0.0;
  for (int64_t i = 0; i < kept; ++i) {
    prob[static_cast<size_t>(i)] = std::exp(z[static_cast<size_t>(order[i])] - zmax);
    total += prob[static_cast<size_t>(i)];
  }
  for (double& q : prob) q /= total;
  if (p.top_p < 1.0f) {
    double cum = 0.0;
    int64_t n = 0;
    while (n < kept) {
      cum += prob[static_cast<size_t>(n++)];
      if (cum >= static_cast<double>(p.top_p)) break;
    }
    kept = n;
  }
  double mass = 0.0;
  for (int64_t i = 0; i < kept; ++i) mass += prob[static_cast<size_t>(i)];
  for (int64_t i = 0; i < kept; ++i)
    out[static_cast<size_t>(order[i])] = prob[static_cast<size_t>(i)] / mass;
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
