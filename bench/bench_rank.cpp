#include "bench_rank.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include "core/error.h"
#include "core/numeric.h"
#include "core/rng.h"
#include "synth/presets.h"

namespace k3::bench {
namespace {

ModelConfig sharded(const RankShape& s, int layers) {
  ModelConfig c = synth_preset(s.dsa ? "k3.1" : "k3");
  set_k3_layer_schedule(c, layers);
  K3_CHECK(c.num_attention_heads % s.tp == 0 && c.linear_attn_config.num_heads % s.tp == 0,
           "--tp must divide the head counts");
  K3_CHECK(s.ep >= 1 && c.num_experts % s.ep == 0, "--ep ", s.ep, " must divide the ",
           c.num_experts, " experts");
  c.num_attention_heads /= s.tp;
  c.linear_attn_config.num_heads /= s.tp;
  c.intermediate_size /= s.tp;
  c.vocab_size /= s.tp;  // vocab-parallel embedding / lm_head: this rank's shard
  // Special ids of the full vocabulary fall outside a shard; any ids inside it do for timing.
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  c.pad_token_id = 3;
  return c;
}

double rms_bf16(const WeightMatrix& m) {
  const auto* p = static_cast<const uint16_t*>(m.data);
  const int64_t n = m.rows * m.cols;
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = bf16_to_float(p[i]);
    ss += v * v;
  }
  return std::sqrt(ss / static_cast<double>(std::max<int64_t>(n, 1)));
}

// [rows, cols] bf16: rows [0, tmpl.rows) copied from tmpl, the rest N(0, rms(tmpl)).
WeightMatrix extend_rows(const WeightMatrix& tmpl, int64_t rows, Rng& rng,
                         std::deque<std::vector<uint8_t>>& keep) {
  K3_CHECK(tmpl.format == WeightFormat::BF16 && tmpl.rows <= rows, tmpl.name,
           ": a bf16 matrix of at most ", rows, " rows expected");
  const int64_t cols = tmpl.cols;
  std::vector<uint8_t>& buf = keep.emplace_back(static_cast<size_t>(rows * cols * 2));
  auto* out = reinterpret_cast<uint16_t*>(buf.data());
  std::memcpy(out, tmpl.data, static_cast<size_t>(tmpl.rows * cols * 2));
  const float scale = static_cast<float>(rms_bf16(tmpl));
  for (int64_t i = tmpl.rows * cols; i < rows * cols; ++i)
    out[i] = float_to_bf16(rng.normal() * scale);
  WeightMatrix m = tmpl;
  m.rows = rows;
  m.data = buf.data();
  return m;
}

// Columns [0, n) of a [rows, cols] bf16 matrix, materialized.
WeightMatrix first_cols(const WeightMatrix& w, int64_t n, std::deque<std::vector<uint8_t>>& keep) {
  K3_CHECK(w.format == WeightFormat::BF16 && n <= w.cols, w.name, ": bf16 with >= ", n,
           " columns expected");
  std::vector<uint8_t>& buf = keep.emplace_back(static_cast<size_t>(w.rows * n * 2));
  for (int64_t r = 0; r < w.rows; ++r)
    std::memcpy(buf.data() + r * n * 2, static_cast<const uint8_t*>(w.data) + r * w.cols * 2,
                static_cast<size_t>(n * 2));
  WeightMatrix m = w;
  m.cols = n;
  m.data = buf.data();
  return m;
}

// Rows [0, n) of a row-major matrix: a view.
WeightMatrix first_rows(const WeightMatrix& w, int64_t n) {
  K3_CHECK(n <= w.rows && w.format != WeightFormat::MXFP4, w.name, ": >= ", n, " rows expected");
  WeightMatrix m = w;
  m.rows = n;
  return m;
}

LayerWeights rank_layer(const LayerWeights& t, const ModelConfig& rank, const RankShape& s,
                        uint64_t seed, std::deque<std::vector<uint8_t>>& keep) {
  LayerWeights L = t;
  if (!L.moe) return L;
  MoeWeights& m = L.moe_w;
  const int64_t E = rank.num_experts, local = E / s.ep;
  K3_CHECK(static_cast<int64_t>(m.experts.size()) == local, "template MoE layer holds ",
           m.experts.size(), " experts, the rank ", local);
  Rng rng(seed);
  m.gate = extend_rows(m.gate, E, rng, keep);
  if (!m.score_bias.empty()) {
    double ss = 0;
    for (float b : m.score_bias) ss += static_cast<double>(b) * b;
    const float scale = static_cast<float>(std::sqrt(ss / static_cast<double>(local)));
    while (static_cast<int64_t>(m.score_bias.size()) < E)
      m.score_bias.push_back(round_bf16(rng.normal() * scale));
  }
  m.experts.resize(static_cast<size_t>(E));  // [local, E): other ranks' experts, empty
  if (!m.shared_gate.empty()) {
    const int64_t S = m.shared_gate.rows;
    K3_CHECK(S % s.tp == 0, "--tp ", s.tp, " must divide the shared-expert width ", S);
    m.shared_gate = first_rows(m.shared_gate, S / s.tp);
    m.shared_up = first_rows(m.shared_up, S / s.tp);
    m.shared_down = first_cols(m.shared_down, S / s.tp, keep);
  }
  return L;
}

}  // namespace

ModelConfig rank_config(const RankShape& s) {
  return sharded(s, s.layers);
}

ModelConfig template_config(const RankShape& s, int template_layers) {
  ModelConfig c = sharded(s, template_layers);
  c.num_experts /= s.ep;
  return c;
}

ModelWeights rank_weights(const ModelWeights& tmpl, const ModelConfig& rank, const RankShape& s,
                          std::deque<std::vector<uint8_t>>& keep) {
  std::vector<LayerWeights> converted;
  for (size_t j = 0; j < tmpl.layers.size(); ++j)
    converted.push_back(rank_layer(tmpl.layers[j], rank, s, 1000 + j, keep));
  ModelWeights w = tmpl;
  w.layers.clear();
  std::map<std::pair<int, bool>, int> used;
  for (int l = 0; l < rank.num_hidden_layers; ++l) {
    const std::pair<int, bool> kind{static_cast<int>(rank.layer_kind(l)), rank.is_moe_layer(l)};
    std::vector<size_t> same;
    for (size_t j = 0; j < converted.size(); ++j)
      if (static_cast<int>(converted[j].kind) == kind.first && converted[j].moe == kind.second)
        same.push_back(j);
    K3_CHECK(!same.empty(), "the template checkpoint has no layer of layer ", l, "'s kind");
    w.layers.push_back(converted[same[static_cast<size_t>(used[kind]++) % same.size()]]);
  }
  return w;
}

Floor floor_of(const ModelConfig& c, const ModelWeights& w) {
  Floor f;
  const auto add = [&](const WeightMatrix& m) {
    if (!m.empty()) f.fixed += static_cast<double>(m.storage_bytes());
  };
  add(w.lm_head);
  for (const LayerWeights& L : w.layers) {
    if (L.kind == LayerKind::KDA) {
      ++f.kda_layers;
      for (const WeightMatrix* m :
           {&L.kda.q_proj, &L.kda.k_proj, &L.kda.v_proj, &L.kda.f_a, &L.kda.f_b, &L.kda.b_proj,
            &L.kda.g_proj, &L.kda.g_a, &L.kda.g_b, &L.kda.o_proj})
        add(*m);
    } else {
      ++f.mla_layers;
      for (const WeightMatrix* m : {&L.mla.q_a, &L.mla.q_b, &L.mla.q_proj, &L.mla.kv_a, &L.mla.kv_b,
                                    &L.mla.g_proj, &L.mla.o_proj})
        add(*m);
      if (L.mla.indexer)
        for (const WeightMatrix* m :
             {&L.mla.indexer->wq_b, &L.mla.indexer->wk, &L.mla.indexer->weights_proj})
          add(*m);
    }
    if (L.moe) {
      ++f.moe_layers;
      for (const WeightMatrix* m : {&L.moe_w.gate, &L.moe_w.latent_down, &L.moe_w.latent_up,
                                    &L.moe_w.shared_gate, &L.moe_w.shared_up, &L.moe_w.shared_down})
        add(*m);
      int held = 0;
      for (const ExpertWeights& e : L.moe_w.experts) {
        if (e.w1.empty()) continue;
        ++held;
        f.expert =
            static_cast<double>(e.w1.storage_bytes() + e.w3.storage_bytes() + e.w2.storage_bytes());
      }
      f.local_experts = held;
    } else {
      for (const WeightMatrix* m : {&L.dense.gate, &L.dense.up, &L.dense.down}) add(*m);
    }
  }
  const double D = c.linear_attn_config.head_dim;
  f.kda_state = 2.0 * c.linear_attn_config.num_heads * D * D * 4;
  f.latent_row = (c.kv_lora_rank + c.qk_rope_head_dim) * 2.0 +
                 (c.dsa_config.enabled ? c.dsa_config.index_head_dim + 4.0 : 0.0);
  return f;
}

double expected_local_experts(const Floor& f, const ModelConfig& c, int rows) {
  const double E = c.num_experts, k = c.num_experts_per_token;
  return f.local_experts * (1.0 - std::pow(1.0 - k / E, rows));
}

double floor_bytes(const Floor& f, const ModelConfig& c, int rows, int64_t ctx) {
  const double attended =
      c.dsa_config.enabled ? std::min<double>(ctx, c.dsa_config.index_topk) : ctx;
  return f.fixed + f.moe_layers * expected_local_experts(f, c, rows) * f.expert +
         rows * f.kda_layers * f.kda_state + rows * f.mla_layers * attended * f.latent_row;
}

}  // namespace k3::bench
