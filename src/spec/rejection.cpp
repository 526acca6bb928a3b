#include "spec/rejection.h"

#include <algorithm>

#include "core/error.h"
#include "spec/target_probs.h"

namespace k3::spec {
namespace {

Verdict greedy(const float* logits, int64_t vocab, const DraftTokens& d) {
  Verdict v;
  const size_t n = d.tokens.size();
  for (size_t i = 0; i <= n; ++i) {
    const int64_t best = cpu::argmax(logits + i * static_cast<size_t>(vocab), vocab);
    v.tokens.push_back(best);
    if (i == n || d.tokens[i] != best) break;  // correction (or bonus after the last draft)
    ++v.accepted;
  }
  return v;
}

}  // namespace

Verdict rejection_sample(const float* logits, int64_t vocab, const cpu::SamplingParams& params,
                         const DraftTokens& d, Rng& rng) {
  // logits: [n + 1][vocab] fp32.
  const size_t n = d.tokens.size();
  K3_CHECK(d.probs.empty() || d.probs.size() == n, "speculative sampling: ", d.probs.size(),
           " draft distributions for ", n, " drafts");
  for (int64_t t : d.tokens)
    K3_CHECK(t >= 0 && t < vocab, "draft token ", t, " is outside the vocabulary");
  if (params.temperature <= 0.0f) return greedy(logits, vocab, d);

  Verdict v;
  for (size_t i = 0; i < n; ++i) {
    std::vector<double> p = target_probs(logits + i * static_cast<size_t>(vocab), vocab, params);
    const auto x = static_cast<size_t>(d.tokens[i]);
    const bool one_hot = d.probs.empty();
    if (!one_hot) K3_CHECK(d.probs[i].size() == p.size(), "draft distribution size mismatch");
    const double qx = one_hot ? 1.0 : d.probs[i][x];
    // Accept with probability min(1, p(x)/q(x)), written without the division.
    if (qx > 0.0 && rng.uniform() * qx < p[x]) {
      v.tokens.push_back(d.tokens[i]);
      ++v.accepted;
      continue;
    }
    // Rejected: the residual max(0, p - q). It has mass whenever a rejection can happen
    // (p != q); the fallback to p only guards rounding.
    std::vector<double> r(p.size());
    double mass = 0.0;
    for (size_t t = 0; t < p.size(); ++t) {
      const double q = one_hot ? (t == x ? 1.0 : 0.0) : d.probs[i][t];
      r[t] = std::max(0.0, p[t] - q);
      mass += r[t];
    }
    v.tokens.push_back(draw_from(mass > 0.0 ? r : p, rng.uniform()));
    return v;
  }
  // Every draft accepted: the bonus token from the last row.
  v.tokens.push_back(draw_from(target_probs(logits + n * static_cast<size_t>(vocab), vocab, params),
                               rng.uniform()));
  return v;
}

}  // namespace k3::spec
