// MoE router (noaux_tc) and gated MLP against float64 references written from the spec.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "cpu/ops_moe.h"
#include "test_util.h"

namespace k3::cpu {
namespace {

// fp32 GEMV over 64 terms, sigmoid and a <= 8-term sum: <= 1.5e-7 relative observed.
constexpr double kWeightTol = 1e-5;
// Choice scores closer than this could be ordered differently by fp32 and float64 (fp32
// logits carry ~1e-6 error); such inputs are redrawn so the selection comparison is exact.
constexpr double kTieMargin = 1e-4;

// A weight as route() / glu_mlp() read it, with its float64 values decoded independently of
// WeightMatrix (the reference side).
struct TestWeight {
  int64_t rows, cols;
  std::vector<uint16_t> bf16;
  std::vector<uint8_t> packed, scales;  // MXFP4
  std::vector<double> ref;              // [rows][cols] float64 values
  WeightMatrix m;
};

TestWeight make_weight(Rng& rng, int64_t rows, int64_t cols, float scale, WeightFormat f) {
  TestWeight w{rows, cols, {}, {}, {}, std::vector<double>(size_t(rows * cols)), {}};
  w.m = WeightMatrix{.name = "w", .format = f, .rows = rows, .cols = cols};
  if (f == WeightFormat::BF16) {
    w.bf16 = test::random_bf16(rng, size_t(rows * cols), scale);
    for (size_t i = 0; i < w.ref.size(); ++i) w.ref[i] = bf16_to_float(w.bf16[i]);
    w.m.data = w.bf16.data();
  } else {  // MXFP4 (routed experts): quantize, then decode from the spec 4 layout by hand
    const std::vector<float> dense = test::random_normal(rng, size_t(rows * cols), scale);
    w.packed.resize(size_t(rows * cols / 2));
    w.scales.resize(size_t(rows * cols / 32));
    quantize_mxfp4(dense.data(), rows, cols, w.packed.data(), w.scales.data());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t byte = w.packed[size_t(r * cols / 2 + c / 2)];
        const uint8_t nib = c % 2 == 0 ? (byte & 0x0f) : (byte >> 4);  // element 2k: low nibble
        w.ref[size_t(r * cols + c)] =
            e2m1_to_float(nib) * double(e8m0_to_float(w.scales[size_t(r * cols / 32 + c / 32)]));
      }
    w.m.data = w.packed.data();
    w.m.scales = w.scales.data();
  }
  return w;
}

std::vector<double> matvec(const TestWeight& w, const std::vector<double>& x) {
  std::vector<double> y(size_t(w.rows), 0.0);
  for (int64_t r = 0; r < w.rows; ++r)
    for (int64_t c = 0; c < w.cols; ++c)
      y[size_t(r)] += w.ref[size_t(r * w.cols + c)] * x[size_t(c)];
  return y;
}

constexpr int64_t kHidden = 64;

// A router gate [E, kHidden] in BF16 whose logits gate . x are ~N(0, 1) for x ~ N(0, 1).
TestWeight router_gate(Rng& rng, int E) {
  return make_weight(rng, E, kHidden, 1.0f / std::sqrt(float(kHidden)), WeightFormat::BF16);
}

struct RefRoute {
  std::vector<int> idx;
  std::vector<double> w;
  double margin = INFINITY;       // smallest gap between neighbouring ranks that decide the result
  std::vector<double> s, choice;  // [E] unbiased scores; s + bias before group masking
};

// Ids sorted by value descending, ties by lower id (stable sort over ascending ids).
std::vector<int> ranked(const std::vector<double>& v) {
  std::vector<int> o(v.size());
  std::iota(o.begin(), o.end(), 0);
  std::stable_sort(o.begin(), o.end(), [&](int a, int b) { return v[a] > v[b]; });
  return o;
}

// Float64 noaux_tc router, written directly from spec 3.6 / DeepSeek-V3 Gate.
RefRoute reference_route(const TestWeight& gate, const std::vector<float>& bias,
                         const std::vector<float>& x, const RouterConfig& cfg) {
  const int E = cfg.num_experts;
  std::vector<double> s = matvec(gate, std::vector<double>(x.begin(), x.end()));  // logits
  if (cfg.activation == RouterConfig::Activation::Sigmoid) {
    for (double& v : s) v = 1.0 / (1.0 + std::exp(-v));
  } else {
    const double m = *std::max_element(s.begin(), s.end());
    double z = 0;
    for (double& v : s) z += (v = std::exp(v - m));
    for (double& v : s) v /= z;
  }
  std::vector<double> choice = s;
  for (int e = 0; e < E && !bias.empty(); ++e) choice[size_t(e)] += bias[size_t(e)];
  RefRoute r{{}, {}, INFINITY, s, choice};
  if (cfg.num_expert_group > 1) {
    const int G = cfg.num_expert_group, gs = E / G;
    std::vector<double> gscore(static_cast<size_t>(G));
    for (int g = 0; g < G; ++g) {
      std::vector<double> m(choice.begin() + g * gs, choice.begin() + (g + 1) * gs);
      std::sort(m.rbegin(), m.rend());
      gscore[size_t(g)] = m[0] + m[1];
    }
    const std::vector<int> go = ranked(gscore);
    for (int i = 0; i < cfg.topk_group && i + 1 < G; ++i)
      r.margin = std::min(r.margin, gscore[size_t(go[i])] - gscore[size_t(go[i + 1])]);
    for (int i = cfg.topk_group; i < G; ++i)
      for (int e = go[size_t(i)] * gs; e < (go[size_t(i)] + 1) * gs; ++e)
        choice[size_t(e)] = -INFINITY;
  }
  const std::vector<int> o = ranked(choice);
  double sum = 0;
  for (int i = 0; i < cfg.top_k; ++i) {
    if (i + 1 < E)  // a masked (-inf) neighbour gives an infinite gap
      r.margin = std::min(r.margin, choice[size_t(o[i])] - choice[size_t(o[i + 1])]);
    r.idx.push_back(o[size_t(i)]);
    r.w.push_back(s[size_t(o[i])]);
    sum += s[size_t(o[i])];
  }
  for (double& w : r.w) w = w / (cfg.renormalize ? sum + 1e-20 : 1.0) * cfg.routed_scaling_factor;
  return r;
}

struct RouteOut {
  std::vector<int> idx;
  std::vector<float> w;
};
RouteOut run_route(const TestWeight& gate, const std::vector<float>& bias,
                   const std::vector<float>& x, const RouterConfig& cfg) {
  RouteOut o{std::vector<int>(size_t(cfg.top_k)), std::vector<float>(size_t(cfg.top_k))};
  route(gate.m, bias.empty() ? nullptr : bias.data(), x.data(), cfg, o.idx.data(), o.w.data());
  return o;
}

void expect_matches(const RouteOut& got, const RefRoute& ref) {
  EXPECT_EQ(got.idx, ref.idx);
  for (size_t i = 0; i < ref.w.size(); ++i)
    EXPECT_NEAR(got.w[i], ref.w[i], kWeightTol * std::fabs(ref.w[i])) << "rank " << i;
}

TEST(Router, MatchesFloat64Reference) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const RouterConfig sig{.num_experts = 64, .top_k = 6};
  const RouterConfig sig_raw{
      .num_experts = 64, .top_k = 6, .renormalize = false, .routed_scaling_factor = 2.5f};
  RouterConfig soft = sig;
  soft.activation = RouterConfig::Activation::Softmax;
  const RouterConfig grouped{.num_experts = 32, .top_k = 4, .num_expert_group = 4, .topk_group = 2};
  for (const RouterConfig& cfg : {sig, sig_raw, soft, grouped}) {
    for (bool with_bias : {false, true}) {
      for (int trial = 0; trial < 10; ++trial) {
        // Redraw until no decision sits within kTieMargin of a flip (fp32 vs f64 ordering).
        for (int attempt = 0;; ++attempt) {
          ASSERT_LT(attempt, 100) << "could not draw a well-separated router input";
          const TestWeight gate = router_gate(rng, cfg.num_experts);
          const std::vector<float> x = test::random_normal(rng, kHidden);
          const std::vector<float> bias =
              with_bias ? test::random_normal(rng, size_t(cfg.num_experts), 0.1f)
                        : std::vector<float>{};
          const RefRoute ref = reference_route(gate, bias, x, cfg);
          if (ref.margin < kTieMargin) continue;
          expect_matches(run_route(gate, bias, x, cfg), ref);
          break;
        }
      }
    }
  }
}

// The margin probe reports the top_k-th choice score minus the best left out (the float64
// reference's, to fp32 error), the smallest over the selections it saw, only while it lives.
TEST(Router, MarginProbeRecordsTheSelectionGap) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const RouterConfig cfg{.num_experts = 64, .top_k = 6};
  const TestWeight gate = router_gate(rng, cfg.num_experts);
  const std::vector<float> bias = test::random_normal(rng, size_t(cfg.num_experts), 0.1f);
  std::vector<double> gaps;
  RouterMarginProbe outer;
  {
    RouterMarginProbe probe;
    for (int i = 0; i < 3; ++i) {
      const std::vector<float> x = test::random_normal(rng, kHidden);
      const RefRoute ref = reference_route(gate, bias, x, cfg);
      std::vector<double> choice = ref.choice;
      std::sort(choice.rbegin(), choice.rend());
      gaps.push_back(choice[size_t(cfg.top_k - 1)] - choice[size_t(cfg.top_k)]);
      run_route(gate, bias, x, cfg);
    }
    EXPECT_EQ(probe.selections(), 3);
    EXPECT_NEAR(probe.min_margin(), *std::min_element(gaps.begin(), gaps.end()), 1e-5);
    EXPECT_GT(probe.min_margin(), 0.0f);
  }
  EXPECT_EQ(outer.selections(), 0) << "the inner probe took the selections";
  run_route(gate, bias, test::random_normal(rng, kHidden), cfg);
  EXPECT_EQ(outer.selections(), 1) << "the outer probe is active again";
  // All experts selected: no margin to record.
  run_route(gate, {}, test::random_normal(rng, kHidden),
            RouterConfig{.num_experts = 64, .top_k = 64});
  EXPECT_EQ(outer.selections(), 1);
}

TEST(Router, BiasSelectsButDoesNotWeight) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const RouterConfig cfg{.num_experts = 16, .top_k = 4};
  for (int attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 100) << "could not draw well-separated router scores";
    const TestWeight gate = router_gate(rng, 16);
    const std::vector<float> x = test::random_normal(rng, kHidden);
    const RefRoute plain =
        reference_route(gate, {}, x, RouterConfig{.num_experts = 16, .top_k = 16});
    if (plain.margin < kTieMargin) continue;
    // plain.idx ranks all experts by the unbiased sigmoid. Sigmoids lie in (0, 1), so a +-2
    // bias moves the worst expert to the top and the best one out of the top-k.
    const std::vector<int>& order = plain.idx;
    const std::vector<double>& s = plain.s;
    std::vector<float> bias(16, 0.0f);
    bias[size_t(order[15])] = 2.0f;
    bias[size_t(order[0])] = -2.0f;
    const RouteOut got = run_route(gate, bias, x, cfg);
    const std::vector<int> expect_idx{order[15], order[1], order[2], order[3]};
    EXPECT_EQ(got.idx, expect_idx);
    EXPECT_NE(got.idx, run_route(gate, {}, x, cfg).idx);
    // Weights: the unbiased sigmoids of the chosen experts, renormalised among themselves.
    double sum = 0;
    for (int e : expect_idx) sum += s[size_t(e)];
    for (int i = 0; i < 4; ++i) {
      const double w = s[size_t(expect_idx[i])] / sum;
      EXPECT_NEAR(got.w[i], w, kWeightTol * w) << "rank " << i;
    }
    break;
  }
}

TEST(Router, RenormalizeAndScalingFactor) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const TestWeight gate = router_gate(rng, 32);
  const std::vector<float> x = test::random_normal(rng, kHidden);
  RouterConfig cfg{
      .num_experts = 32, .top_k = 5, .renormalize = true, .routed_scaling_factor = 2.5f};
  const RouteOut on = run_route(gate, {}, x, cfg);
  cfg.renormalize = false;
  const RouteOut off = run_route(gate, {}, x, cfg);
  cfg.routed_scaling_factor = 1.0f;
  const RouteOut raw = run_route(gate, {}, x, cfg);
  EXPECT_EQ(on.idx, off.idx);
  const double sum_raw = std::accumulate(raw.w.begin(), raw.w.end(), 0.0);
  for (int i = 0; i < 5; ++i) {
    EXPECT_NEAR(off.w[i], 2.5 * raw.w[i], kWeightTol * off.w[i]);  // scaled, not normalised
    EXPECT_NEAR(on.w[i], 2.5 * raw.w[i] / sum_raw, kWeightTol * on.w[i]);
  }
  for (int i = 1; i < 5; ++i) EXPECT_LE(raw.w[i], raw.w[i - 1]);  // descending score order
  EXPECT_NEAR(std::accumulate(on.w.begin(), on.w.end(), 0.0), 2.5, kWeightTol * 2.5);
}

// Group-limited top-k by enumeration: try every pair of groups, keep the pair with the largest
// total group score (first pair in lexicographic order on ties), then take the top-k choice
// scores among its experts. Independent of the sort-and-mask formulation in route().
std::vector<int> brute_force_two_groups(const std::vector<double>& choice, int groups, int top_k) {
  const int gs = int(choice.size()) / groups;
  auto group_score = [&](int g) {
    std::vector<double> m(choice.begin() + g * gs, choice.begin() + (g + 1) * gs);
    std::sort(m.rbegin(), m.rend());
    return m[0] + m[1];
  };
  int best_a = -1, best_b = -1;
  double best = -INFINITY;
  for (int a = 0; a < groups; ++a)
    for (int b = a + 1; b < groups; ++b)
      if (group_score(a) + group_score(b) > best) {
        best = group_score(a) + group_score(b);
        best_a = a;
        best_b = b;
      }
  std::vector<int> cand;
  for (int e = 0; e < int(choice.size()); ++e)
    if (e / gs == best_a || e / gs == best_b) cand.push_back(e);
  std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return choice[a] > choice[b]; });
  cand.resize(static_cast<size_t>(top_k));
  return cand;
}

TEST(Router, GroupLimitedMatchesBruteForce) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const RouterConfig cfg{.num_experts = 32, .top_k = 4, .num_expert_group = 4, .topk_group = 2};
  const RouterConfig flat{.num_experts = 32, .top_k = 4};  // the same without groups
  constexpr int kGroupSize = 8;
  int checked = 0, differs_from_ungrouped = 0;
  for (int trial = 0; trial < 50; ++trial) {
    const TestWeight gate = router_gate(rng, 32);
    const std::vector<float> x = test::random_normal(rng, kHidden);
    const std::vector<float> bias = test::random_normal(rng, 32, 0.1f);
    const RefRoute ref = reference_route(gate, bias, x, cfg);
    if (ref.margin < kTieMargin) continue;  // too close to a tie for an exact comparison
    ++checked;
    const RouteOut got = run_route(gate, bias, x, cfg);
    expect_matches(got, ref);
    EXPECT_EQ(got.idx, brute_force_two_groups(ref.choice, 4, cfg.top_k));
    differs_from_ungrouped += run_route(gate, bias, x, flat).idx != got.idx;
  }
  EXPECT_GT(checked, 25);
  // Group limiting must actually matter in some draws (else this test would prove nothing).
  EXPECT_GT(differs_from_ungrouped, 0);

  // Constructed case: expert 0 has the best choice score, but its group-mates are pushed down,
  // so group 0 ranks last and expert 0 must not be selected.
  const TestWeight gate = router_gate(rng, 32);
  const std::vector<float> x = test::random_normal(rng, kHidden);
  std::vector<float> bias(32, 0.0f);
  bias[0] = 1.0f;                                                // choice(0) in (1, 2)
  for (int e = 1; e < kGroupSize; ++e) bias[size_t(e)] = -3.0f;  // group 0 score < 0
  EXPECT_EQ(run_route(gate, bias, x, flat).idx[0], 0);
  for (int e : run_route(gate, bias, x, cfg).idx) EXPECT_GE(e, kGroupSize) << "expert " << e;
}

TEST(Router, RejectsBadConfig) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const TestWeight gate = router_gate(rng, 16);
  const std::vector<float> x = test::random_normal(rng, kHidden);
  std::vector<int> idx(32);
  std::vector<float> w(32);
  // (num_experts, top_k, num_expert_group, topk_group) against a 16-row gate.
  auto call = [&](int E, int k, int G, int tg) {
    const RouterConfig c{.num_experts = E, .top_k = k, .num_expert_group = G, .topk_group = tg};
    route(gate.m, nullptr, x.data(), c, idx.data(), w.data());
  };
  EXPECT_THROW(call(16, 17, 1, 1), Error);  // top_k > num_experts
  EXPECT_THROW(call(16, 0, 1, 1), Error);
  EXPECT_THROW(call(32, 4, 1, 1), Error);  // gate has 16 rows
  EXPECT_THROW(call(16, 4, 3, 1), Error);  // 3 groups do not divide 16 experts
  EXPECT_THROW(call(16, 4, 4, 5), Error);  // topk_group > num_expert_group
  EXPECT_THROW(call(16, 6, 4, 1), Error);  // one kept group of 4 cannot supply 6 picks
  EXPECT_NO_THROW(call(16, 4, 4, 1));
}

// Spec 3.7 in float64: SiLU(g) u, or [b tanh(g/b) sigmoid(g)] [lb tanh(u/lb)] (u if no lb).
double act64(const GluActivation& a, double g, double u) {
  const double sig = 1.0 / (1.0 + std::exp(-g));
  if (a.kind == GluActivation::Kind::SiLU) return g * sig * u;
  const double lin = a.linear_beta ? *a.linear_beta * std::tanh(u / *a.linear_beta) : u;
  return a.beta * std::tanh(g / a.beta) * sig * lin;
}

constexpr int64_t kIn = 64, kFfn = 96, kOut = 48;  // MXFP4 needs cols % 32 == 0 (64, 96)
// fp32 GEMVs of <= 96 terms plus fp32 tanh/exp: <= 4e-7 relative observed (25x margin).
constexpr double kGluTol = 1e-5;

// SiLU, K3's SiTU (beta 4, linear_beta 25), and SiTU with the up branch passed through.
std::vector<GluActivation> activations() {
  GluActivation silu, situ, situ_gate_only;
  situ.kind = situ_gate_only.kind = GluActivation::Kind::SiTU;
  situ.linear_beta = 25.0f;
  return {silu, situ, situ_gate_only};
}

TEST(MoeGluMlp, MatchesFloat64ForBf16AndMxfp4) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (WeightFormat f : {WeightFormat::BF16, WeightFormat::MXFP4}) {
    for (const GluActivation& act : activations()) {
      SCOPED_TRACE(std::string(weight_format_name(f)) + " act " + std::to_string(int(act.kind)));
      // Gate pre-activations of std ~8 and up of std ~20 reach both SiTU soft caps (4, 25).
      const TestWeight gate = make_weight(rng, kFfn, kIn, 1.0f, f);
      const TestWeight up = make_weight(rng, kFfn, kIn, 2.5f, f);
      const TestWeight down = make_weight(rng, kOut, kFfn, 0.1f, f);
      const std::vector<float> x = test::random_normal(rng, kIn);
      const std::vector<double> x64(x.begin(), x.end());
      const std::vector<double> g = matvec(gate, x64), u = matvec(up, x64);
      std::vector<double> h(static_cast<size_t>(kFfn));
      for (int64_t i = 0; i < kFfn; ++i) h[size_t(i)] = act64(act, g[size_t(i)], u[size_t(i)]);
      std::vector<float> y(static_cast<size_t>(kOut));
      glu_mlp(gate.m, up.m, down.m, act, Numerics{false}, x.data(), y.data());
      EXPECT_LT(test::rel_l2(y, matvec(down, h)), kGluTol);
    }
  }
}

TEST(MoeGluMlp, RoundsActivationButNotOutput) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const GluActivation act = activations()[1];
  const TestWeight gate = make_weight(rng, kFfn, kIn, 1.0f, WeightFormat::BF16);
  const TestWeight up = make_weight(rng, kFfn, kIn, 2.5f, WeightFormat::BF16);
  const std::vector<float> x = test::random_normal(rng, kIn);
  // An identity down projection (fp32) exposes h itself in y.
  std::vector<float> eye(size_t(kFfn * kFfn), 0.0f);
  for (int64_t i = 0; i < kFfn; ++i) eye[size_t(i * kFfn + i)] = 1.0f;
  const WeightMatrix id{
      .name = "eye", .format = WeightFormat::F32, .rows = kFfn, .cols = kFfn, .data = eye.data()};
  std::vector<float> h_bf16(static_cast<size_t>(kFfn)), h_f32(static_cast<size_t>(kFfn));
  glu_mlp(gate.m, up.m, id, act, Numerics{true}, x.data(), h_bf16.data());
  glu_mlp(gate.m, up.m, id, act, Numerics{false}, x.data(), h_f32.data());
  int not_bf16 = 0;
  for (int64_t i = 0; i < kFfn; ++i) {
    // Exactly the fp32 activation rounded to bf16 (the identity GEMV adds only exact zeros).
    EXPECT_EQ(h_bf16[static_cast<size_t>(i)], round_bf16(h_f32[static_cast<size_t>(i)]));
    not_bf16 += h_f32[size_t(i)] != round_bf16(h_f32[size_t(i)]);
  }
  EXPECT_GT(not_bf16, 0);  // without rounding, h is genuinely fp32
  // The output itself is left in fp32 for the caller.
  const TestWeight down = make_weight(rng, kOut, kFfn, 0.1f, WeightFormat::BF16);
  std::vector<float> y(static_cast<size_t>(kOut));
  glu_mlp(gate.m, up.m, down.m, act, Numerics{true}, x.data(), y.data());
  int y_not_bf16 = 0;
  for (float v : y) y_not_bf16 += v != round_bf16(v);
  EXPECT_GT(y_not_bf16, 0);
  EXPECT_THROW(glu_mlp(gate.m, up.m, gate.m, act, Numerics{true}, x.data(), y.data()), Error);
}

}  // namespace
}  // namespace k3::cpu
