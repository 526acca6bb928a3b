// Rejection sampling and the n-gram drafter. Greedy verification accepts exactly the drafts that
// equal the target argmax. Probabilistic verification leaves the distribution of the emitted
// token equal to the target's (after temperature / top-k / top-p), for a one-hot drafter
// (n-gram) and for a drafter with its own distribution q: a chi-square goodness-of-fit test over
// many seeded trials.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "cpu/sampling.h"
#include "spec/drafter.h"
#include "spec/rejection.h"
#include "spec/target_probs.h"
#include "test_util.h"

namespace k3 {
namespace {

// Trials per distribution test: with p(x) >= ~1e-2 the expected counts are >= 100, so the
// chi-square approximation holds.
constexpr int kTrials = 20000;
// Chi-square 99.99% quantiles for 1..10 degrees of freedom: a correct sampler fails one run in
// 10^4 per test; a wrong residual (e.g. sampling p instead of max(0, p - q)) shifts the counts by
// far more than this at 2e4 trials. The seed is fixed, so the test is deterministic.
constexpr double kChi2Q9999[] = {15.137, 18.421, 21.108, 23.513, 25.745,
                                 27.856, 29.878, 31.828, 33.720, 35.564};

std::vector<float> logits_of(std::initializer_list<float> v) {
  return std::vector<float>(v);
}

TEST(SpecGreedy, AcceptsWhileDraftsEqualTheArgmax) {
  // Three rows over vocab 4 with argmax 2, 0, 3.
  const std::vector<float> l = {0, 1, 5, 2, /**/ 9, 1, 1, 1, /**/ 0, 0, 0, 1};
  Rng rng(1);
  const cpu::SamplingParams greedy;
  spec::Verdict v = spec::rejection_sample(l.data(), 4, greedy, {{2, 0}, {}}, rng);
  EXPECT_EQ(v.accepted, 2);
  EXPECT_EQ(v.tokens, (std::vector<int64_t>{2, 0, 3}));  // the bonus is the last argmax
  v = spec::rejection_sample(l.data(), 4, greedy, {{2, 1}, {}}, rng);
  EXPECT_EQ(v.accepted, 1);
  EXPECT_EQ(v.tokens, (std::vector<int64_t>{2, 0}));  // correction at the first mismatch
  v = spec::rejection_sample(l.data(), 4, greedy, {{3, 0}, {}}, rng);
  EXPECT_EQ(v.accepted, 0);
  EXPECT_EQ(v.tokens, (std::vector<int64_t>{2}));
  v = spec::rejection_sample(l.data(), 4, greedy, {}, rng);  // no drafts: one plain step
  EXPECT_EQ(v.tokens, (std::vector<int64_t>{2}));
  EXPECT_THROW(spec::rejection_sample(l.data(), 4, greedy, {{7}, {}}, rng), Error);
}

TEST(SpecSampling, TargetProbsFollowTheSamplerPipeline) {
  // top_k 3 keeps ids 4, 0, 2; top_p 0.8 then cuts the tail of those.
  const auto l = logits_of({2.0f, -1.0f, 1.5f, 0.0f, 3.0f});
  const cpu::SamplingParams sp{0.7f, 3, 0.8f, 0};
  const std::vector<double> p = spec::target_probs(l.data(), 5, sp);
  const double t = 0.7f;  // the float temperature, as the pipeline divides by it
  const double z[3] = {std::exp(3.0 / t), std::exp(2.0 / t), std::exp(1.5 / t)};
  const double s = z[0] + z[1] + z[2];
  // 4 alone has z0/s ~ 0.62 < 0.8, 4 and 0 reach 0.8: id 2 is cut.
  ASSERT_LT(z[0] / s, 0.8);
  ASSERT_GE((z[0] + z[1]) / s, 0.8);
  EXPECT_NEAR(p[4], z[0] / (z[0] + z[1]), 1e-12);
  EXPECT_NEAR(p[0], z[1] / (z[0] + z[1]), 1e-12);
  EXPECT_EQ(p[1], 0.0);
  EXPECT_EQ(p[2], 0.0);
  EXPECT_EQ(p[3], 0.0);
  // Greedy is one-hot on the argmax.
  const std::vector<double> g = spec::target_probs(l.data(), 5, {});
  EXPECT_EQ(g[4], 1.0);
}

// target_probs is the distribution cpu::sample_from_uniform draws from: the share of a fine grid
// of uniforms that maps to each token equals its probability (to the grid's resolution).
TEST(SpecSampling, TargetProbsEqualTheSamplersDistribution) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng r(seed);
  constexpr int64_t kVocab = 12;
  constexpr int kGrid = 20000;
  // Each token owns one interval of u, so its grid share is within 2 / kGrid of its mass.
  constexpr double kTol = 2.0 / kGrid;
  for (const cpu::SamplingParams sp :
       {cpu::SamplingParams{1.0f, 0, 1.0f, 0}, cpu::SamplingParams{0.7f, 6, 1.0f, 0},
        cpu::SamplingParams{1.3f, 0, 0.8f, 0}, cpu::SamplingParams{0.5f, 8, 0.9f, 0}}) {
    const std::vector<float> l = test::random_normal(r, kVocab, 2.0f);
    const std::vector<double> p = spec::target_probs(l.data(), kVocab, sp);
    std::vector<int> counts(kVocab, 0);
    for (int i = 0; i < kGrid; ++i)
      ++counts[static_cast<size_t>(
          cpu::sample_from_uniform(l.data(), kVocab, sp, (i + 0.5) / kGrid))];
    for (int64_t t = 0; t < kVocab; ++t)
      EXPECT_NEAR(static_cast<double>(counts[static_cast<size_t>(t)]) / kGrid,
                  p[static_cast<size_t>(t)], kTol)
          << "token " << t << " temperature " << sp.temperature << " top_k " << sp.top_k
          << " top_p " << sp.top_p;
  }
}

// Chi-square statistic of counts against probs; tokens with p = 0 must never occur.
double chi_square(const std::vector<int>& counts, const std::vector<double>& p, int trials,
                  int* dof) {
  double x2 = 0;
  int support = 0;
  for (size_t t = 0; t < p.size(); ++t) {
    if (p[t] == 0.0) {
      EXPECT_EQ(counts[t], 0) << "token " << t << " has probability 0";
      continue;
    }
    ++support;
    const double e = p[t] * trials;
    x2 += (counts[t] - e) * (counts[t] - e) / e;
  }
  *dof = support - 1;
  return x2;
}

// First emitted token of a 2-draft verify step, over many trials: its distribution must be p of
// row 0 whatever the drafter does.
void expect_unchanged_distribution(const std::vector<float>& rows, int64_t vocab,
                                   const cpu::SamplingParams& sp,
                                   const std::vector<double>& q /* [vocab] or empty */,
                                   int64_t fixed_draft) {
  const std::vector<double> p = spec::target_probs(rows.data(), vocab, sp);
  Rng rng(20261202);  // acceptance / residual draws
  Rng drng(977);      // the draft model's own draws
  std::vector<int> counts(static_cast<size_t>(vocab), 0);
  std::vector<int> second(static_cast<size_t>(vocab), 0);
  int with_second = 0;
  for (int i = 0; i < kTrials; ++i) {
    spec::DraftTokens d;
    if (q.empty()) {
      d.tokens = {fixed_draft, fixed_draft};
    } else {
      d.tokens = {spec::draw_from(q, drng.uniform()), spec::draw_from(q, drng.uniform())};
      d.probs = {q, q};
    }
    const spec::Verdict v = spec::rejection_sample(rows.data(), vocab, sp, d, rng);
    ASSERT_EQ(v.tokens.size(), static_cast<size_t>(v.accepted + 1));
    ++counts[static_cast<size_t>(v.tokens[0])];
    if (v.tokens.size() > 1) {
      ++second[static_cast<size_t>(v.tokens[1])];
      ++with_second;
    }
  }
  int dof = 0;
  const double x2 = chi_square(counts, p, kTrials, &dof);
  ASSERT_GE(dof, 1);
  ASSERT_LE(dof, 10);
  EXPECT_LT(x2, kChi2Q9999[dof - 1]) << "dof " << dof;
  // The second token (draft 2 accepted or its correction) follows row 1's p, given the first
  // draft was accepted: the rows here do not depend on the prefix.
  if (with_second > 2000) {
    const std::vector<double> p1 =
        spec::target_probs(rows.data() + static_cast<size_t>(vocab), vocab, sp);
    const double x2b = chi_square(second, p1, with_second, &dof);
    if (dof >= 1) {
      EXPECT_LT(x2b, kChi2Q9999[dof - 1]) << "second token, dof " << dof;
    }
  }
}

TEST(SpecSampling, OneHotDrafterLeavesTheDistributionUnchanged) {
  // Three rows over vocab 6 (two drafts and the bonus row).
  const std::vector<float> rows = {1.0f, 0.2f, -0.5f, 1.4f,  0.0f, 0.9f,  //
                                   0.3f, 1.1f, 0.8f,  -1.0f, 0.5f, 0.0f,  //
                                   0.0f, 0.0f, 1.0f,  2.0f,  0.5f, 0.1f};
  expect_unchanged_distribution(rows, 6, {1.0f, 0, 1.0f, 0}, {}, 3);  // likely draft
  expect_unchanged_distribution(rows, 6, {0.8f, 0, 1.0f, 0}, {}, 2);  // unlikely draft
  expect_unchanged_distribution(rows, 6, {1.2f, 5, 0.9f, 0}, {}, 1);  // top-k / top-p
  expect_unchanged_distribution(rows, 6, {1.0f, 4, 1.0f, 0}, {}, 2);  // draft outside top-k
}

TEST(SpecSampling, DraftModelDistributionLeavesTheTargetUnchanged) {
  const std::vector<float> rows = {1.0f, 0.2f, -0.5f, 1.4f,  0.0f, 0.9f,  //
                                   0.3f, 1.1f, 0.8f,  -1.0f, 0.5f, 0.0f,  //
                                   0.0f, 0.0f, 1.0f,  2.0f,  0.5f, 0.1f};
  // A draft distribution unlike the target (mass on ids the target rates low).
  const std::vector<double> q = {0.05, 0.30, 0.25, 0.10, 0.20, 0.10};
  expect_unchanged_distribution(rows, 6, {1.0f, 0, 1.0f, 0}, q, 0);
  expect_unchanged_distribution(rows, 6, {0.9f, 4, 0.95f, 0}, q, 0);
}

TEST(NgramDrafter, ProposesWhatFollowedTheLongestMostRecentMatch) {
  spec::NgramDrafter d(1, 3);
  const std::vector<int64_t> a = {1, 2, 3, 4, 1, 2, 3};
  EXPECT_EQ(d.propose(a, 3).tokens, (std::vector<int64_t>{4, 1, 2}));
  EXPECT_EQ(d.propose(a, 1).tokens, (std::vector<int64_t>{4}));
  EXPECT_TRUE(d.propose(a, 0).tokens.empty());
  // Suffix "8 1 2" never occurred before; "1 2" did, most recently followed by 8.
  const std::vector<int64_t> b = {1, 2, 9, 1, 2, 8, 1, 2};
  EXPECT_EQ(d.propose(b, 3).tokens, (std::vector<int64_t>{8, 1, 2}));
  // A match near the end proposes only the tokens that exist.
  const std::vector<int64_t> c = {5, 6, 5};
  EXPECT_EQ(d.propose(c, 4).tokens, (std::vector<int64_t>{6, 5}));
  // No earlier occurrence of any suffix of length >= min: nothing.
  spec::NgramDrafter d2(2, 4);
  const std::vector<int64_t> e = {1, 2, 3, 4, 5, 1};
  EXPECT_TRUE(d2.propose(e, 3).tokens.empty());
  EXPECT_TRUE(d.propose(std::vector<int64_t>{7}, 3).tokens.empty());
  EXPECT_THROW(spec::NgramDrafter(3, 2), Error);
}

}  // namespace
}  // namespace k3
