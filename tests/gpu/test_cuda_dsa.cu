// DSA lightning indexer on the GPU (cuda/dsa_indexer.h) against the CPU ops of cpu/ops_dsa.h,
// prepared as dsa_select (cpu/layer_mla.cpp) prepares them, on fresh random inputs (the seed is
// printed; K3_TEST_SEED replays). Outputs are poisoned (NaN / 0xab / -7) before each launch.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "cpu/decode_state.h"
#include "cpu/ops_basic.h"
#include "cpu/ops_dsa.h"
#include "cuda/device_buffer.h"
#include "cuda/dsa_indexer.h"
#include "test_util.h"

namespace k3 {
namespace {

using cuda::DeviceBuffer;

// ---- Tolerances ----
// Key bytes and scales: exact. The kernel runs the CPU's fp32 ops in the CPU's order (sequential
// norm sums, the same butterflies, IEEE division) without FMA contraction, and the host build
// has no FMA either, so no rounding can flip.
// Scores: the dot products sum in another order (lanes, then a butterfly) and may contract to
// FMA: per score |gpu - cpu| <= kScoreRel * sum_h |w_h| sum_j |q_hj k_j| (both sides' fp32
// error is at most ~(hd + nh) * 2^-24 of that magnitude; 272 * 6e-8 = 1.6e-5 for hd 256).
constexpr double kScoreRel = 4e-5;
// End-to-end selection (GPU scores -> GPU top-k vs CPU scores -> CPU top-k) is compared for a
// row when the CPU's k-th and (k+1)-th scores are more than twice the row's largest observed
// |gpu - cpu| apart (then no perturbation of that size can change the set); a case where no
// row qualifies is redrawn (at most kMaxRedraws times).
constexpr int kMaxRedraws = 8;

constexpr uint8_t kPoison = 0xab;
constexpr float kEps = 1e-5f;

struct Shape {
  int nh, hd, page;
};

// The page pool: rows x max_pages distinct pages from a shuffled pool with spare pages.
std::vector<int32_t> make_table(Rng& rng, int rows, int max_pages, int pool) {
  std::vector<int32_t> perm(static_cast<size_t>(pool));
  std::iota(perm.begin(), perm.end(), 0);
  for (int i = pool - 1; i > 0; --i)
    std::swap(perm[static_cast<size_t>(i)], perm[rng.next_u64() % static_cast<uint64_t>(i + 1)]);
  perm.resize(static_cast<size_t>(rows) * max_pages);
  return perm;
}

int blocks_of(int hd) {
  return static_cast<int>(cpu::index_scale_blocks(hd));
}
int block_of(int hd) {
  return (hd + blocks_of(hd) - 1) / blocks_of(hd);
}

// The CPU's cached key for a wk output row (bf16 bits): norm, Hadamard, fp8 blocks.
void cpu_key(const uint16_t* key, int hd, const std::vector<float>& w, const std::vector<float>* b,
             uint8_t* q, float* scales) {
  std::vector<float> x(static_cast<size_t>(hd));
  for (int i = 0; i < hd; ++i) x[i] = bf16_to_float(key[i]);
  if (b)
    cpu::layer_norm(x.data(), w.data(), b->data(), hd, kEps, x.data());
  else
    cpu::rms_norm(x.data(), w.data(), hd, kEps, x.data());
  cpu::hadamard_transform(x.data(), hd);
  cpu::quantize_fp8_blocks(x.data(), hd, block_of(hd), q, scales);
}

// ============================== key append ==============================

TEST(CudaDsa, KeyAppendEqualsCpuQuantizedKeys) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (const Shape sh : {Shape{4, 32, 16}, Shape{32, 128, 64}, Shape{8, 256, 64}}) {
    for (const bool ln : {true, false}) {
      SCOPED_TRACE("hd " + std::to_string(sh.hd) + (ln ? " layernorm" : " rmsnorm"));
      const int rows = 6, max_pages = 2, pool = rows * max_pages + 2, hd = sh.hd;
      const int nb = blocks_of(hd);
      // wk outputs with an offset (LayerNorm removes it) and varied scales.
      std::vector<uint16_t> key(static_cast<size_t>(rows) * hd);
      for (int r = 0; r < rows; ++r) {
        const float s = r == 1 ? 30.0f : r == 2 ? 0.01f : 1.0f;
        for (int i = 0; i < hd; ++i)
          key[static_cast<size_t>(r) * hd + i] = float_to_bf16(s * (rng.normal() + 0.3f));
      }
      std::vector<float> w(static_cast<size_t>(hd)), b(static_cast<size_t>(hd));
      for (int i = 0; i < hd; ++i) {
        w[i] = 1.0f + 0.1f * rng.normal();
        b[i] = 0.1f * rng.normal();
      }
      const auto table = make_table(rng, rows, max_pages, pool);
      std::vector<int32_t> pos(rows);
      for (int r = 0; r < rows; ++r)
        pos[r] = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(max_pages * sh.page));
      pos[5] = -1;  // a padding row: skipped
      const size_t slots = static_cast<size_t>(pool) * sh.page;
      std::vector<uint8_t> kc(slots * hd, kPoison);
      std::vector<float> scs(slots * nb);
      std::memset(scs.data(), kPoison, scs.size() * 4);
      auto d_key = cuda::to_device<cuda::bf16>(key);
      auto d_w = cuda::to_device<float>(w);
      auto d_b = cuda::to_device<float>(b);
      auto d_table = cuda::to_device<int32_t>(table);
      auto d_pos = cuda::to_device<int32_t>(pos);
      auto d_kc = cuda::to_device<uint8_t>(kc);
      auto d_sc = cuda::to_device<float>(scs);
      cuda::dsa_index_key_append(d_key.data(), rows, hd, d_w.data(), ln ? d_b.data() : nullptr,
                                 kEps, d_table.data(), max_pages, d_pos.data(), sh.page,
                                 d_kc.data(), d_sc.data(), nullptr);
      K3_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got_k = cuda::to_host<uint8_t>(d_kc);
      const auto got_s = cuda::to_host<float>(d_sc);
      for (int r = 0; r < 5; ++r) {
        const size_t slot =
            static_cast<size_t>(table[static_cast<size_t>(r) * max_pages + pos[r] / sh.page]) *
                sh.page +
            pos[r] % sh.page;
        cpu_key(&key[static_cast<size_t>(r) * hd], hd, w, ln ? &b : nullptr, &kc[slot * hd],
                &scs[slot * nb]);
      }
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < kc.size(); ++i)
        if (got_k[i] != kc[i] && bad++ == 0) first = i;
      EXPECT_EQ(bad, 0u) << "key bytes: first difference at " << first << " got "
                         << int(got_k[first]) << " want " << int(kc[first]);
      EXPECT_EQ(std::memcmp(got_s.data(), scs.data(), scs.size() * 4), 0) << "key scales differ";
    }
  }
}

// ============================== scores (+ top-k end to end) ==============================

struct ScoreCase {
  Shape sh;
  int rows = 0, max_pages = 0, pool = 0;
  std::vector<int32_t> seq, table;
  std::vector<uint8_t> kc;      // [pool][page][hd] E4M3
  std::vector<float> scs;       // [pool][page][nb]
  std::vector<uint16_t> q, hw;  // [rows][nh][hd], [rows][nh] bf16 bits
};

ScoreCase make_score_case(Rng& rng, Shape sh, std::vector<int32_t> seq) {
  ScoreCase c;
  c.sh = sh;
  c.rows = static_cast<int>(seq.size());
  for (int s : seq) c.max_pages = std::max(c.max_pages, (s + sh.page - 1) / sh.page);
  c.max_pages = std::max(c.max_pages, 1);
  c.pool = c.rows * c.max_pages + 1;
  c.seq = std::move(seq);
  c.table = make_table(rng, c.rows, c.max_pages, c.pool);
  const int hd = sh.hd, nb = blocks_of(hd);
  const size_t slots = static_cast<size_t>(c.pool) * sh.page;
  c.kc.resize(slots * hd);
  c.scs.resize(slots * nb);
  std::vector<float> x(static_cast<size_t>(hd));
  for (size_t s = 0; s < slots; ++s) {  // keys as the cache holds them: normed, rotated, fp8
    for (auto& v : x) v = rng.normal();
    cpu::hadamard_transform(x.data(), hd);
    cpu::quantize_fp8_blocks(x.data(), hd, block_of(hd), &c.kc[s * hd], &c.scs[s * nb]);
  }
  c.q = test::random_bf16(rng, static_cast<size_t>(c.rows) * sh.nh * hd);
  c.hw = test::random_bf16(rng, static_cast<size_t>(c.rows) * sh.nh);
  return c;
}

// CPU scores of row r (dsa_select's query preparation) and the magnitude bound per token.
void cpu_scores(const ScoreCase& c, int r, float head_scale, std::vector<float>& sc,
                std::vector<double>& mag) {
  const int nh = c.sh.nh, hd = c.sh.hd, nb = blocks_of(hd), B = block_of(hd), T = c.seq[r];
  std::vector<float> q(static_cast<size_t>(nh) * hd), w(static_cast<size_t>(nh));
  for (size_t i = 0; i < q.size(); ++i)
    q[i] = bf16_to_float(c.q[static_cast<size_t>(r) * nh * hd + i]);
  cpu::dsa_prepare_queries(q.data(), nh, hd, B);
  for (int h = 0; h < nh; ++h)
    w[h] = bf16_to_float(c.hw[static_cast<size_t>(r) * nh + h]) * head_scale;
  std::vector<float> keys(static_cast<size_t>(T) * hd);
  for (int t = 0; t < T; ++t) {
    const size_t slot =
        static_cast<size_t>(c.table[static_cast<size_t>(r) * c.max_pages + t / c.sh.page]) *
            c.sh.page +
        t % c.sh.page;
    cpu::dequantize_fp8_blocks(&c.kc[slot * hd], &c.scs[slot * nb], hd, B,
                               &keys[static_cast<size_t>(t) * hd]);
  }
  sc.assign(static_cast<size_t>(T), 0.0f);
  cpu::dsa_index_scores(q.data(), w.data(), keys.data(), T, nh, hd, sc.data());
  mag.assign(static_cast<size_t>(T), 0.0);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < nh; ++h) {
      double m = 0;
      for (int j = 0; j < hd; ++j)
        m += std::fabs(static_cast<double>(q[static_cast<size_t>(h) * hd + j]) *
                       keys[static_cast<size_t>(t) * hd + j]);
      mag[t] += std::fabs(static_cast<double>(w[h])) * m;
    }
}

struct GpuOut {
  std::vector<float> scores;  // [rows][max_tokens]
  std::vector<int32_t> sel, nsel;
};

// tensor_cores: dsa_index_scores's fp8 mma kernel where the shape allows it; split: the
// multi-CTA top-k.
GpuOut run_gpu(const ScoreCase& c, float head_scale, int64_t max_tokens, int topk,
               bool tensor_cores, bool split) {
  auto d_q = cuda::to_device<cuda::bf16>(c.q);
  auto d_hw = cuda::to_device<cuda::bf16>(c.hw);
  auto d_kc = cuda::to_device<uint8_t>(c.kc);
  auto d_sc = cuda::to_device<float>(c.scs);
  auto d_table = cuda::to_device<int32_t>(c.table);
  auto d_seq = cuda::to_device<int32_t>(c.seq);
  DeviceBuffer<float> d_scores(static_cast<size_t>(c.rows) * max_tokens);
  DeviceBuffer<int32_t> d_sel(static_cast<size_t>(c.rows) * topk), d_nsel(c.rows);
  d_scores.fill_bytes(0xff);
  d_sel.fill_bytes(0xf9);
  d_nsel.fill_bytes(0xf9);
  DeviceBuffer<uint8_t> d_ws(cuda::dsa_topk_workspace_bytes(c.rows, max_tokens, topk));
  d_ws.fill_bytes(0);
  cuda::dsa_index_scores(d_q.data(), d_hw.data(), head_scale, c.rows, c.sh.nh, c.sh.hd, d_kc.data(),
                         d_sc.data(), d_table.data(), c.max_pages, d_seq.data(), c.sh.page,
                         d_scores.data(), max_tokens, tensor_cores, nullptr);
  cuda::dsa_topk(d_scores.data(), max_tokens, d_seq.data(), c.rows, topk, d_sel.data(),
                 d_nsel.data(), d_ws.data(), split, nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  return {cuda::to_host<float>(d_scores), cuda::to_host<int32_t>(d_sel),
          cuda::to_host<int32_t>(d_nsel)};
}

// The CPU's top-k of `scores` as the GPU lays it out: m ascending indices, then -1.
std::vector<int32_t> cpu_topk_row(const float* scores, int T, int topk) {
  std::vector<int64_t> idx(static_cast<size_t>(std::min(T, topk)));
  const int64_t m = cpu::dsa_topk(scores, T, topk, idx.data());
  std::vector<int32_t> out(static_cast<size_t>(topk), -1);
  for (int64_t i = 0; i < m; ++i)
    out[static_cast<size_t>(i)] = static_cast<int32_t>(idx[static_cast<size_t>(i)]);
  return out;
}

TEST(CudaDsa, ScoresMatchCpuAndSelectionAgrees) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  struct Case {
    Shape sh;
    int topk;
    std::vector<int32_t> seq;
  };
  // 80 rows of ~2k tokens: fewer CTAs per row than chunks, so the tensor-core kernel's CTAs
  // walk several chunks each.
  std::vector<int32_t> many(80);
  for (size_t i = 0; i < many.size(); ++i) many[i] = 1000 + static_cast<int32_t>(i) * 17;
  const Case cases[] = {
      {{4, 32, 16}, 8, {0, 1, 7, 8, 9, 61}},              // tiny-k3.1: 4 heads x 32, top-8
      {{32, 128, 64}, 2048, {1, 300, 2048, 2049, 5000}},  // K3.1 shapes
      {{8, 256, 64}, 100, {257, 1000}},                   // two scale blocks per key
      {{64, 128, 16}, 512, {3, 700, 4099}},               // 64 heads (DeepSeek-V3.2's indexer)
      {{16, 128, 64}, 64, {1, 65, 1000}},                 // one m-tile of heads
      {{32, 128, 64}, 2048, many},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE("nh " + std::to_string(k.sh.nh) + " hd " + std::to_string(k.sh.hd));
    const float head_scale = 1.0f / std::sqrt(static_cast<float>(k.sh.nh * k.sh.hd));
    int compared = 0;
    for (int attempt = 0; attempt < kMaxRedraws && compared == 0; ++attempt) {
      const ScoreCase c = make_score_case(rng, k.sh, k.seq);
      const int64_t max_tokens = static_cast<int64_t>(c.max_pages) * k.sh.page + 5;
      const GpuOut outs[2] = {run_gpu(c, head_scale, max_tokens, k.topk, false, false),
                              run_gpu(c, head_scale, max_tokens, k.topk, true, true)};
      for (int r = 0; r < c.rows; ++r) {
        SCOPED_TRACE("row " + std::to_string(r) + " T " + std::to_string(c.seq[r]));
        std::vector<float> sc;
        std::vector<double> mag;
        cpu_scores(c, r, head_scale, sc, mag);
        for (int v = 0; v < 2; ++v) {
          SCOPED_TRACE(v ? "tensor-core scores, split top-k" : "CUDA-core scores, one-CTA top-k");
          const GpuOut& g = outs[v];
          const float* gs = &g.scores[static_cast<size_t>(r) * max_tokens];
          int64_t bad = 0, first = -1;
          double max_diff = 0;
          for (int t = 0; t < c.seq[r]; ++t) {
            const double lim = kScoreRel * mag[t] + 1e-30;
            const double diff = std::fabs(static_cast<double>(gs[t]) - sc[t]);
            max_diff = std::max(max_diff, diff);
            if (!(diff <= lim) && bad++ == 0) first = t;
          }
          EXPECT_EQ(bad, 0) << "scores outside tolerance; first token " << first << " got "
                            << (first >= 0 ? gs[first] : 0.f) << " cpu "
                            << (first >= 0 ? sc[first] : 0.f);
          for (int64_t t = c.seq[r]; t < max_tokens; ++t)
            ASSERT_TRUE(std::isnan(gs[t])) << "score " << t << " past seq_len was written";
          // Top-k of the GPU's own scores: exactly the CPU's set (same inputs).
          const auto want = cpu_topk_row(gs, c.seq[r], k.topk);
          const std::vector<int32_t> got(g.sel.begin() + static_cast<int64_t>(r) * k.topk,
                                         g.sel.begin() + static_cast<int64_t>(r + 1) * k.topk);
          EXPECT_EQ(got, want) << "top-k of the GPU scores";
          EXPECT_EQ(g.nsel[r], std::min(c.seq[r], k.topk));
          // End to end against the CPU's scores, when the boundary gap rules out a flip.
          const int m = std::min(c.seq[r], k.topk);
          if (m > 0 && m < c.seq[r]) {
            std::vector<float> sorted(sc);
            std::nth_element(sorted.begin(), sorted.begin() + (m - 1), sorted.end(),
                             std::greater<float>());
            const float kth = sorted[m - 1];
            const float next = *std::max_element(sorted.begin() + m, sorted.end());
            if (!(static_cast<double>(kth) - next > 2 * max_diff)) continue;
            ++compared;  // a row where the selection really ranks
          }
          EXPECT_EQ(got, cpu_topk_row(sc.data(), c.seq[r], k.topk)) << "end-to-end selection";
        }
      }
    }
    EXPECT_GT(compared, 0) << "every ranking row of every draw had a near-tie at the boundary";
  }
}

// ============================== top-k alone ==============================

TEST(CudaDsa, TopkEqualsCpuSetWithTiesAndLongContexts) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  struct Row {
    int T;
    // 0 normal, 1 few distinct values (ties), 2 signed zeros and +-1, 3 all equal, 4 distinct
    // values that share one histogram bin (every score a candidate of the split select, too many
    // to cache), 5 normal in steps of 1/64 (ties among a few hundred cached candidates)
    int kind;
  };
  const int64_t stride = 131072;
  constexpr int kMaxRows = 11;
  // One workspace for every call: each call must leave it zeroed for the next.
  DeviceBuffer<uint8_t> d_ws(cuda::dsa_topk_workspace_bytes(kMaxRows, stride, 2048));
  d_ws.fill_bytes(0);
  for (const auto& [topk, split] : {std::pair{2048, true},
                                    {8, true},
                                    {1, true},
                                    {2048, true},
                                    {2048, false},
                                    {8, false},
                                    {1, false}}) {
    SCOPED_TRACE("topk " + std::to_string(topk) + (split ? " split" : " one CTA per row"));
    const std::vector<Row> rows = {{131072, 0}, {131072, 1},   {100003, 2},
                                   {5000, 3},   {topk, 0},     {topk - 1 > 0 ? topk - 1 : 0, 1},
                                   {0, 0},      {topk + 1, 1}, {64, 2},
                                   {70001, 4},  {20000, 5}};
    const int R = static_cast<int>(rows.size());
    ASSERT_LE(R, kMaxRows);
    std::vector<float> sc(static_cast<size_t>(R) * stride, NAN);  // NaN past T: never read
    std::vector<int32_t> seq(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
      seq[r] = rows[r].T;
      for (int t = 0; t < rows[r].T; ++t) {
        float v = rng.normal();
        if (rows[r].kind == 1) v = std::round(v * 4.0f) / 4.0f;  // ~25 distinct values
        if (rows[r].kind == 2) {
          const uint64_t u = rng.next_u64() % 4;
          v = u == 0 ? 0.0f : u == 1 ? -0.0f : u == 2 ? 1.0f : -1.0f;
        }
        if (rows[r].kind == 3) v = -2.5f;
        if (rows[r].kind == 4) v = rng.uniform(1.0f, 1.2f);
        if (rows[r].kind == 5) v = std::round(v * 64.0f) / 64.0f;
        sc[static_cast<size_t>(r) * stride + t] = v;
      }
    }
    auto d_sc = cuda::to_device<float>(sc);
    auto d_seq = cuda::to_device<int32_t>(seq);
    DeviceBuffer<int32_t> d_sel(static_cast<size_t>(R) * topk), d_nsel(R);
    d_sel.fill_bytes(0xf9);
    d_nsel.fill_bytes(0xf9);
    cuda::dsa_topk(d_sc.data(), stride, d_seq.data(), R, topk, d_sel.data(), d_nsel.data(),
                   d_ws.data(), split, nullptr);
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    const auto sel = cuda::to_host<int32_t>(d_sel);
    const auto nsel = cuda::to_host<int32_t>(d_nsel);
    for (int r = 0; r < R; ++r) {
      SCOPED_TRACE("row " + std::to_string(r) + " T " + std::to_string(seq[r]) + " kind " +
                   std::to_string(rows[r].kind));
      const auto want = cpu_topk_row(&sc[static_cast<size_t>(r) * stride], seq[r], topk);
      const std::vector<int32_t> got(sel.begin() + static_cast<int64_t>(r) * topk,
                                     sel.begin() + static_cast<int64_t>(r + 1) * topk);
      EXPECT_EQ(got, want);
      EXPECT_EQ(nsel[r], std::min(seq[r], topk));
    }
  }
}

TEST(CudaDsa, RefusesUnsupportedShapes) {
  EXPECT_THROW(cuda::dsa_index_key_append(nullptr, 1, 96, nullptr, nullptr, kEps, nullptr, 1,
                                          nullptr, 16, nullptr, nullptr, nullptr),
               Error);
  EXPECT_THROW(cuda::dsa_index_scores(nullptr, nullptr, 1.0f, 1, 128, 128, nullptr, nullptr,
                                      nullptr, 1, nullptr, 16, nullptr, 16, false, nullptr),
               Error);
  EXPECT_THROW(
      cuda::dsa_topk(nullptr, 16, nullptr, 1, 0, nullptr, nullptr, nullptr, false, nullptr), Error);
  // The split top-k needs a workspace.
  EXPECT_THROW(cuda::dsa_topk(nullptr, 16, nullptr, 1, 8, nullptr, nullptr, nullptr, true, nullptr),
               Error);
}

}  // namespace
}  // namespace k3
