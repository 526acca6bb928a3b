// cuda::DeviceWeights' fused layouts on the synthesized tiny checkpoints: every fused matrix
// (KDA in_proj, expert w1|w3, shared and dense gate|up) holds its members' checkpoint bytes in
// order, the per-matrix views point into it at the stated offsets, the expert pointer tables
// agree (w13[e] == w1[e], w3[e] = w13[e] + inter rows), every stock view still holds its
// checkpoint bytes, and bytes() is what the per-matrix upload held (nothing stored twice).
// Also can_concat's rules on matrix descriptors. Everything here is exact (byte equality).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda/check.h"
#include "cuda/device_weights.h"
#include "model/loaded_model.h"
#include "synth/presets.h"
#include "synth/synthesize.h"
#include "test_util.h"

namespace k3 {
namespace {

using cuda::DevMatrix;

const LoadedModel& model(const std::string& preset) {
  static std::map<std::string, std::unique_ptr<LoadedModel>> cache;
  auto& slot = cache[preset];
  if (!slot) {
    const auto dir = test::temp_dir("gpu_weights_" + preset);
    SynthOptions so;
    so.seed = 11;
    synthesize_checkpoint(synth_preset(preset), dir.string(), so);
    slot = LoadedModel::load(dir.string());
  }
  return *slot;
}

// Bytes of one row of the data array / the MXFP4 scales array, as the checkpoint stores them.
int64_t data_row_bytes(WeightFormat f, int64_t cols) {
  switch (f) {
    case WeightFormat::F32:
      return cols * 4;
    case WeightFormat::BF16:
    case WeightFormat::F16:
      return cols * 2;
    case WeightFormat::MXFP4:
      return cols / 2;
  }
  return 0;
}
int64_t scale_row_bytes(WeightFormat f, int64_t cols) {
  return f == WeightFormat::MXFP4 ? cols / 32 : 0;
}

std::vector<uint8_t> download(const void* p, int64_t n) {
  std::vector<uint8_t> h(static_cast<size_t>(n));
  if (n > 0) K3_CUDA_CHECK(cudaMemcpy(h.data(), p, h.size(), cudaMemcpyDeviceToHost));
  return h;
}
template <typename P>
std::vector<P> download_table(const P* table, size_t n) {  // [n] device pointers
  std::vector<P> h(n);
  K3_CUDA_CHECK(cudaMemcpy(h.data(), table, n * sizeof(P), cudaMemcpyDeviceToHost));
  return h;
}
void append(std::vector<uint8_t>& v, const void* p, int64_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  v.insert(v.end(), b, b + n);
}

// A view holds exactly the checkpoint matrix (empty stays empty).
void expect_same(const DevMatrix& d, const WeightMatrix& m, const std::string& what) {
  SCOPED_TRACE(what + " (" + m.name + ")");
  ASSERT_EQ(d.empty(), m.empty());
  if (m.empty()) return;
  ASSERT_EQ(d.format, m.format);
  ASSERT_EQ(d.rows, m.rows);
  ASSERT_EQ(d.cols, m.cols);
  std::vector<uint8_t> want;
  append(want, m.data, m.rows * data_row_bytes(m.format, m.cols));
  EXPECT_EQ(download(d.data, m.rows * data_row_bytes(d.format, d.cols)), want) << "data";
  if (m.format == WeightFormat::MXFP4) {
    ASSERT_NE(d.scales, nullptr);
    std::vector<uint8_t> ws;
    append(ws, m.scales, m.rows * scale_row_bytes(m.format, m.cols));
    EXPECT_EQ(download(d.scales, m.rows * scale_row_bytes(d.format, d.cols)), ws) << "scales";
  }
}

struct Member {
  const DevMatrix* view;
  const WeightMatrix* host;
};

// `all` is the members' rows in order: each view sits at its member's row offset with its shape,
// and the device bytes of `all` (data and scales) are the members' checkpoint bytes. Returns the
// row offsets (and the total last).
std::vector<int64_t> expect_fused(const DevMatrix& all, const std::vector<Member>& ms,
                                  const std::string& what) {
  SCOPED_TRACE(what);
  std::vector<int64_t> off;
  EXPECT_FALSE(all.empty());
  if (all.empty() || ms.empty()) return off;
  const WeightFormat f = ms[0].host->format;
  const int64_t cols = ms[0].host->cols;
  EXPECT_EQ(all.format, f);
  EXPECT_EQ(all.cols, cols);
  const int64_t drb = data_row_bytes(f, cols), srb = scale_row_bytes(f, cols);
  const auto* base = static_cast<const uint8_t*>(all.data);
  std::vector<uint8_t> want, want_s;
  int64_t row = 0;
  for (size_t i = 0; i < ms.size(); ++i) {
    const DevMatrix& v = *ms[i].view;
    const WeightMatrix& m = *ms[i].host;
    SCOPED_TRACE("member " + std::to_string(i) + " " + m.name);
    off.push_back(row);
    EXPECT_EQ(v.format, f);
    EXPECT_EQ(v.rows, m.rows);
    EXPECT_EQ(v.cols, cols);
    EXPECT_EQ(static_cast<const uint8_t*>(v.data), base + row * drb) << "view offset";
    if (f == WeightFormat::MXFP4) EXPECT_EQ(v.scales, all.scales + row * srb) << "scale offset";
    // the kernels' alignment: 16 bytes (bf16, packed), 8 bytes (scales)
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % 16, 0u);
    if (f == WeightFormat::MXFP4) EXPECT_EQ(reinterpret_cast<uintptr_t>(v.scales) % 8, 0u);
    append(want, m.data, m.rows * drb);
    if (f == WeightFormat::MXFP4) append(want_s, m.scales, m.rows * srb);
    row += m.rows;
  }
  off.push_back(row);
  EXPECT_EQ(all.rows, row);
  EXPECT_EQ(download(all.data, row * drb), want) << "combined data";
  if (f == WeightFormat::MXFP4) {
    EXPECT_EQ(download(all.scales, row * srb), want_s) << "combined scales";
  } else {
    EXPECT_EQ(all.scales, nullptr);
  }
  return off;
}

// bytes() as the per-matrix upload counted it: every matrix in its storage format (the tied
// lm_head uploaded again), fp32 vectors, the [3][P][kernel] fp32 conv, 6 expert pointer tables.
uint64_t expected_bytes(const ModelWeights& w) {
  uint64_t n = 0;
  const auto mat = [&](const WeightMatrix& m) { n += m.storage_bytes(); };
  const auto vec = [&](const std::vector<float>& v) { n += 4 * v.size(); };
  mat(w.embed);
  mat(w.lm_head);
  vec(w.final_norm);
  vec(w.output_attn_res);
  for (const LayerWeights& L : w.layers) {
    vec(L.input_norm);
    vec(L.post_attn_norm);
    vec(L.attn_res_attn);
    vec(L.attn_res_mlp);
    if (L.kind == LayerKind::KDA) {
      const KdaWeights& k = L.kda;
      for (const WeightMatrix* m : {&k.q_proj, &k.k_proj, &k.v_proj, &k.f_a, &k.f_b, &k.b_proj,
                                    &k.g_proj, &k.g_a, &k.g_b, &k.o_proj})
        mat(*m);
      for (const WeightMatrix* c : {&k.q_conv, &k.k_conv, &k.v_conv})
        n += 4 * static_cast<uint64_t>(c->rows * c->cols);
      vec(k.dt_bias);
      vec(k.a_log);
      vec(k.o_norm);
    } else {
      const MlaWeights& m = L.mla;
      for (const WeightMatrix* x :
           {&m.q_a, &m.q_b, &m.q_proj, &m.kv_a, &m.kv_b, &m.g_proj, &m.o_proj})
        mat(*x);
      vec(m.q_a_norm);
      vec(m.kv_a_norm);
      if (m.indexer) {
        mat(m.indexer->wq_b);
        mat(m.indexer->wk);
        mat(m.indexer->weights_proj);
        vec(m.indexer->k_norm_w);
        vec(m.indexer->k_norm_b);
      }
    }
    if (L.moe) {
      const MoeWeights& m = L.moe_w;
      for (const WeightMatrix* x :
           {&m.gate, &m.latent_down, &m.latent_up, &m.shared_gate, &m.shared_up, &m.shared_down})
        mat(*x);
      vec(m.score_bias);
      vec(m.latent_norm);
      for (const ExpertWeights& e : m.experts) {
        mat(e.w1);
        mat(e.w3);
        mat(e.w2);
      }
      n += 6 * m.experts.size() * sizeof(void*);
    } else if (!L.dense.gate.empty()) {
      mat(L.dense.gate);
      mat(L.dense.up);
      mat(L.dense.down);
    }
  }
  return n;
}

void check_kda(const cuda::DevKda& d, const KdaWeights& k, int64_t H, const std::string& what) {
  SCOPED_TRACE(what);
  expect_same(d.q_proj, k.q_proj, "q_proj");
  expect_same(d.k_proj, k.k_proj, "k_proj");
  expect_same(d.v_proj, k.v_proj, "v_proj");
  expect_same(d.f_a, k.f_a, "f_a");
  expect_same(d.f_b, k.f_b, "f_b");
  expect_same(d.b_proj, k.b_proj, "b_proj");
  expect_same(d.g_proj, k.g_proj, "g_proj");
  expect_same(d.g_a, k.g_a, "g_a");
  expect_same(d.g_b, k.g_b, "g_b");
  expect_same(d.o_proj, k.o_proj, "o_proj");
  // The tiny presets' projections are bf16 with H = 128 (256-byte rows): always fusable.
  ASSERT_FALSE(d.in_proj.empty()) << "in_proj not fused";
  EXPECT_EQ(d.in_proj.cols, H);
  const bool lora = k.g_proj.empty();
  const cuda::DevMatrix& gv = lora ? d.g_a : d.g_proj;
  const WeightMatrix& gh = lora ? k.g_a : k.g_proj;
  const std::vector<int64_t> off = expect_fused(d.in_proj,
                                                {{&d.q_proj, &k.q_proj},
                                                 {&d.k_proj, &k.k_proj},
                                                 {&d.v_proj, &k.v_proj},
                                                 {&gv, &gh},
                                                 {&d.f_a, &k.f_a},
                                                 {&d.b_proj, &k.b_proj}},
                                                "in_proj");
  ASSERT_EQ(off.size(), 7u);
  const cuda::KdaInProjLayout& o = d.in_layout;
  EXPECT_EQ(o.q, off[0]);
  EXPECT_EQ(o.k, off[1]);
  EXPECT_EQ(o.v, off[2]);
  EXPECT_EQ(o.g, off[3]);
  EXPECT_EQ(o.fa, off[4]);
  EXPECT_EQ(o.b, off[5]);
  EXPECT_EQ(o.n, off[6]);
  EXPECT_EQ(o.n, d.in_proj.rows);
  EXPECT_EQ(o.ld % 8, 0) << "16-byte rows of the projected activations";
  EXPECT_TRUE(o.ld >= o.n && o.ld < o.n + 8) << "ld " << o.ld << " for " << o.n << " rows";
  // q, k, v adjacent and P rows each: the [3][P] u the decode kernel reads.
  EXPECT_EQ(o.k - o.q, k.q_proj.rows);
  EXPECT_EQ(o.v - o.k, k.q_proj.rows);
}

void check_moe(const cuda::DevMoe& d, const MoeWeights& m, const std::string& what) {
  SCOPED_TRACE(what);
  expect_same(d.gate, m.gate, "router");
  expect_same(d.latent_down, m.latent_down, "latent_down");
  expect_same(d.latent_up, m.latent_up, "latent_up");
  expect_same(d.shared_gate, m.shared_gate, "shared_gate");
  expect_same(d.shared_up, m.shared_up, "shared_up");
  expect_same(d.shared_down, m.shared_down, "shared_down");
  if (!m.shared_gate.empty())
    expect_fused(d.shared_gate_up, {{&d.shared_gate, &m.shared_gate}, {&d.shared_up, &m.shared_up}},
                 "shared_gate_up");
  else
    EXPECT_TRUE(d.shared_gate_up.empty());

  const size_t E = m.experts.size();
  const WeightFormat f = d.expert_format;
  const bool mx = f == WeightFormat::MXFP4;
  const auto w1 = download_table(d.w1, E), w3 = download_table(d.w3, E),
             w2 = download_table(d.w2, E);
  const auto s1 = download_table(d.w1_scales, E), s3 = download_table(d.w3_scales, E),
             s2 = download_table(d.w2_scales, E);
  // The tiny experts' rows are 32 (MXFP4 io 64) or 256 (bf16 io 128) bytes, scales 2 bytes with
  // inter = 64 rows: the w3 half starts aligned, so every layer fuses.
  ASSERT_NE(d.w13, nullptr) << "w13 not fused";
  const auto w13 = download_table(d.w13, E);
  std::vector<const uint8_t*> s13;
  if (mx) {
    ASSERT_NE(d.w13_scales, nullptr);
    s13 = download_table(d.w13_scales, E);
  } else {
    EXPECT_EQ(d.w13_scales, nullptr) << "bf16 experts have no scales";
  }
  const int64_t drb = data_row_bytes(f, d.io), srb = scale_row_bytes(f, d.io);
  for (size_t e = 0; e < E; ++e) {
    const ExpertWeights& x = m.experts[e];
    SCOPED_TRACE("expert " + std::to_string(e));
    ASSERT_EQ(x.w1.rows, d.inter);
    ASSERT_EQ(x.w3.rows, d.inter);
    ASSERT_EQ(x.w1.cols, d.io);
    // Per-matrix tables: each expert matrix holds its checkpoint bytes.
    DevMatrix v1{f, d.inter, d.io, w1[e], mx ? s1[e] : nullptr};
    DevMatrix v3{f, d.inter, d.io, w3[e], mx ? s3[e] : nullptr};
    DevMatrix v2{f, x.w2.rows, x.w2.cols, w2[e], mx ? s2[e] : nullptr};
    expect_same(v1, x.w1, "w1");
    expect_same(v3, x.w3, "w3");
    expect_same(v2, x.w2, "w2");
    // The fused pair: w1 rows then w3 rows, one allocation.
    EXPECT_EQ(w13[e], w1[e]);
    EXPECT_EQ(static_cast<const uint8_t*>(w3[e]),
              static_cast<const uint8_t*>(w13[e]) + d.inter * drb);
    std::vector<uint8_t> want;
    append(want, x.w1.data, d.inter * drb);
    append(want, x.w3.data, d.inter * drb);
    EXPECT_EQ(download(w13[e], 2 * d.inter * drb), want) << "w13 data";
    if (mx) {
      EXPECT_EQ(s13[e], s1[e]);
      EXPECT_EQ(s3[e], s13[e] + d.inter * srb);
      std::vector<uint8_t> ws;
      append(ws, x.w1.scales, d.inter * srb);
      append(ws, x.w3.scales, d.inter * srb);
      EXPECT_EQ(download(s13[e], 2 * d.inter * srb), ws) << "w13 scales";
    }
  }
}

void check_preset(const std::string& preset) {
  SCOPED_TRACE(preset);
  const LoadedModel& lm = model(preset);
  const ModelConfig& cfg = lm.config;
  const ModelWeights& w = lm.weights;
  const cuda::DeviceWeights dw(cfg, w);
  EXPECT_EQ(dw.bytes(), expected_bytes(w)) << "bytes() changed: something is stored twice";
  expect_same(dw.embed, w.embed, "embed");
  expect_same(dw.lm_head, w.lm_head, "lm_head");
  ASSERT_EQ(dw.layers.size(), w.layers.size());
  int kda = 0, moe = 0, dense = 0;
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const cuda::DevLayer& D = dw.layers[l];
    const std::string at = "layer " + std::to_string(l);
    if (L.kind == LayerKind::KDA) {
      check_kda(D.kda, L.kda, cfg.hidden_size, at);
      ++kda;
    } else {
      EXPECT_TRUE(D.kda.in_proj.empty());
    }
    if (L.moe) {
      check_moe(D.moe_w, L.moe_w, at);
      ++moe;
    } else if (!L.dense.gate.empty()) {
      SCOPED_TRACE(at);
      expect_same(D.dense.gate, L.dense.gate, "dense gate");
      expect_same(D.dense.up, L.dense.up, "dense up");
      expect_same(D.dense.down, L.dense.down, "dense down");
      // bf16 with H = 128: always fusable.
      expect_fused(D.dense.gate_up, {{&D.dense.gate, &L.dense.gate}, {&D.dense.up, &L.dense.up}},
                   "dense gate_up");
      ++dense;
    }
  }
  // The presets exercise every fusion kind.
  EXPECT_GT(kda, 0);
  EXPECT_GT(moe, 0);
  EXPECT_GT(dense, 0);
}

TEST(CudaWeights, FusedLayoutsTiny) {
  check_preset("tiny");
}
TEST(CudaWeights, FusedLayoutsTinyK31) {
  check_preset("tiny-k3.1");
}
TEST(CudaWeights, FusedLayoutsTinyKimiLinear) {
  check_preset("tiny-kimi-linear");
}

// can_concat on descriptors (the data pointers are never read).
WeightMatrix desc(WeightFormat f, int64_t rows, int64_t cols) {
  static const uint8_t dummy = 0;
  WeightMatrix m;
  m.name = "m";
  m.format = f;
  m.rows = rows;
  m.cols = cols;
  m.data = &dummy;
  m.scales = f == WeightFormat::MXFP4 ? &dummy : nullptr;
  return m;
}

TEST(CudaWeights, CanConcatRules) {
  using F = WeightFormat;
  const WeightMatrix a = desc(F::BF16, 3, 128), b = desc(F::BF16, 5, 128);
  EXPECT_TRUE(cuda::can_concat({&a, &b}));
  EXPECT_TRUE(cuda::can_concat({&a}));
  EXPECT_FALSE(cuda::can_concat({}));
  const WeightMatrix c = desc(F::BF16, 3, 64);
  EXPECT_FALSE(cuda::can_concat({&a, &c})) << "column counts differ";
  const WeightMatrix mx = desc(F::MXFP4, 4, 128);
  EXPECT_FALSE(cuda::can_concat({&a, &mx})) << "formats differ";
  WeightMatrix empty = desc(F::BF16, 0, 128);
  empty.data = nullptr;
  EXPECT_FALSE(cuda::can_concat({&a, &empty})) << "empty member";
  const WeightMatrix f32a = desc(F::F32, 2, 128), f32b = desc(F::F32, 2, 128);
  EXPECT_FALSE(cuda::can_concat({&f32a, &f32b})) << "fp32 is never fused";
  // bf16, 8-byte rows: the second view starts at 8 * rows bytes.
  const WeightMatrix n1 = desc(F::BF16, 1, 4), n2 = desc(F::BF16, 2, 4), n3 = desc(F::BF16, 1, 4);
  EXPECT_FALSE(cuda::can_concat({&n1, &n3})) << "second view at byte 8";
  EXPECT_TRUE(cuda::can_concat({&n2, &n1}));
  EXPECT_FALSE(cuda::can_concat({&n2, &n1, &n3})) << "third view at byte 24";
  // MXFP4 io 64: packed rows 32 bytes (always 16-aligned), scale rows 2 bytes (need 4 | rows).
  const WeightMatrix m3 = desc(F::MXFP4, 3, 64), m4 = desc(F::MXFP4, 4, 64);
  EXPECT_FALSE(cuda::can_concat({&m3, &m4})) << "scales view at byte 6";
  EXPECT_TRUE(cuda::can_concat({&m4, &m3}));
  // MXFP4 io 32: packed rows 16 bytes, scale rows 1 byte (need 8 | rows).
  const WeightMatrix k8 = desc(F::MXFP4, 8, 32), k4 = desc(F::MXFP4, 4, 32);
  EXPECT_TRUE(cuda::can_concat({&k8, &k4}));
  EXPECT_FALSE(cuda::can_concat({&k4, &k8})) << "scales view at byte 4";
}

}  // namespace
}  // namespace k3
