// Token sampling: greedy, reproducibility from a seed, top-k / top-p truncation, and the
// empirical distribution against the float64 target distribution.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "cpu/sampling.h"
#include "test_util.h"

namespace k3::cpu {
namespace {

constexpr int kDraws = 20000;
// Each frequency has std <= sqrt(0.25 / 20000) = 0.0035; 0.02 is > 5.6 sigma, so a correct
// sampler fails with negligible probability while a wrong temperature/cut is far outside.
constexpr double kFreqTol = 0.02;

SamplingParams params(float temperature, int top_k, float top_p, uint64_t seed) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

// Target distribution from the spec, in float64: softmax(logits / T) restricted to the top-k
// (ties by lower id), then the shortest descending prefix reaching top_p, renormalised.
std::vector<double> target(const std::vector<float>& logits, const SamplingParams& p) {
  const size_t V = logits.size();
  std::vector<size_t> o(V);
  std::iota(o.begin(), o.end(), 0);
  std::stable_sort(o.begin(), o.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
  const size_t k = p.top_k > 0 ? std::min<size_t>(size_t(p.top_k), V) : V;
  std::vector<double> q(k);
  double z = 0;
  for (size_t i = 0; i < k; ++i)
    z += (q[i] = std::exp((logits[o[i]] - logits[o[0]]) / p.temperature));
  size_t keep = 0;
  double cum = 0;
  while (keep < k) {
    cum += q[keep++] / z;
    if (p.top_p < 1.0f && cum >= p.top_p) break;
  }
  double mass = 0;
  for (size_t i = 0; i < keep; ++i) mass += q[i];
  std::vector<double> out(V, 0.0);
  for (size_t i = 0; i < keep; ++i) out[o[i]] = q[i] / mass;
  return out;
}

std::vector<double> frequencies(Sampler& s, const std::vector<float>& logits) {
  std::vector<double> f(logits.size(), 0.0);
  for (int i = 0; i < kDraws; ++i)
    f[size_t(s.sample(logits.data(), int64_t(logits.size())))] += 1.0 / kDraws;
  return f;
}

TEST(Sampling, GreedyPicksLowestIndexOnTies) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  std::vector<float> logits = test::random_normal(rng, 50);
  const float top = *std::max_element(logits.begin(), logits.end()) + 1.0f;
  logits[31] = logits[7] = logits[19] = top;
  EXPECT_EQ(argmax(logits.data(), 50), 7);
  Sampler greedy(params(0.0f, 0, 1.0f, seed));
  for (int i = 0; i < 10; ++i) EXPECT_EQ(greedy.sample(logits.data(), 50), 7);
}

TEST(Sampling, SameSeedSameTokensDifferentSeedDifferentTokens) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const std::vector<float> logits = test::random_normal(rng, 64);
  for (const SamplingParams& base : {params(1.0f, 0, 1.0f, 0), params(0.8f, 20, 0.9f, 0)}) {
    SamplingParams p = base;
    p.seed = seed;
    Sampler a(p), b(p);
    p.seed = seed + 1;
    Sampler c(p);
    std::vector<int64_t> ta, tb, tc;
    for (int i = 0; i < 300; ++i) {
      ta.push_back(a.sample(logits.data(), 64));
      tb.push_back(b.sample(logits.data(), 64));
      tc.push_back(c.sample(logits.data(), 64));
    }
    EXPECT_EQ(ta, tb);
    // 300 draws from a distribution over >= 10 tokens: equal sequences are (essentially)
    // impossible.
    EXPECT_NE(ta, tc);
  }
}

TEST(Sampling, TopKOneAndTinyTopPAreGreedy) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  Sampler k1(params(1.5f, 1, 1.0f, seed)), p0(params(1.5f, 0, 1e-6f, seed));
  for (int i = 0; i < 200; ++i) {
    std::vector<float> logits = test::random_normal(rng, 40);
    logits[size_t(i % 40)] = logits[size_t((i + 13) % 40)];  // exercise ties as well
    const int64_t g = argmax(logits.data(), 40);
    EXPECT_EQ(k1.sample(logits.data(), 40), g);
    EXPECT_EQ(p0.sample(logits.data(), 40), g);
  }
}

TEST(Sampling, EmpiricalDistributionMatchesTarget) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const std::vector<float> logits = test::random_normal(rng, 12);
  for (const SamplingParams& p :
       {params(0.7f, 0, 1.0f, seed), params(1.3f, 0, 1.0f, seed), params(1.0f, 5, 1.0f, seed),
        params(1.0f, 0, 0.7f, seed), params(0.9f, 8, 0.85f, seed)}) {
    SCOPED_TRACE("T=" + std::to_string(p.temperature) + " top_k=" + std::to_string(p.top_k) +
                 " top_p=" + std::to_string(p.top_p));
    Sampler s(p);
    const std::vector<double> f = frequencies(s, logits), t = target(logits, p);
    EXPECT_LT(test::max_abs_diff(f, t), kFreqTol);
    for (size_t i = 0; i < t.size(); ++i)
      if (t[i] == 0.0) {
        EXPECT_EQ(f[i], 0.0) << "token " << i << " is outside the kept set";
      }
  }
}

TEST(Sampling, TopKAndTopPRestrictSupport) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const std::vector<float> logits = test::random_normal(rng, 100);
  std::vector<int64_t> order(100);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  // A high temperature flattens the distribution, so every kept token shows up in 5000 draws.
  Sampler s(params(3.0f, 5, 1.0f, seed));
  std::vector<int> hits(100, 0);
  for (int i = 0; i < 5000; ++i) ++hits[size_t(s.sample(logits.data(), 100))];
  for (int r = 0; r < 100; ++r) {
    const int h = hits[static_cast<size_t>(order[r])];
    if (r < 5) {
      EXPECT_GT(h, 0) << "rank " << r;
    } else {
      EXPECT_EQ(h, 0) << "rank " << r;
    }
  }
  // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps two tokens, 0.81 keeps three.
  const std::vector<float> lp{std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};
  for (auto [top_p, support] : {std::pair{0.75f, 2}, std::pair{0.81f, 3}}) {
    Sampler n(params(1.0f, 0, top_p, seed));
    const std::vector<double> f = frequencies(n, lp);
    EXPECT_EQ(std::count_if(f.begin(), f.end(), [](double v) { return v > 0; }), support);
    EXPECT_NEAR(f[1], 0.5 / (support == 2 ? 0.8 : 0.95), kFreqTol);
  }
  // Masked (-inf) tokens are never drawn.
  std::vector<float> masked = test::random_normal(rng, 10);
  for (int i = 0; i < 10; i += 2) masked[size_t(i)] = -INFINITY;
  Sampler m(params(1.0f, 0, 1.0f, seed));
  for (int i = 0; i < 2000; ++i) EXPECT_EQ(m.sample(masked.data(), 10) % 2, 1);
}

void expect_param_error(const SamplingParams& p, const std::string& name) {
  try {
    Sampler s(p);
    ADD_FAILURE() << "no error for invalid " << name;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
  }
}

TEST(Sampling, InvalidParamsAndLogitsAreErrors) {
  expect_param_error(params(-0.5f, 0, 1.0f, 1), "temperature");
  expect_param_error(params(NAN, 0, 1.0f, 1), "temperature");
  expect_param_error(params(INFINITY, 0, 1.0f, 1), "temperature");
  expect_param_error(params(1.0f, 0, 0.0f, 1), "top_p");
  expect_param_error(params(1.0f, 0, 1.5f, 1), "top_p");
  expect_param_error(params(1.0f, 0, NAN, 1), "top_p");
  expect_param_error(params(1.0f, -1, 1.0f, 1), "top_k");
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  std::vector<float> logits = test::random_normal(rng, 16);
  logits[9] = NAN;
  Sampler greedy(params(0.0f, 0, 1.0f, seed)), sampled(params(1.0f, 4, 0.9f, seed));
  EXPECT_THROW(greedy.sample(logits.data(), 16), Error);
  EXPECT_THROW(sampled.sample(logits.data(), 16), Error);
  EXPECT_THROW(argmax(logits.data(), 16), Error);
  const std::vector<float> all_masked(16, -INFINITY);
  EXPECT_THROW(sampled.sample(all_masked.data(), 16), Error);
  EXPECT_THROW(sampled.sample(logits.data(), 0), Error);
}

}  // namespace
}  // namespace k3::cpu
