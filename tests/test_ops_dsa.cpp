// DSA indexer ops: Hadamard rotation, FP8 block cache, index scores, deterministic top-k, and
// the sparse MLA they feed (which must reduce to dense MLA when everything is selected).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "cpu/ops_dsa.h"
#include "cpu/ops_mla.h"
#include "test_util.h"

namespace k3::cpu {
namespace {

// fp32 butterflies / dots over <= 128 terms (log2(n) rounding levels): <= 2e-7 observed.
constexpr double kFp32Tol = 1e-5;

// Half an E4M3 ulp at |y| (3 mantissa bits; subnormal spacing 2^-9 below 2^-6).
double e4m3_half_ulp(double y) {
  y = std::fabs(y);
  if (y < 0x1.0p-6) return 0x1.0p-10;
  return std::ldexp(1.0, static_cast<int>(std::floor(std::log2(y))) - 3) / 2;
}

TEST(DsaHadamard, MatchesSylvesterMatrixAndIsOrthonormal) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int64_t n : {1, 2, 8, 64, 128}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const std::vector<float> x = test::random_normal(rng, size_t(n));
    const std::vector<float> y = test::random_normal(rng, size_t(n));
    // H[i][j] = (-1)^popcount(i & j) / sqrt(n), evaluated in float64.
    std::vector<double> ref(size_t(n), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        ref[i] += (__builtin_popcountll(uint64_t(i & j)) % 2 ? -1.0 : 1.0) * x[j] / std::sqrt(n);
    std::vector<float> hx = x, hy = y;
    hadamard_transform(hx.data(), n);
    hadamard_transform(hy.data(), n);
    EXPECT_LT(test::rel_l2(hx, ref), kFp32Tol);
    // Orthonormal: dot products are preserved (so index scores survive the rotation)...
    double dxy = 0, dh = 0, nx = 0, ny = 0;
    for (int64_t i = 0; i < n; ++i) {
      dxy += double(x[i]) * y[i];
      dh += double(hx[i]) * hy[i];
      nx += double(x[i]) * x[i];
      ny += double(y[i]) * y[i];
    }
    EXPECT_NEAR(dh, dxy, kFp32Tol * std::sqrt(nx * ny));
    // ...and the transform is its own inverse.
    hadamard_transform(hx.data(), n);
    EXPECT_LT(test::rel_l2(hx, x), kFp32Tol);
  }
  std::vector<float> buf(96, 1.0f);
  EXPECT_THROW(hadamard_transform(buf.data(), 96), Error);
  EXPECT_THROW(hadamard_transform(buf.data(), 3), Error);
  EXPECT_THROW(hadamard_transform(buf.data(), 0), Error);
}

TEST(DsaFp8, BlockRoundTripWithinHalfUlp) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  constexpr int64_t kBlock = 128, kN = 300;  // a partial last block of 44
  std::vector<float> x(kN);
  // Each block gets its own magnitude, so a shared scale would fail the bound.
  for (int64_t i = 0; i < kN; ++i) x[i] = rng.normal() * std::ldexp(1.0f, int(i / kBlock) * 5 - 4);
  std::vector<uint8_t> q(kN);
  std::vector<float> scales(3), back(kN);
  quantize_fp8_blocks(x.data(), kN, kBlock, q.data(), scales.data());
  dequantize_fp8_blocks(q.data(), scales.data(), kN, kBlock, back.data());
  for (int64_t b = 0; b < 3; ++b) {
    float amax = 0;
    for (int64_t i = b * kBlock; i < std::min(kN, (b + 1) * kBlock); ++i)
      amax = std::max(amax, std::fabs(x[i]));
    EXPECT_EQ(scales[b], amax / kE4M3Max) << "block " << b;
  }
  for (int64_t i = 0; i < kN; ++i) {
    const double s = scales[i / kBlock];
    // Rounding to E4M3 of x/s, plus fp32 rounding of the divide and multiply (~2^-23 each).
    const double bound = e4m3_half_ulp(x[i] / s) * s + 0x1.0p-22 * std::fabs(x[i]);
    EXPECT_LE(std::fabs(double(back[i]) - x[i]), bound) << "i=" << i << " x=" << x[i];
  }
  // The block maximum lands exactly on +-448 (the whole E4M3 range is used).
  const int64_t imax =
      std::max_element(x.begin(), x.begin() + kBlock,
                       [](float a, float b) { return std::fabs(a) < std::fabs(b); }) -
      x.begin();
  EXPECT_EQ(std::fabs(e4m3_to_float(q[imax])), kE4M3Max);
  // An all-zero block keeps scale 1 (no division by zero) and decodes to zeros.
  std::vector<float> zeros(kBlock, 0.0f), zback(kBlock, 1.0f);
  float zscale = 0;
  quantize_fp8_blocks(zeros.data(), kBlock, kBlock, q.data(), &zscale);
  EXPECT_EQ(zscale, 1.0f);
  dequantize_fp8_blocks(q.data(), &zscale, kBlock, kBlock, zback.data());
  for (float v : zback) EXPECT_EQ(v, 0.0f);
}

TEST(DsaIndex, ScoresMatchFloat64) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  constexpr int kHeads = 4, kDim = 32;
  constexpr int64_t kT = 50;
  const std::vector<float> q = test::random_normal(rng, kHeads * kDim);
  const std::vector<float> keys = test::random_normal(rng, kT * kDim);
  // Head weights of both signs, as weights_proj(x) produces.
  const std::vector<float> hw = test::random_normal(rng, kHeads, 1.0f / std::sqrt(kHeads * kDim));
  std::vector<float> scores(kT);
  dsa_index_scores(q.data(), hw.data(), keys.data(), kT, kHeads, kDim, scores.data());
  int relu_clipped = 0;
  for (int64_t s = 0; s < kT; ++s) {
    double ref = 0, mag = 0;
    for (int h = 0; h < kHeads; ++h) {
      double d = 0, dabs = 0;
      for (int j = 0; j < kDim; ++j) {
        d += double(q[h * kDim + j]) * keys[s * kDim + j];
        dabs += std::fabs(double(q[h * kDim + j]) * keys[s * kDim + j]);
      }
      relu_clipped += d < 0;
      ref += hw[h] * std::max(d, 0.0);
      mag += std::fabs(hw[h]) * dabs;
    }
    // Error relative to the sum of magnitudes: cancellation makes a relative bound on I useless.
    EXPECT_NEAR(scores[s], ref, kFp32Tol * mag) << "s=" << s;
  }
  EXPECT_GT(relu_clipped, 0);  // the ReLU branch was exercised
}

// Brute-force reference: sort every index by (score desc, index asc), keep k, sort ascending.
std::vector<int64_t> topk_reference(const std::vector<float>& s, int64_t k) {
  std::vector<int64_t> o(s.size());
  std::iota(o.begin(), o.end(), 0);
  std::stable_sort(o.begin(), o.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
  o.resize(size_t(std::min<int64_t>(k, int64_t(s.size()))));
  std::sort(o.begin(), o.end());
  return o;
}

std::vector<int64_t> run_topk(const std::vector<float>& s, int64_t k) {
  std::vector<int64_t> idx(size_t(std::min<int64_t>(k, int64_t(s.size()))) + 1, -7);
  const int64_t n = dsa_topk(s.data(), int64_t(s.size()), k, idx.data());
  EXPECT_EQ(idx[size_t(n)], -7);  // nothing written past the count
  idx.resize(static_cast<size_t>(n));
  return idx;
}

TEST(DsaTopk, TiesGoToLowerIndex) {
  const std::vector<float> s{1, 3, 3, 3, 0};
  EXPECT_EQ(run_topk(s, 2), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(run_topk(s, 4), (std::vector<int64_t>{0, 1, 2, 3}));
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  // Scores on a coarse grid: many ties straddle the selection boundary.
  std::vector<float> g(200);
  for (float& x : g) x = std::floor(rng.normal() * 2.0f);
  for (int64_t k : {1, 7, 50, 199}) EXPECT_EQ(run_topk(g, k), topk_reference(g, k)) << "k=" << k;
}

TEST(DsaTopk, KAtLeastTReturnsAll) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const std::vector<float> s = test::random_normal(rng, 37);
  std::vector<int64_t> all(37);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(run_topk(s, 37), all);
  EXPECT_EQ(run_topk(s, 2048), all);
  EXPECT_TRUE(run_topk(s, 0).empty());
}

TEST(DsaTopk, DeterministicAndCorrectForKBelowT) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const std::vector<float> s = test::random_normal(rng, 1000);
  for (int64_t k : {1, 16, 999}) {
    const std::vector<int64_t> a = run_topk(s, k);
    EXPECT_EQ(a, run_topk(s, k));
    EXPECT_EQ(a, topk_reference(s, k)) << "k=" << k;
  }
  std::vector<float> bad = s;
  bad[3] = NAN;
  std::vector<int64_t> idx(10);
  EXPECT_THROW(dsa_topk(bad.data(), int64_t(bad.size()), 10, idx.data()), Error);
}

// The whole DSA decode path: keys Hadamard-rotated and cached in FP8, index scores, top-k,
// then sparse absorbed MLA over the selection.
struct SparseMlaCase {
  static constexpr MlaDims d{.heads = 4, .nope = 16, .rope = 8, .v = 12, .kv_lora = 64};
  static constexpr int kIdxHeads = 4, kIdxDim = 32;
  int64_t T;
  std::vector<float> q_nope, q_pe, cache_c, cache_pe, iq, ihw, ikeys;
  std::vector<uint16_t> kv_b_bits;
  float scale = 1.0f / std::sqrt(float(d.nope + d.rope));

  SparseMlaCase(Rng& rng, int64_t T_) : T(T_) {
    q_nope = test::random_normal(rng, d.heads * d.nope);
    q_pe = test::random_normal(rng, d.heads * d.rope);
    cache_c = test::random_normal(rng, size_t(T * d.kv_lora));
    cache_pe = test::random_normal(rng, size_t(T * d.rope));
    kv_b_bits = test::random_bf16(rng, size_t(d.heads * (d.nope + d.v) * d.kv_lora), 0.125f);
    iq = test::random_normal(rng, kIdxHeads * kIdxDim);
    ihw = test::random_normal(rng, kIdxHeads);
    ikeys = test::random_normal(rng, size_t(T * kIdxDim));
  }
  // Index keys as cached: rotated, then FP8 with one scale per key (block = head_dim).
  std::vector<int64_t> select(int64_t k) const {
    std::vector<float> q = iq, keys = ikeys, deq(size_t(T * kIdxDim)),
                       scores(static_cast<size_t>(T));
    for (int h = 0; h < kIdxHeads; ++h) hadamard_transform(q.data() + h * kIdxDim, kIdxDim);
    std::vector<uint8_t> codes(size_t(T * kIdxDim));
    std::vector<float> kscale(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) hadamard_transform(keys.data() + t * kIdxDim, kIdxDim);
    quantize_fp8_blocks(keys.data(), T * kIdxDim, kIdxDim, codes.data(), kscale.data());
    dequantize_fp8_blocks(codes.data(), kscale.data(), T * kIdxDim, kIdxDim, deq.data());
    dsa_index_scores(q.data(), ihw.data(), deq.data(), T, kIdxHeads, kIdxDim, scores.data());
    std::vector<int64_t> idx(size_t(std::min(k, T)));
    idx.resize(size_t(dsa_topk(scores.data(), T, k, idx.data())));
    return idx;
  }
  std::vector<float> mla(const std::vector<int64_t>* sel) const {
    WeightMatrix w;
    w.name = "kv_b_proj";
    w.format = WeightFormat::BF16;
    w.rows = d.heads * (d.nope + d.v);
    w.cols = d.kv_lora;
    w.data = kv_b_bits.data();
    std::vector<float> out(d.heads * d.v);
    mla_absorbed_decode(q_nope.data(), q_pe.data(), w, cache_c.data(), cache_pe.data(), T,
                        sel ? sel->data() : nullptr, sel ? int64_t(sel->size()) : 0, d, scale,
                        out.data());
    return out;
  }
};

TEST(DsaSparseMla, TopkAtLeastTEqualsDense) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int64_t T : {1, 5, 37}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    const SparseMlaCase c(rng, T);
    for (int64_t k : {T, T + 1, int64_t{2048}}) {
      const std::vector<int64_t> sel = c.select(k);
      ASSERT_EQ(int64_t(sel.size()), T);
      // Same tokens in the same (ascending) order as the dense path: identical fp32 sums.
      EXPECT_EQ(c.mla(&sel), c.mla(nullptr));
    }
  }
}

TEST(DsaSparseMla, TopkBelowTEqualsDenseOverSelection) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const SparseMlaCase c(rng, 37);
  const std::vector<int64_t> sel = c.select(8);
  ASSERT_EQ(sel.size(), 8u);
  // Dense MLA over a cache holding only the selected rows.
  SparseMlaCase sub = c;
  sub.T = 8;
  sub.cache_c.clear();
  sub.cache_pe.clear();
  for (int64_t t : sel) {
    sub.cache_c.insert(sub.cache_c.end(), c.cache_c.begin() + t * c.d.kv_lora,
                       c.cache_c.begin() + (t + 1) * c.d.kv_lora);
    sub.cache_pe.insert(sub.cache_pe.end(), c.cache_pe.begin() + t * c.d.rope,
                        c.cache_pe.begin() + (t + 1) * c.d.rope);
  }
  EXPECT_EQ(c.mla(&sel), sub.mla(nullptr));
  EXPECT_NE(c.mla(&sel), c.mla(nullptr));  // dropping 29 tokens must change the output
}

}  // namespace
}  // namespace k3::cpu
