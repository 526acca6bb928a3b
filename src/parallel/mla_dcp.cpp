// MLA decode with the latent cache sharded by token over the DCP (= TP) ranks.
//
// Each rank holds its heads' queries; it absorbs them (q~ = W_uk^T q_nope), all-gathers the
// absorbed queries of every head, and runs the absorbed attention of all heads over its own
// cached tokens, keeping for each head the running max m, the sum of exp s and the weighted
// latent sum a[kv_lora] (flash-decoding partials). The partials are all-gathered and merged
// exactly: M = max_r m_r, o_lat = sum_r e^(m_r - M) a_r / sum_r e^(m_r - M) s_r, in rank order,
// so every rank merging a head gets the same bits. W_uv, the output gate and the o_proj slice
// then run on this rank's heads as in the single-rank block.
#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

#include "core/error.h"
#include "core/numeric.h"
#include "cpu/layers.h"
#include "parallel/rank_step.h"

namespace k3::parallel {
namespace {

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void mla_dcp_attention(const RankContext& ctx, int layer, const float* x,
                       const std::vector<cpu::MlaLayerState*>& states,
                       const std::vector<int64_t>& positions, float* o) {
  const ModelConfig& lc = ctx.local.config();  // local head count
  const MlaWeights& w = ctx.local.weights().layers[static_cast<size_t>(layer)].mla;
  const int64_t n = static_cast<int64_t>(states.size());
  const int hl = lc.num_attention_heads, heads = ctx.model.num_attention_heads;
  const int nope = lc.qk_nope_head_dim, rope = lc.qk_rope_head_dim, vd = lc.v_head_dim;
  const int64_t kvl = lc.kv_lora_rank, qhd = nope + rope, row = kvl + rope;
  const int64_t Hd = ctx.model.hidden_size;
  const int dcp = ctx.layout.dcp;
  const float scale = 1.0f / std::sqrt(static_cast<float>(qhd));

  // Queries of this rank's heads, absorbed: qa[n][hl][kv_lora + rope] (q~ then q_pe); and this
  // token's cache row, kept only by the rank that owns its position.
  std::vector<float> qa(static_cast<size_t>(n * hl * row));
  std::vector<float> r, q(static_cast<size_t>(hl * qhd)), kv(static_cast<size_t>(row)),
      wr(static_cast<size_t>(kvl));
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * Hd;
    cpu::mla_queries(lc, w, ctx.num, xi, r, q.data());
    cpu::mla_cache_entry(lc, w, ctx.num, xi, kv.data());
    cpu::MlaLayerState& st = *states[static_cast<size_t>(i)];
    cpu::round_trip_latent_row(st.latent_format, kv.data(), static_cast<int>(kvl), rope);
    if (positions[static_cast<size_t>(i)] % dcp == ctx.tp_rank)
      st.latent.insert(st.latent.end(), kv.begin(), kv.end());
    for (int h = 0; h < hl; ++h) {
      float* qh = qa.data() + (i * hl + h) * row;  // [kv_lora + rope]
      std::fill(qh, qh + kvl, 0.0f);
      for (int k = 0; k < nope; ++k) {  // q~[j] = sum_k W_uk[h][k][j] q_nope[k], row by row
        w.kv_b.row_to_float(static_cast<int64_t>(h) * (nope + vd) + k, wr.data());
        const float qk = q[static_cast<size_t>(h * qhd + k)];
        for (int64_t j = 0; j < kvl; ++j) qh[j] += wr[static_cast<size_t>(j)] * qk;
      }
      if (ctx.num.bf16_activations) round_bf16(std::span<float>(qh, static_cast<size_t>(kvl)));
      for (int k = 0; k < rope; ++k) qh[kvl + k] = q[static_cast<size_t>(h * qhd + nope + k)];
    }
  }
  std::vector<float> qall(static_cast<size_t>(dcp) * qa.size());  // [dcp][n][hl][row]
  ctx.tp.all_gather(qa.data(), static_cast<int64_t>(qa.size()), qall.data());

  // Partials of every head over this rank's tokens: part[n][heads][2 + kv_lora] = m, s, a.
  const int64_t pw = 2 + kvl;
  std::vector<float> part(static_cast<size_t>(n * heads * pw), 0.0f);
  std::vector<float> p;
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<float>& cache = states[static_cast<size_t>(i)]->latent;  // [T_r][row]
    const int64_t T = static_cast<int64_t>(cache.size()) / row;
    p.resize(static_cast<size_t>(T));
    for (int g = 0; g < heads; ++g) {
      const int src = g / hl, h = g % hl;
      const float* qg = qall.data() + ((src * n + i) * hl + h) * row;
      float* out = part.data() + (i * heads + g) * pw;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < T; ++t) {
        const float* c = cache.data() + t * row;
        p[static_cast<size_t>(t)] = (dot(qg, c, kvl) + dot(qg + kvl, c + kvl, rope)) * scale;
        m = std::max(m, p[static_cast<size_t>(t)]);
      }
      float s = 0.0f;
      float* a = out + 2;
      for (int64_t t = 0; t < T; ++t) {
        const float e = std::exp(p[static_cast<size_t>(t)] - m);
        s += e;
        const float* c = cache.data() + t * row;
        for (int64_t j = 0; j < kvl; ++j) a[j] += e * c[j];
      }
      out[0] = m;
      out[1] = s;
    }
  }
  std::vector<float> pall(static_cast<size_t>(dcp) * part.size());  // [dcp][n][heads][pw]
  ctx.tp.all_gather(part.data(), static_cast<int64_t>(part.size()), pall.data());

  // Merge this rank's heads, then W_uv, the gate and (by the caller) the o_proj slice.
  std::vector<float> lat(static_cast<size_t>(kvl));
  for (int64_t i = 0; i < n; ++i) {
    float* oi = o + i * hl * vd;  // [hl][v]
    for (int h = 0; h < hl; ++h) {
      const int g = ctx.tp_rank * hl + h;
      auto at = [&](int src) { return pall.data() + ((src * n + i) * heads + g) * pw; };
      float M = -std::numeric_limits<float>::infinity();
      for (int src = 0; src < dcp; ++src)
        if (at(src)[1] > 0.0f) M = std::max(M, at(src)[0]);
      K3_CHECK(std::isfinite(M), "DCP: no cached token for layer ", layer);
      float S = 0.0f;
      std::fill(lat.begin(), lat.end(), 0.0f);
      for (int src = 0; src < dcp; ++src) {
        const float* ps = at(src);
        if (!(ps[1] > 0.0f)) continue;  // a rank with no token of this request yet
        const float f = std::exp(ps[0] - M);
        S += f * ps[1];
        for (int64_t j = 0; j < kvl; ++j) lat[static_cast<size_t>(j)] += f * ps[2 + j];
      }
      for (float& v : lat) v /= S;
      cpu::linear_rows(w.kv_b, static_cast<int64_t>(h) * (nope + vd) + nope, vd, lat.data(),
                       oi + h * vd);
    }
    ctx.num.round(oi, static_cast<size_t>(hl * vd));
    cpu::mla_output_gate(w, ctx.num, x + i * Hd, oi);
  }
}

}  // namespace k3::parallel
