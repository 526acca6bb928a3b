#include <algorithm>
#include <cmath>
#include <vector>

#include "core/numeric.h"
#include "cpu/layers.h"
#include "cpu/ops_dsa.h"
#include "cpu/ops_mla.h"

namespace k3::cpu {
namespace {

// DSA lightning indexer: caches this token's index key, then returns the cached tokens the
// query attends to (top index_topk by index score, or all when the context is shorter).
std::vector<int64_t> dsa_select(const ModelConfig& cfg, const DsaIndexerWeights& w,
                                const Numerics& num, MlaLayerState& st, const float* x,
                                const float* q_latent, int64_t T) {
  const auto& d = cfg.dsa_config;
  const int64_t hd = d.index_head_dim, nh = d.index_n_heads;
  const int64_t blocks = index_scale_blocks(hd);
  const int64_t block = (hd + blocks - 1) / blocks;

  // Key: k_norm(wk x), Hadamard-rotated, cached as fp8 with per-block scales.
  std::vector<float> key(static_cast<size_t>(hd));
  linear(w.wk, x, key.data());
  num.round(key);
  if (d.index_k_norm_type == "layernorm")
    layer_norm(key.data(), w.k_norm_w.data(), w.k_norm_b.data(), hd, cfg.rms_norm_eps, key.data());
  else
    rms_norm(key.data(), w.k_norm_w.data(), hd, cfg.rms_norm_eps, key.data());
  hadamard_transform(key.data(), hd);
  const size_t kq = st.index_keys.size(), ks = st.index_scales.size();
  st.index_keys.resize(kq + static_cast<size_t>(hd));
  st.index_scales.resize(ks + static_cast<size_t>(blocks));
  quantize_fp8_blocks(key.data(), hd, block, st.index_keys.data() + kq,
                      st.index_scales.data() + ks);

  // Query heads from the normed q latent, rotated and fp8-quantized like the keys.
  std::vector<float> q(static_cast<size_t>(nh * hd));  // [nh][hd]
  linear(w.wq_b, q_latent, q.data());
  num.round(q);
  dsa_prepare_queries(q.data(), nh, hd, block);
  std::vector<float> head_w(static_cast<size_t>(nh));
  linear(w.weights_proj, x, head_w.data());
  const float head_scale = 1.0f / std::sqrt(static_cast<float>(nh * hd));
  for (float& v : head_w) v = num.round(v) * head_scale;

  std::vector<float> keys(static_cast<size_t>(T * hd));  // [T][hd] dequantized
  for (int64_t t = 0; t < T; ++t)
    dequantize_fp8_blocks(st.index_keys.data() + t * hd, st.index_scales.data() + t * blocks, hd,
                          block, keys.data() + t * hd);
  std::vector<float> scores(static_cast<size_t>(T));
  dsa_index_scores(q.data(), head_w.data(), keys.data(), T, static_cast<int>(nh),
                   static_cast<int>(hd), scores.data());
  std::vector<int64_t> idx(static_cast<size_t>(std::min<int64_t>(T, d.index_topk)));
  const int64_t n = dsa_topk(scores.data(), T, d.index_topk, idx.data());
  idx.resize(static_cast<size_t>(n));
  return idx;
}

}  // namespace

void mla_queries(const ModelConfig& cfg, const MlaWeights& w, const Numerics& num, const float* x,
                 std::vector<float>& r, float* q) {
  // Queries: q LoRA (K3) or a plain q_proj (Kimi-Linear). q: [heads][nope + rope].
  const size_t nq = static_cast<size_t>(w.q_a.empty() ? w.q_proj.rows : w.q_b.rows);
  r.clear();
  if (!w.q_a.empty()) {
    r.resize(static_cast<size_t>(w.q_a.rows));
    linear(w.q_a, x, r.data());
    num.round(r);
    rms_norm(r.data(), w.q_a_norm.data(), w.q_a.rows, ModelConfig::kMlaLatentNormEps, r.data());
    num.round(r);
    linear(w.q_b, r.data(), q);
  } else {
    linear(w.q_proj, x, q);
  }
  num.round(q, nq);
}

void mla_cache_entry(const ModelConfig& cfg, const MlaWeights& w, const Numerics& num,
                     const float* x, float* kv) {
  // kv: [kv_lora + rope], this token's normed latent c and the unrotated k_pe (before the
  // cache format's round trip).
  linear(w.kv_a, x, kv);
  num.round(kv, static_cast<size_t>(w.kv_a.rows));
  rms_norm(kv, w.kv_a_norm.data(), cfg.kv_lora_rank, ModelConfig::kMlaLatentNormEps, kv);
}

void mla_output_gate(const MlaWeights& w, const Numerics& num, const float* x, float* o) {
  // Sigmoid output gate on the normed layer input; o: [heads * v], g_proj: [heads * v, H].
  if (w.g_proj.empty()) return;
  const size_t n = static_cast<size_t>(w.g_proj.rows);
  std::vector<float> gate(n);
  linear(w.g_proj, x, gate.data());
  for (size_t i = 0; i < n; ++i) o[i] = num.round(o[i] * sigmoid(num.round(gate[i])));
}

void mla_attention(const ModelConfig& cfg, const MlaWeights& w, const Numerics& num,
                   MlaLayerState& st, const float* x, float* out) {
  std::vector<float> o(static_cast<size_t>(cfg.num_attention_heads * cfg.v_head_dim));
  mla_attention_core(cfg, w, num, st, x, o.data());
  linear(w.o_proj, o.data(), out);
  num.round(out, static_cast<size_t>(cfg.hidden_size));
}

void mla_attention_core(const ModelConfig& cfg, const MlaWeights& w, const Numerics& num,
                        MlaLayerState& st, const float* x, float* o_out) {
  const int heads = cfg.num_attention_heads, nope = cfg.qk_nope_head_dim;
  const int rope = cfg.qk_rope_head_dim, vd = cfg.v_head_dim, kvl = cfg.kv_lora_rank;
  const int qhd = nope + rope;

  std::vector<float> r;  // [q_lora] normed q latent (also the DSA indexer's input)
  std::vector<float> q(static_cast<size_t>(heads * qhd));  // [heads][nope + rope]
  mla_queries(cfg, w, num, x, r, q.data());

  // This token's cache entry: normed latent c and the unrotated k_pe.
  std::vector<float> kv(static_cast<size_t>(kvl + rope));
  mla_cache_entry(cfg, w, num, x, kv.data());
  const size_t row = static_cast<size_t>(kvl + rope);
  const size_t base = st.latent.size();
  st.latent.resize(base + row);
  std::copy(kv.begin(), kv.end(), st.latent.begin() + static_cast<std::ptrdiff_t>(base));
  round_trip_latent_row(st.latent_format, st.latent.data() + base, kvl, rope);
  const int64_t T = static_cast<int64_t>(st.latent.size() / row);

  std::vector<int64_t> selected;
  if (w.indexer) selected = dsa_select(cfg, *w.indexer, num, st, x, r.data(), T);

  // Split the cache rows into the op's c and k_pe arrays.
  std::vector<float> cache_c(static_cast<size_t>(T * kvl)), cache_pe(static_cast<size_t>(T * rope));
  for (int64_t t = 0; t < T; ++t) {
    for (int i = 0; i < kvl; ++i) cache_c[t * kvl + i] = st.latent[t * row + i];
    for (int i = 0; i < rope; ++i) cache_pe[t * rope + i] = st.latent[t * row + kvl + i];
  }
  std::vector<float> q_nope(static_cast<size_t>(heads * nope)),
      q_pe(static_cast<size_t>(heads * rope));
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < nope; ++i) q_nope[h * nope + i] = q[h * qhd + i];
    for (int i = 0; i < rope; ++i) q_pe[h * rope + i] = q[h * qhd + nope + i];
  }
  const MlaDims dims{heads, nope, rope, vd, kvl};
  std::vector<float> o(static_cast<size_t>(heads * vd));  // [heads][v]
  mla_absorbed_decode(q_nope.data(), q_pe.data(), w.kv_b, cache_c.data(), cache_pe.data(), T,
                      w.indexer ? selected.data() : nullptr, static_cast<int64_t>(selected.size()),
                      dims, 1.0f / std::sqrt(static_cast<float>(qhd)), o.data(),
                      num.bf16_activations);
  num.round(o);

  mla_output_gate(w, num, x, o.data());
  std::copy(o.begin(), o.end(), o_out);
}

}  // namespace k3::cpu
