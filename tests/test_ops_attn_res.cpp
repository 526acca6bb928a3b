// Attention Residuals mixing against float64 and its structural invariances.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "cpu/ops_attn_res.h"
#include "test_util.h"

namespace k3 {
namespace {

using test::rel_l2;

// Two fp32 reductions over dim terms feed a softmax and an n-term fp32 mix: ~1e-7 relative.
constexpr double kMixRelL2 = 1e-5;
// Probabilities from the same fp32 scores; invariance checks change only rounding.
constexpr double kProbAbs = 1e-5;

struct Bank {
  std::vector<std::vector<float>> v;  // [n][dim]
  std::vector<const float*> ptrs;     // [n]
  std::vector<float> w;               // [dim]
};

// Sources with very different RMS (the bank mixes an embedding with block sums), and a score
// vector scaled so the softmax is neither one-hot nor flat.
Bank make_bank(Rng& rng, int n, int64_t dim) {
  Bank b;
  for (int j = 0; j < n; ++j) {
    const float rms = std::exp(rng.normal());
    b.v.push_back(test::random_normal(rng, dim, rms));
  }
  for (auto& x : b.v) b.ptrs.push_back(x.data());
  b.w = test::random_normal(rng, dim, 2.0f / std::sqrt(static_cast<float>(dim)));
  return b;
}

void mix_f64(const Bank& b, int64_t dim, double eps, std::vector<double>& out,
             std::vector<double>& p) {
  const int n = static_cast<int>(b.v.size());
  p.assign(n, 0.0);
  for (int j = 0; j < n; ++j) {
    double ss = 0, s = 0;
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(b.v[j][i]) * b.v[j][i];
    const double r = 1.0 / std::sqrt(ss / dim + eps);
    for (int64_t i = 0; i < dim; ++i) s += b.v[j][i] * r * b.w[i];
    p[j] = s;
  }
  const double m = *std::max_element(p.begin(), p.end());
  double sum = 0;
  for (double& x : p) sum += (x = std::exp(x - m));
  for (double& x : p) x /= sum;
  out.assign(dim, 0.0);
  for (int j = 0; j < n; ++j)
    for (int64_t i = 0; i < dim; ++i) out[i] += p[j] * b.v[j][i];
}

TEST(AttnRes, MixMatchesFloat64) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t dim = 1024;
  const float eps = 1e-5f;
  for (int n = 1; n <= 9; ++n) {
    const Bank b = make_bank(rng, n, dim);
    std::vector<float> out(dim), probs(n);
    cpu::attn_res_mix(b.ptrs.data(), n, b.w.data(), dim, eps, out.data(), probs.data());
    std::vector<double> ref, pref;
    mix_f64(b, dim, eps, ref, pref);
    EXPECT_LT(rel_l2(out, ref), kMixRelL2) << "n " << n;
    EXPECT_LT(test::max_abs_diff(probs, pref), kProbAbs) << "n " << n;
  }
}

TEST(AttnRes, OneSourceIsIdentity) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t dim = 333;
  const Bank b = make_bank(rng, 1, dim);
  std::vector<float> out(dim);
  float p = -1.0f;
  cpu::attn_res_mix(b.ptrs.data(), 1, b.w.data(), dim, 1e-5f, out.data(), &p);
  EXPECT_EQ(p, 1.0f);
  for (int64_t i = 0; i < dim; ++i) ASSERT_EQ(out[i], b.v[0][i]) << i;  // bit-exact
}

TEST(AttnRes, ScoresIgnoreEachSourcesScale) {
  // s_j sees only v_j / rms(v_j): rescaling any source by c_j > 0 keeps p (exactly with eps = 0),
  // and rescaling all of them by one c scales the output by c.
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t dim = 512;
  const int n = 6;
  Bank b = make_bank(rng, n, dim);
  std::vector<float> out(dim), p(n);
  cpu::attn_res_mix(b.ptrs.data(), n, b.w.data(), dim, 0.0f, out.data(), p.data());

  Bank each = b;
  for (int j = 0; j < n; ++j) {
    const float c = std::exp(rng.normal());
    for (float& x : each.v[j]) x *= c;
    each.ptrs[j] = each.v[j].data();
  }
  std::vector<float> out2(dim), p2(n);
  cpu::attn_res_mix(each.ptrs.data(), n, each.w.data(), dim, 0.0f, out2.data(), p2.data());
  EXPECT_LT(test::max_abs_diff(p2, p), kProbAbs);

  Bank all = b;
  const float c = 3.7f;
  for (int j = 0; j < n; ++j) {
    for (float& x : all.v[j]) x *= c;
    all.ptrs[j] = all.v[j].data();
  }
  std::vector<float> out3(dim), p3(n);
  cpu::attn_res_mix(all.ptrs.data(), n, all.w.data(), dim, 0.0f, out3.data(), p3.data());
  EXPECT_LT(test::max_abs_diff(p3, p), kProbAbs);
  std::vector<double> scaled(out.begin(), out.end());
  for (double& x : scaled) x *= c;
  EXPECT_LT(rel_l2(out3, scaled), kMixRelL2);
}

TEST(AttnRes, PermutationEquivariant) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t dim = 700;
  const int n = 8;
  const Bank b = make_bank(rng, n, dim);
  std::vector<float> out(dim), p(n);
  cpu::attn_res_mix(b.ptrs.data(), n, b.w.data(), dim, 1e-5f, out.data(), p.data());

  std::vector<int> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  for (int i = n - 1; i > 0; --i) std::swap(perm[i], perm[rng.next_u64() % (i + 1)]);
  std::vector<const float*> ptrs(n);
  for (int j = 0; j < n; ++j) ptrs[j] = b.ptrs[perm[j]];
  std::vector<float> out2(dim), p2(n);
  cpu::attn_res_mix(ptrs.data(), n, b.w.data(), dim, 1e-5f, out2.data(), p2.data());
  for (int j = 0; j < n; ++j) EXPECT_NEAR(p2[j], p[perm[j]], kProbAbs) << j;
  EXPECT_LT(rel_l2(out2, out), kMixRelL2);
}

TEST(AttnRes, OutputMayAliasASource) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t dim = 256;
  Bank b = make_bank(rng, 4, dim);
  std::vector<float> out(dim);
  cpu::attn_res_mix(b.ptrs.data(), 4, b.w.data(), dim, 1e-5f, out.data());
  cpu::attn_res_mix(b.ptrs.data(), 4, b.w.data(), dim, 1e-5f, b.v[2].data());
  for (int64_t i = 0; i < dim; ++i) ASSERT_EQ(b.v[2][i], out[i]) << i;
}

TEST(AttnRes, RejectsNoSources) {
  std::vector<float> w(8, 1.0f), out(8);
  EXPECT_THROW(cpu::attn_res_mix(nullptr, 0, w.data(), 8, 1e-5f, out.data()), Error);
}

}  // namespace
}  // namespace k3
