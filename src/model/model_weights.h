// Weights bound by role from a checkpoint. Matrices stay in the checkpoint's mmap (no copy);
// small vectors (norm weights, biases, A_log, AttnRes score vectors) are converted to fp32.
#pragma once

#include <optional>
#include <vector>

#include "model/config.h"
#include "model/weight_matrix.h"

namespace k3 {

class Checkpoint;

struct KdaWeights {
  WeightMatrix q_proj, k_proj, v_proj;  // [P, H] each, P = heads * head_dim
  WeightMatrix q_conv, k_conv, v_conv;  // [P, kernel] fp32 (stored [P, 1, kernel])
  WeightMatrix f_a, f_b;                // decay gate low rank: [D, H], [P, D]
  WeightMatrix b_proj;                  // [heads, H]
  WeightMatrix g_proj;                  // full-rank output gate [P, H] (or empty)
  WeightMatrix g_a, g_b;                // low-rank output gate [D, H], [P, D] (or empty)
  WeightMatrix o_proj;                  // [H, P]
  std::vector<float> dt_bias;           // [P] fp32
  std::vector<float> a_log;             // [heads] fp32 (padding dropped)
  std::vector<float> o_norm;            // [head_dim] fp32
};

struct DsaIndexerWeights {
  WeightMatrix wq_b;                      // [n_heads * head_dim, q_lora] on the normed q latent
  WeightMatrix wk;                        // [head_dim, H]
  WeightMatrix weights_proj;              // [n_heads, H]
  std::vector<float> k_norm_w, k_norm_b;  // [head_dim]; bias empty for RMSNorm keys
};

struct MlaWeights {
  WeightMatrix q_a, q_b;                   // q LoRA: [q_lora, H], [heads * qhd, q_lora] (or empty)
  WeightMatrix q_proj;                     // plain q: [heads * qhd, H] (Kimi-Linear; or empty)
  WeightMatrix kv_a;                       // [kv_lora + rope, H]
  WeightMatrix kv_b;                       // [heads * (nope + v), kv_lora]
  WeightMatrix g_proj;                     // output gate [heads * v, H] (or empty)
  WeightMatrix o_proj;                     // [H, heads * v]
  std::vector<float> q_a_norm, kv_a_norm;  // [q_lora], [kv_lora]
  std::optional<DsaIndexerWeights> indexer;
};

struct ExpertWeights {
  WeightMatrix w1, w3;  // gate / up: [moe_intermediate, expert_io_dim]
  WeightMatrix w2;      // down: [expert_io_dim, moe_intermediate]
};

struct MoeWeights {
  WeightMatrix gate;                                 // router [E, H]
  std::vector<float> score_bias;                     // [E] e_score_correction_bias (empty if none)
  WeightMatrix latent_down;                          // [L, H] (empty without latent MoE)
  WeightMatrix latent_up;                            // [H, L]
  std::vector<float> latent_norm;                    // [L] (empty without the norm)
  WeightMatrix shared_gate, shared_up, shared_down;  // [S, H], [S, H], [H, S] (or empty)
  std::vector<ExpertWeights> experts;
};

struct DenseFfnWeights {
  WeightMatrix gate, up;  // [I, H]
  WeightMatrix down;      // [H, I]
};

struct LayerWeights {
  LayerKind kind = LayerKind::KDA;
  bool moe = false;
  std::vector<float> input_norm, post_attn_norm;  // [H]
  // AttnRes score vectors w = norm.weight * proj.weight, fp32 [H] (empty without AttnRes).
  std::vector<float> attn_res_attn, attn_res_mlp;
  KdaWeights kda;
  MlaWeights mla;
  MoeWeights moe_w;
  DenseFfnWeights dense;
};

struct ModelWeights {
  WeightMatrix embed;                  // [V, H]
  WeightMatrix lm_head;                // [V, H] (the embedding when tied)
  std::vector<float> final_norm;       // [H]
  std::vector<float> output_attn_res;  // [H] (empty without AttnRes)
  std::vector<LayerWeights> layers;
};

// Validates the checkpoint against weight_table(cfg) (one error listing every problem), then
// binds. The checkpoint must outlive the result.
ModelWeights bind_weights(const ModelConfig& cfg, const Checkpoint& ckpt);

}  // namespace k3
