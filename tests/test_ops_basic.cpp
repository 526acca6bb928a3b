// Elementary CPU ops against independent float64 loops written here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "cpu/ops_basic.h"
#include "test_util.h"

namespace k3 {
namespace {

using test::rel_l2;

// fp32 accumulation over a few hundred terms of random sign: rel L2 error ~1e-7, so 1e-5 is
// loose enough never to flake and tight enough to catch any wrong term.
constexpr double kLinearRelL2 = 1e-5;
// Norms / softmax: one sequential fp32 reduction over <= 1000 terms (~sqrt(n) 2^-24 ~ 2e-6 typical)
// plus a few ulps per element.
constexpr double kNormRelL2 = 1e-5;
// Scalar activations: a handful of fp32 libm calls, each within ~1 ulp (6e-8 relative).
constexpr double kScalarRel = 1e-6;

bool near_rel(double got, double want, double rel, double abs_floor = 1e-30) {
  return std::fabs(got - want) <= rel * std::fabs(want) + abs_floor;
}

// A weight in one storage format, with the exact values a float64 loop should use, decoded
// here independently of WeightMatrix::at / row_to_float.
struct TestWeight {
  std::vector<uint8_t> data, scales;
  std::vector<double> exact;  // [rows][cols]
  WeightMatrix w;
};

TestWeight make_weight(Rng& rng, WeightFormat fmt, int64_t rows, int64_t cols) {
  TestWeight t;
  const std::vector<float> src = test::random_normal(rng, rows * cols, 0.05f);
  t.exact.resize(rows * cols);
  switch (fmt) {
    case WeightFormat::F32:
      t.data.resize(4 * src.size());
      std::memcpy(t.data.data(), src.data(), t.data.size());
      for (size_t i = 0; i < src.size(); ++i) t.exact[i] = src[i];
      break;
    case WeightFormat::BF16:
    case WeightFormat::F16:
      t.data.resize(2 * src.size());
      for (size_t i = 0; i < src.size(); ++i) {
        const uint16_t h = fmt == WeightFormat::BF16 ? float_to_bf16(src[i]) : float_to_f16(src[i]);
        std::memcpy(&t.data[2 * i], &h, 2);
        t.exact[i] = fmt == WeightFormat::BF16 ? bf16_to_float(h) : f16_to_float(h);
      }
      break;
    case WeightFormat::MXFP4:
      t.data.resize(rows * cols / 2);
      t.scales.resize(rows * cols / 32);
      quantize_mxfp4(src.data(), rows, cols, t.data.data(), t.scales.data());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const uint8_t byte = t.data[(r * cols + c) / 2];
          const uint8_t nib = (c % 2 == 0) ? (byte & 0x0f) : (byte >> 4);
          t.exact[r * cols + c] = static_cast<double>(e2m1_to_float(nib)) *
                                  e8m0_to_float(t.scales[r * (cols / 32) + c / 32]);
        }
      break;
  }
  t.w.name = "test";
  t.w.format = fmt;
  t.w.rows = rows;
  t.w.cols = cols;
  t.w.data = t.data.data();
  t.w.scales = t.scales.empty() ? nullptr : t.scales.data();
  return t;
}

std::vector<double> linear_f64(const TestWeight& t, const std::vector<float>& x) {
  std::vector<double> y(t.w.rows, 0.0);
  for (int64_t r = 0; r < t.w.rows; ++r)
    for (int64_t c = 0; c < t.w.cols; ++c) y[r] += t.exact[r * t.w.cols + c] * x[c];
  return y;
}

TEST(OpsBasic, LinearMatchesFloat64EveryFormat) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (WeightFormat fmt :
       {WeightFormat::F32, WeightFormat::BF16, WeightFormat::F16, WeightFormat::MXFP4}) {
    SCOPED_TRACE(std::string(weight_format_name(fmt)));
    const int64_t rows = 37, cols = 320;
    const TestWeight t = make_weight(rng, fmt, rows, cols);
    const std::vector<float> x = test::random_normal(rng, cols);
    std::vector<float> y(rows);
    cpu::linear(t.w, x.data(), y.data());
    const std::vector<double> ref = linear_f64(t, x);
    EXPECT_LT(rel_l2(y, ref), kLinearRelL2);

    // A row range equals the same rows of the full product.
    std::vector<float> part(10);
    cpu::linear_rows(t.w, 20, 10, x.data(), part.data());
    const std::vector<double> ref_part(ref.begin() + 20, ref.begin() + 30);
    EXPECT_LT(rel_l2(part, ref_part), kLinearRelL2);
  }
}

TEST(OpsBasic, LinearChecksSizes) {
  Rng rng(7);
  TestWeight t = make_weight(rng, WeightFormat::BF16, 8, 64);
  std::vector<float> x(64, 1.0f), y(8);
  EXPECT_THROW(cpu::linear_rows(t.w, 4, 5, x.data(), y.data()), Error);
  EXPECT_THROW(cpu::linear_rows(t.w, -1, 2, x.data(), y.data()), Error);
  WeightMatrix empty;
  EXPECT_THROW(cpu::linear(empty, x.data(), y.data()), Error);
  TestWeight m = make_weight(rng, WeightFormat::MXFP4, 8, 64);
  m.w.scales = nullptr;
  EXPECT_THROW(cpu::linear(m.w, x.data(), y.data()), Error);
}

TEST(OpsBasic, RmsNormMatchesFloat64) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t n = 1000;
  const float eps = 1e-5f;
  const std::vector<float> x = test::random_normal(rng, n, 3.0f);
  const std::vector<float> w = test::random_normal(rng, n);
  for (bool with_w : {true, false}) {
    double ss = 0;
    for (float v : x) ss += static_cast<double>(v) * v;
    const double inv = 1.0 / std::sqrt(ss / n + eps);
    std::vector<double> ref(n);
    for (int64_t i = 0; i < n; ++i) ref[i] = x[i] * inv * (with_w ? w[i] : 1.0);
    std::vector<float> y(x);  // in place: y aliases x
    cpu::rms_norm(y.data(), with_w ? w.data() : nullptr, n, eps, y.data());
    EXPECT_LT(rel_l2(y, ref), kNormRelL2) << "with_w " << with_w;
  }
}

TEST(OpsBasic, LayerNormMatchesFloat64) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t n = 777;
  const float eps = 1e-5f;
  std::vector<float> x = test::random_normal(rng, n, 2.0f);
  for (float& v : x) v += 5.0f;  // a non-zero mean, so centring matters
  const std::vector<float> w = test::random_normal(rng, n), b = test::random_normal(rng, n);
  for (int variant = 0; variant < 3; ++variant) {
    const float* wp = variant == 0 ? w.data() : nullptr;
    const float* bp = variant != 2 ? b.data() : nullptr;
    double mean = 0, var = 0;
    for (float v : x) mean += v;
    mean /= n;
    for (float v : x) var += (v - mean) * (v - mean);
    var /= n;  // biased
    std::vector<double> ref(n);
    for (int64_t i = 0; i < n; ++i)
      ref[i] = (x[i] - mean) / std::sqrt(var + eps) * (wp ? wp[i] : 1.0) + (bp ? bp[i] : 0.0);
    std::vector<float> y(n);
    cpu::layer_norm(x.data(), wp, bp, n, eps, y.data());
    EXPECT_LT(rel_l2(y, ref), kNormRelL2) << "variant " << variant;
  }
}

TEST(OpsBasic, L2NormalizeMatchesFloat64) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t n = 128;
  const float eps = 1e-6f;
  std::vector<float> x = test::random_normal(rng, n, 0.3f);
  double ss = 0;
  for (float v : x) ss += static_cast<double>(v) * v;
  std::vector<double> ref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = x[i] / std::sqrt(ss + eps);
  cpu::l2_normalize(x.data(), n, eps);
  EXPECT_LT(rel_l2(x, ref), kNormRelL2);
}

TEST(OpsBasic, SoftmaxMatchesFloat64AndIsStable) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (float offset : {0.0f, 1000.0f, -1000.0f}) {
    const int64_t n = 50;
    std::vector<float> x = test::random_normal(rng, n, 4.0f);
    for (float& v : x) v += offset;  // naive exp would overflow / underflow to 0/0
    double m = -1e300, sum = 0;
    for (float v : x) m = std::fmax(m, v);
    std::vector<double> ref(n);
    for (int64_t i = 0; i < n; ++i) sum += (ref[i] = std::exp(static_cast<double>(x[i]) - m));
    for (double& r : ref) r /= sum;
    cpu::softmax(x.data(), n);
    EXPECT_LT(rel_l2(x, ref), kNormRelL2) << "offset " << offset;
  }
}

TEST(OpsBasic, ScalarActivationsMatchFloat64) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int i = 0; i < 2000; ++i) {
    const float x = rng.normal() * 8.0f;
    const double xd = x;
    const double sig = 1.0 / (1.0 + std::exp(-xd));
    EXPECT_TRUE(near_rel(cpu::sigmoid(x), sig, kScalarRel)) << x;
    EXPECT_TRUE(near_rel(cpu::silu(x), xd * sig, kScalarRel)) << x;
    EXPECT_TRUE(near_rel(cpu::softplus(x), std::log1p(std::exp(xd)), kScalarRel)) << x;
  }
  // Extremes stay finite and in range (a naive e^x / (1 + e^x) gives inf / inf = NaN).
  for (float x : {-1e4f, -200.0f, -90.0f, 90.0f, 200.0f, 1e4f}) {
    const float s = cpu::sigmoid(x);
    EXPECT_TRUE(std::isfinite(s) && s >= 0.0f && s <= 1.0f) << x;
    EXPECT_TRUE(std::isfinite(cpu::silu(x))) << x;
    EXPECT_TRUE(std::isfinite(cpu::softplus(x))) << x;
  }
  EXPECT_EQ(cpu::sigmoid(1e4f), 1.0f);
  EXPECT_EQ(cpu::sigmoid(-1e4f), 0.0f);
  EXPECT_EQ(cpu::silu(-1e4f), 0.0f);
}

TEST(OpsBasic, SoftplusThreshold) {
  // Above 20 PyTorch returns x itself; just below it is log1p(exp(x)).
  for (float x : {20.0001f, 20.5f, 37.0f, 1e6f}) EXPECT_EQ(cpu::softplus(x), x);
  for (float x : {19.5f, 20.0f, 5.0f, 0.0f, -10.0f})
    EXPECT_TRUE(
        near_rel(cpu::softplus(x), std::log1p(std::exp(static_cast<double>(x))), kScalarRel))
        << x;
}

double situ_f64(double g, double u, double beta, std::optional<double> lb) {
  const double gate = beta * std::tanh(g / beta) / (1.0 + std::exp(-g));
  return gate * (lb ? *lb * std::tanh(u / *lb) : u);
}

TEST(OpsBasic, GluActivationMatchesFloat64) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  cpu::GluActivation silu_act;  // default SiLU
  cpu::GluActivation situ{cpu::GluActivation::Kind::SiTU, 4.0f, 25.0f};
  cpu::GluActivation situ_nolin{cpu::GluActivation::Kind::SiTU, 4.0f, std::nullopt};
  for (int i = 0; i < 2000; ++i) {
    const float g = rng.normal() * 6.0f, u = rng.normal() * 30.0f;
    const double gd = g, ud = u;
    EXPECT_TRUE(near_rel(silu_act(g, u), gd / (1.0 + std::exp(-gd)) * ud, kScalarRel));
    EXPECT_TRUE(near_rel(situ(g, u), situ_f64(gd, ud, 4.0, 25.0), kScalarRel)) << g << " " << u;
    EXPECT_TRUE(near_rel(situ_nolin(g, u), situ_f64(gd, ud, 4.0, std::nullopt), kScalarRel));
  }
}

TEST(OpsBasic, SituSpotValues) {
  const cpu::GluActivation situ{cpu::GluActivation::Kind::SiTU, 4.0f, 25.0f};
  const cpu::GluActivation situ_nolin{cpu::GluActivation::Kind::SiTU, 4.0f, std::nullopt};
  // g = 0 kills the product whatever u is.
  EXPECT_EQ(situ(0.0f, 7.0f), 0.0f);
  EXPECT_EQ(situ_nolin(0.0f, -3.0f), 0.0f);
  // Large g: the gate saturates at beta, so SiTU -> beta * beta_l * tanh(u / beta_l).
  for (float u : {-100.0f, -1.0f, 0.5f, 10.0f, 1e4f}) {
    const double want = 4.0 * 25.0 * std::tanh(u / 25.0);
    EXPECT_TRUE(near_rel(situ(60.0f, u), want, kScalarRel)) << u;
    EXPECT_TRUE(near_rel(situ_nolin(60.0f, u), 4.0 * u, kScalarRel)) << u;
  }
  // The up branch is soft-clamped at +-25 (times the saturated gate 4).
  EXPECT_NEAR(situ(60.0f, 1e6f), 100.0f, 1e-4f);
  // Large negative g: sigmoid -> 0 dominates the tanh -> -1, so the product vanishes.
  EXPECT_NEAR(situ(-60.0f, 10.0f), 0.0f, 1e-20f);
  // Moderate g behaves like a capped SiLU: below beta * sigmoid(g) and below silu(g).
  EXPECT_LT(situ_nolin(3.0f, 1.0f), cpu::silu(3.0f));
}

}  // namespace
}  // namespace k3
