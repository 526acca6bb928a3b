#include <cmath>
#include <vector>

#include "cpu/layers.h"
#include "cpu/ops_kda.h"

namespace k3::cpu {

void kda_attention(const ModelConfig& cfg, const KdaWeights& w, const Numerics& num,
                   KdaLayerState& state, const float* x, float* out) {
  std::vector<float> gated(static_cast<size_t>(cfg.kda_proj_dim()));  // [heads * head_dim]
  kda_attention_core(cfg, w, num, state, x, gated.data());
  linear(w.o_proj, gated.data(), out);
  num.round(out, static_cast<size_t>(cfg.hidden_size));
}

void kda_attention_core(const ModelConfig& cfg, const KdaWeights& w, const Numerics& num,
                        KdaLayerState& state, const float* x, float* gated) {
  const auto& la = cfg.linear_attn_config;
  const int heads = la.num_heads, D = la.head_dim, K = la.short_conv_kernel_size;
  const int64_t P = cfg.kda_proj_dim();
  const size_t Pz = static_cast<size_t>(P);

  // Projections (bf16 GEMM outputs on the GPU).
  std::vector<float> u(3 * Pz);  // [3][P]: pre-conv q, k, v
  linear(w.q_proj, x, u.data());
  linear(w.k_proj, x, u.data() + Pz);
  linear(w.v_proj, x, u.data() + 2 * Pz);
  num.round(u);

  // Short conv + SiLU with the stored window of previous pre-conv inputs.
  std::vector<float> window(state.conv.size());  // [3][P][K-1]
  state.conv.load(window.data());
  std::vector<float> qkv(3 * Pz);  // [3][P] post-conv, post-SiLU
  const WeightMatrix* conv[3] = {&w.q_conv, &w.k_conv, &w.v_conv};
  for (int i = 0; i < 3; ++i)
    kda_short_conv_step(u.data() + i * Pz, window.data() + i * Pz * (K - 1), *conv[i], P, K,
                        qkv.data() + i * Pz);
  state.conv.store(window.data());
  float* q = qkv.data();                 // [heads][D]
  float* k = qkv.data() + Pz;            // [heads][D]
  const float* v = qkv.data() + 2 * Pz;  // [heads][D]
  for (int h = 0; h < heads; ++h) {
    l2_normalize(q + h * D, D, ModelConfig::kQkL2NormEps);
    l2_normalize(k + h * D, D, ModelConfig::kQkL2NormEps);
  }

  // Decay gate (low rank f_a -> f_b), write strength beta.
  std::vector<float> fa(static_cast<size_t>(w.f_a.rows)), f(Pz), g(Pz);
  linear(w.f_a, x, fa.data());
  num.round(fa);
  linear(w.f_b, fa.data(), f.data());
  num.round(f);
  kda_decay_gate(f.data(), w.dt_bias.data(), w.a_log.data(), heads, D, la.gate_lower_bound,
                 g.data());
  std::vector<float> beta(static_cast<size_t>(heads));
  linear(w.b_proj, x, beta.data());
  for (float& b : beta) b = sigmoid(num.round(b));

  // Delta-rule recurrence in fp32 over the state as stored.
  std::vector<float> S(state.recurrent.size());  // [heads][D][D]
  state.recurrent.load(S.data());
  std::vector<float> o(Pz);  // [heads][D]
  kda_recurrence_step(S.data(), q, k, v, g.data(), beta.data(), heads, D,
                      1.0f / std::sqrt(static_cast<float>(D)), o.data());
  state.recurrent.store(S.data());

  // Output gate (full rank or low rank), gated RMSNorm (the o_proj input).
  std::vector<float> z(Pz);
  if (!w.g_proj.empty()) {
    linear(w.g_proj, x, z.data());
  } else {
    std::vector<float> ga(static_cast<size_t>(w.g_a.rows));
    linear(w.g_a, x, ga.data());
    num.round(ga);
    linear(w.g_b, ga.data(), z.data());
  }
  num.round(z);
  kda_gated_norm(o.data(), z.data(), w.o_norm.data(), heads, D, cfg.rms_norm_eps, gated);
  num.round(gated, Pz);
}

}  // namespace k3::cpu
