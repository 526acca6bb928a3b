// Token sampling. The pipeline is fixed so that a (seed, logits) pair names one token on every
// backend: temperature -> top-k -> softmax -> top-p -> renormalise -> one uniform draw mapped
// through the inverse CDF of the kept tokens in descending-probability order.
#include "cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace k3::cpu {
namespace {

void check_no_nan(const float* logits, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(logits[i])) fail("sampling: logit ", i, " is NaN");
}

void check_params(const SamplingParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f)
    fail("sampling: temperature must be finite and >= 0, got ", p.temperature);
  // Written as a negated range test so that NaN is rejected too.
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    fail("sampling: top_p must be in (0, 1], got ", p.top_p);
  if (p.top_k < 0) fail("sampling: top_k must be >= 0 (0 = off), got ", p.top_k);
}

// The pipeline after the checks (logits NaN-free, temperature > 0), with the draw u in [0, 1).
int64_t sample_checked(const float* logits, int64_t vocab, const SamplingParams& p, double u01);

}  // namespace

int64_t argmax(const float* logits, int64_t n) {
  // logits: [n]
  K3_CHECK(n > 0, "argmax over an empty vocabulary");
  check_no_nan(logits, n);
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;  // strict: the lowest index wins ties
  return best;
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {
  check_params(p);
}

int64_t Sampler::sample(const float* logits, int64_t vocab) {
  // logits: [vocab] fp32.
  K3_CHECK(vocab > 0, "sampling over an empty vocabulary");
  check_no_nan(logits, vocab);
  if (p_.temperature == 0.0f) return argmax(logits, vocab);  // greedy: no draw is consumed
  return sample_checked(logits, vocab, p_, rng_.uniform());
}

int64_t sample_from_uniform(const float* logits, int64_t vocab, const SamplingParams& p, double u) {
  // logits: [vocab] fp32.
  check_params(p);
  K3_CHECK(vocab > 0, "sampling over an empty vocabulary");
  K3_CHECK(u >= 0.0 && u < 1.0, "sampling: u must be in [0, 1), got ", u);
  check_no_nan(logits, vocab);
  if (p.temperature == 0.0f) return argmax(logits, vocab);
  return sample_checked(logits, vocab, p, u);
}

namespace {}  // namespace

KeptDistribution kept_distribution(const float* logits, int64_t vocab, const SamplingParams& p) {
  // logits: [vocab] fp32, no NaN (checked by the callers); p.temperature > 0.
  // Scaled logits in double: dividing a large logit by a tiny temperature must not overflow.
  std::vector<double> z(static_cast<size_t>(vocab));  // [vocab]
  for (int64_t i = 0; i < vocab; ++i)
    z[static_cast<size_t>(i)] = static_cast<double>(logits[i]) / p.temperature;

  // Candidates in descending z, ties by lower token id: a strict total order, so the kept set
  // and the CDF order are unique. Only the first `kept` positions are ever sorted.
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

  // Softmax over the kept tokens (the max subtracted, so exp never overflows).
  std::vector<double> prob(static_cast<size_t>(kept));  // [kept], same order as `order`
  double total = 0.0;
  for (int64_t i = 0; i < kept; ++i) {
    prob[static_cast<size_t>(i)] = std::exp(z[static_cast<size_t>(order[i])] - zmax);
    total += prob[static_cast<size_t>(i)];
  }
  for (double& q : prob) q /= total;

  // Nucleus: the shortest prefix whose mass reaches top_p; the first token is always kept.
  if (p.top_p < 1.0f) {
    double cum = 0.0;
    int64_t n = 0;
    while (n < kept) {
      cum += prob[static_cast<size_t>(n++)];
      if (cum >= static_cast<double>(p.top_p)) break;
    }
    kept = n;
  }

  KeptDistribution d;
  order.resize(static_cast<size_t>(kept));
  prob.resize(static_cast<size_t>(kept));
  d.order = std::move(order);
  d.prob = std::move(prob);
  return d;
}

namespace {

int64_t sample_checked(const float* logits, int64_t vocab, const SamplingParams& p, double u01) {
  const KeptDistribution d = kept_distribution(logits, vocab, p);
  const std::vector<int64_t>& order = d.order;
  const std::vector<double>& prob = d.prob;
  const int64_t kept = static_cast<int64_t>(d.order.size());

  // Renormalise implicitly by drawing u in [0, mass of the kept prefix).
  double mass = 0.0;
  for (int64_t i = 0; i < kept; ++i) mass += prob[static_cast<size_t>(i)];
  const double u = u01 * mass;
  double cum = 0.0;
  int64_t last_nonzero = 0;
  for (int64_t i = 0; i < kept; ++i) {
    const double q = prob[static_cast<size_t>(i)];
    if (q > 0.0) last_nonzero = i;
    cum += q;
    if (u < cum) return order[static_cast<size_t>(i)];
  }
  // Only reachable through rounding of the running sum; never return a zero-probability token.
  return order[static_cast<size_t>(last_nonzero)];
}

}  // namespace

}  // namespace k3::cpu
