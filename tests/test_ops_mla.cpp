// MLA decode: the absorbed form (what the GPU runs) against an independent float64
// materialised attention, against mla_naive_decode, and over DSA-style token subsets.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "cpu/ops_mla.h"
#include "test_util.h"

namespace k3::cpu {
namespace {

using test::rel_l2;

// fp32 accumulation over <= 64-term dots and a <= 37-way softmax: observed errors are <= 4e-7
// relative; 2e-5 leaves a 50x margin and still catches any wrong term (>= 1e-2).
constexpr double kFp32VsF64Tol = 2e-5;
// Absorbed and naive are the same math in different summation orders (brief: rel L2 < 1e-5).
constexpr double kAbsorbedVsNaiveTol = 1e-5;
// Attending a subset vs the gathered sub-cache: identical math, only loop order may differ.
constexpr double kSubsetTol = 1e-6;

// Small K3-shaped dims (K3: 96 heads, nope 128, rope 64, v 128, kv_lora 512).
constexpr MlaDims kDims{.heads = 4, .nope = 16, .rope = 8, .v = 12, .kv_lora = 64};

struct MlaCase {
  MlaDims d = kDims;
  int64_t T = 0;
  std::vector<float> q_nope, q_pe;       // [heads][nope], [heads][rope]
  std::vector<uint16_t> kv_b_bits;       // bf16 [heads*(nope+v)][kv_lora]
  std::vector<float> cache_c, cache_pe;  // [T][kv_lora], [T][rope]
  float scale = 1.0f / std::sqrt(static_cast<float>(kDims.nope + kDims.rope));

  MlaCase(Rng& rng, int64_t T_, float q_scale = 1.5f) : T(T_) {
    const size_t rows = static_cast<size_t>(d.heads) * (d.nope + d.v);
    q_nope = test::random_normal(rng, static_cast<size_t>(d.heads * d.nope), q_scale);
    q_pe = test::random_normal(rng, static_cast<size_t>(d.heads * d.rope), q_scale);
    // 1/sqrt(kv_lora) keeps W_uk c ~ N(0, 1), like a trained projection of a normed latent.
    kv_b_bits = test::random_bf16(rng, rows * d.kv_lora, 1.0f / std::sqrt(float(d.kv_lora)));
    cache_c = test::random_normal(rng, static_cast<size_t>(T * d.kv_lora));
    cache_pe = test::random_normal(rng, static_cast<size_t>(T * d.rope));
  }
  // Built on demand so that copies of a case never point at another case's bits.
  WeightMatrix kv_b() const {
    WeightMatrix m;
    m.name = "kv_b_proj";
    m.format = WeightFormat::BF16;
    m.rows = static_cast<int64_t>(kv_b_bits.size()) / kDims.kv_lora;
    m.cols = kDims.kv_lora;
    m.data = kv_b_bits.data();
    return m;
  }
  double w(int64_t r, int64_t c) const { return bf16_to_float(kv_b_bits[r * d.kv_lora + c]); }

  std::vector<float> absorbed(const std::vector<int64_t>* sel = nullptr) const {
    std::vector<float> out(static_cast<size_t>(d.heads * d.v));
    mla_absorbed_decode(q_nope.data(), q_pe.data(), kv_b(), cache_c.data(), cache_pe.data(), T,
                        sel ? sel->data() : nullptr, sel ? int64_t(sel->size()) : 0, d, scale,
                        out.data());
    return out;
  }
  std::vector<float> naive(const std::vector<int64_t>* sel = nullptr) const {
    std::vector<float> out(static_cast<size_t>(d.heads * d.v));
    mla_naive_decode(q_nope.data(), q_pe.data(), kv_b(), cache_c.data(), cache_pe.data(), T,
                     sel ? sel->data() : nullptr, sel ? int64_t(sel->size()) : 0, d, scale,
                     out.data());
    return out;
  }

  // Materialised attention in float64 over all T tokens, written from the spec formulas:
  // k_t[h] = [W_uk[h] c_t ; pe_t], v_t[h] = W_uv[h] c_t, softmax(q.k * scale), o = sum p v.
  std::vector<double> reference() const {
    std::vector<double> out(static_cast<size_t>(d.heads * d.v), 0.0);
    for (int h = 0; h < d.heads; ++h) {
      const int64_t r0 = int64_t(h) * (d.nope + d.v);
      std::vector<double> s(static_cast<size_t>(T)), v(static_cast<size_t>(T * d.v));
      double smax = -INFINITY;
      for (int64_t t = 0; t < T; ++t) {
        double acc = 0.0;
        for (int i = 0; i < d.nope; ++i) {
          double k = 0.0;
          for (int j = 0; j < d.kv_lora; ++j) k += w(r0 + i, j) * cache_c[t * d.kv_lora + j];
          acc += double(q_nope[h * d.nope + i]) * k;
        }
        for (int i = 0; i < d.rope; ++i)
          acc += double(q_pe[h * d.rope + i]) * double(cache_pe[t * d.rope + i]);
        s[t] = acc * double(scale);
        smax = std::max(smax, s[t]);
        for (int i = 0; i < d.v; ++i) {
          double vv = 0.0;
          for (int j = 0; j < d.kv_lora; ++j)
            vv += w(r0 + d.nope + i, j) * cache_c[t * d.kv_lora + j];
          v[t * d.v + i] = vv;
        }
      }
      double z = 0.0;
      for (double& x : s) z += (x = std::exp(x - smax));
      for (int64_t t = 0; t < T; ++t)
        for (int i = 0; i < d.v; ++i) out[h * d.v + i] += s[t] / z * v[t * d.v + i];
    }
    return out;
  }
};

// A random subset of [0, T) of size n, in random order (the op must not assume sorted input).
std::vector<int64_t> random_subset(Rng& rng, int64_t T, int64_t n) {
  std::vector<int64_t> all(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) all[i] = i;
  for (int64_t i = T - 1; i > 0; --i) std::swap(all[i], all[rng.next_u64() % uint64_t(i + 1)]);
  all.resize(static_cast<size_t>(n));
  return all;
}

TEST(MlaDecode, AbsorbedAndNaiveMatchFloat64Reference) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int64_t T : {1, 5, 37}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    const MlaCase c(rng, T);
    const std::vector<double> ref = c.reference();
    EXPECT_LT(rel_l2(c.absorbed(), ref), kFp32VsF64Tol);
    EXPECT_LT(rel_l2(c.naive(), ref), kFp32VsF64Tol);
  }
}

TEST(MlaDecode, AbsorbedEqualsNaive) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int64_t T : {1, 5, 37}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    const MlaCase c(rng, T);
    EXPECT_LT(rel_l2(c.absorbed(), c.naive()), kAbsorbedVsNaiveTol);
  }
}

TEST(MlaDecode, SingleTokenReturnsItsValue) {
  // With one visible token the softmax is exactly 1, whatever the query: out[h] = W_uv[h] c_0.
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const MlaCase c(rng, 1);
  std::vector<double> expect(static_cast<size_t>(c.d.heads * c.d.v), 0.0);
  for (int h = 0; h < c.d.heads; ++h)
    for (int i = 0; i < c.d.v; ++i)
      for (int j = 0; j < c.d.kv_lora; ++j)
        expect[h * c.d.v + i] += c.w(h * (c.d.nope + c.d.v) + c.d.nope + i, j) * c.cache_c[j];
  EXPECT_LT(rel_l2(c.absorbed(), expect), kFp32VsF64Tol);
}

TEST(MlaDecode, SelectedEqualsGatheredSubCache) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int64_t n : {1, 9, 36}) {
    SCOPED_TRACE("n_selected=" + std::to_string(n));
    const MlaCase full(rng, 37);
    const std::vector<int64_t> sel = random_subset(rng, full.T, n);
    // The same query over a cache that only holds the selected rows, in the selected order.
    MlaCase sub = full;
    sub.T = n;
    sub.cache_c.clear();
    sub.cache_pe.clear();
    for (int64_t t : sel) {
      sub.cache_c.insert(sub.cache_c.end(), full.cache_c.begin() + t * kDims.kv_lora,
                         full.cache_c.begin() + (t + 1) * kDims.kv_lora);
      sub.cache_pe.insert(sub.cache_pe.end(), full.cache_pe.begin() + t * kDims.rope,
                          full.cache_pe.begin() + (t + 1) * kDims.rope);
    }
    const std::vector<double> ref = sub.reference();
    EXPECT_LT(rel_l2(full.absorbed(&sel), sub.absorbed()), kSubsetTol);
    EXPECT_LT(rel_l2(full.naive(&sel), sub.naive()), kSubsetTol);
    EXPECT_LT(rel_l2(full.absorbed(&sel), ref), kFp32VsF64Tol);
    // And the subset really changes the answer (n < T drops tokens with non-zero weight).
    if (n < full.T) {
      EXPECT_GT(rel_l2(full.absorbed(&sel), full.absorbed()), 1e-3);
    }
  }
}

TEST(MlaDecode, LargeScoresStayFinite) {
  // Scores of several hundred: a softmax without max subtraction overflows exp() to inf/NaN.
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const MlaCase c(rng, 37, /*q_scale=*/100.0f);
  const std::vector<float> out = c.absorbed();
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
  // fp32 score errors grow with |score| (~1e-7 * 500); the output error follows them.
  constexpr double kLargeScoreTol = 1e-3;
  EXPECT_LT(rel_l2(out, c.reference()), kLargeScoreTol);
  EXPECT_LT(rel_l2(out, c.naive()), kLargeScoreTol);
}

TEST(MlaDecode, RejectsBadInputs) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  MlaCase c(rng, 5);
  const std::vector<int64_t> out_of_range{0, 5}, duplicate{1, 3, 1}, negative{-1};
  EXPECT_THROW(c.absorbed(&out_of_range), Error);
  EXPECT_THROW(c.naive(&out_of_range), Error);
  EXPECT_THROW(c.absorbed(&duplicate), Error);
  EXPECT_THROW(c.absorbed(&negative), Error);
  // A non-null selection with zero entries is an error (null alone means "all tokens").
  const int64_t one = 0;
  std::vector<float> out(static_cast<size_t>(c.d.heads * c.d.v));
  EXPECT_THROW(mla_absorbed_decode(c.q_nope.data(), c.q_pe.data(), c.kv_b(), c.cache_c.data(),
                                   c.cache_pe.data(), c.T, &one, 0, c.d, c.scale, out.data()),
               Error);
  MlaCase bad_shape = c;
  bad_shape.d.v = 11;  // kv_b rows no longer equal heads * (nope + v)
  EXPECT_THROW(bad_shape.absorbed(), Error);
  c.T = 0;
  EXPECT_THROW(c.absorbed(), Error);
  EXPECT_THROW(c.naive(), Error);
}

}  // namespace
}  // namespace k3::cpu
