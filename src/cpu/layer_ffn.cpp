#include <algorithm>
#include <vector>

#include "cpu/layers.h"
#include "cpu/ops_moe.h"

namespace k3::cpu {

GluActivation activation_for(const ModelConfig& cfg) {
  GluActivation a;
  if (cfg.hidden_act == "situ") {
    a.kind = GluActivation::Kind::SiTU;
    a.beta = cfg.activation_situ_beta;
    a.linear_beta = cfg.activation_situ_linear_beta;
  }
  return a;
}

void dense_ffn(const ModelConfig& cfg, const DenseFfnWeights& w, const Numerics& num,
               const float* x, float* out) {
  glu_mlp(w.gate, w.up, w.down, activation_for(cfg), num, x, out);
  num.round(out, static_cast<size_t>(cfg.hidden_size));
}

void moe_ffn(const ModelConfig& cfg, const MoeWeights& w, const Numerics& num, const float* x,
             float* out) {
  const size_t H = static_cast<size_t>(cfg.hidden_size);
  const size_t L = static_cast<size_t>(cfg.expert_io_dim());
  const GluActivation act = activation_for(cfg);

  // Router on the full-width x; the bias only steers selection.
  const RouterConfig rc = moe_router_config(cfg);
  std::vector<int> idx(static_cast<size_t>(rc.top_k));
  std::vector<float> weight(static_cast<size_t>(rc.top_k));
  route(w.gate, w.score_bias.empty() ? nullptr : w.score_bias.data(), x, rc, idx.data(),
        weight.data());

  // Experts run in the latent (K3) or at full width (Kimi-Linear).
  std::vector<float> z(L);  // [L]
  moe_expert_input(w, num, x, L, z.data());
  std::vector<float> acc(L, 0.0f), y(L);
  for (size_t j = 0; j < idx.size(); ++j) {
    const ExpertWeights& e = w.experts[static_cast<size_t>(idx[j])];
    glu_mlp(e.w1, e.w3, e.w2, act, num, z.data(), y.data());
    // Each expert output is a bf16 tensor before its fp32 router weight (reference numerics).
    for (size_t i = 0; i < L; ++i) acc[i] += weight[j] * num.round(y[i]);
  }

  // The norm sees the complete expert sum (under EP the sum is reduced before this point).
  std::vector<float> routed(H);
  moe_latent_output(cfg, w, num, acc.data(), routed.data());

  if (!w.shared_gate.empty()) {
    std::vector<float> shared(H);
    glu_mlp(w.shared_gate, w.shared_up, w.shared_down, act, num, x, shared.data());
    num.round(shared);
    for (size_t i = 0; i < H; ++i) routed[i] += shared[i];
  }
  for (size_t i = 0; i < H; ++i) out[i] = num.round(routed[i]);
}

RouterConfig moe_router_config(const ModelConfig& cfg) {
  RouterConfig rc;
  rc.num_experts = cfg.num_experts;
  rc.top_k = cfg.num_experts_per_token;
  rc.num_expert_group = cfg.num_expert_group;
  rc.topk_group = cfg.topk_group;
  rc.renormalize = cfg.moe_renormalize;
  rc.routed_scaling_factor = cfg.routed_scaling_factor;
  rc.activation = cfg.moe_router_activation_func == "softmax" ? RouterConfig::Activation::Softmax
                                                              : RouterConfig::Activation::Sigmoid;
  return rc;
}

void moe_expert_input(const MoeWeights& w, const Numerics& num, const float* x, size_t L,
                      float* z) {
  // x: [H] -> z: [L] (the latent down-projection, or x itself without latent MoE).
  if (!w.latent_down.empty()) {
    linear(w.latent_down, x, z);
    num.round(z, L);
  } else {
    std::copy(x, x + L, z);
  }
}

void moe_latent_output(const ModelConfig& cfg, const MoeWeights& w, const Numerics& num, float* acc,
                       float* routed) {
  // acc: [L] the complete weighted expert sum (normed in place), routed: [H] rounded.
  const size_t H = static_cast<size_t>(cfg.hidden_size);
  const size_t L = static_cast<size_t>(cfg.expert_io_dim());
  if (!w.latent_up.empty()) {
    if (!w.latent_norm.empty())
      rms_norm(acc, w.latent_norm.data(), static_cast<int64_t>(L), cfg.rms_norm_eps, acc);
    num.round(acc, L);
    linear(w.latent_up, acc, routed);
  } else {
    std::copy(acc, acc + L, routed);
  }
  num.round(routed, H);
}

}  // namespace k3::cpu
