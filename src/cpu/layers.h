// The per-layer blocks of the CPU reference backbone, one token at a time. Each reads the
// normed layer input x[hidden] and writes out[hidden] (rounded per Numerics at the same points
// where the GPU path stores bf16).
#pragma once

#include <vector>

#include "cpu/decode_state.h"
#include "cpu/numerics.h"
#include "cpu/ops_basic.h"
#include "cpu/ops_moe.h"
#include "model/config.h"
#include "model/model_weights.h"

namespace k3::cpu {

// KDA (spec 3.2): projections, short conv, L2 norm, decay gate, beta, delta rule, gated norm.
void kda_attention(const ModelConfig& cfg, const KdaWeights& w, const Numerics& num,
                   KdaLayerState& state, const float* x, float* out);

// Gated NoPE MLA (spec 3.3) in absorbed form over the latent cache; with DSA (spec 3.5) the
// indexer picks the cached tokens attended to. Appends this token to the caches first.
void mla_attention(const ModelConfig& cfg, const MlaWeights& w, const Numerics& num,
                   MlaLayerState& state, const float* x, float* out);

// Latent MoE (spec 3.6): router on x, experts in the latent, norm, up-proj, shared experts.
void moe_ffn(const ModelConfig& cfg, const MoeWeights& w, const Numerics& num, const float* x,
             float* out);

// Dense SiTU / SiLU MLP (layer 0).
void dense_ffn(const ModelConfig& cfg, const DenseFfnWeights& w, const Numerics& num,
               const float* x, float* out);

GluActivation activation_for(const ModelConfig& cfg);

// Pieces of the blocks above, for executors that split a layer over ranks (src/parallel). The
// blocks are exactly these pieces in sequence, so splitting changes no result.

// KDA up to the o_proj input: gated[heads * head_dim] (rounded).
void kda_attention_core(const ModelConfig& cfg, const KdaWeights& w, const Numerics& num,
                        KdaLayerState& state, const float* x, float* gated);
// MLA up to the o_proj input: o[heads * v_head_dim] (attention output, gated, rounded).
void mla_attention_core(const ModelConfig& cfg, const MlaWeights& w, const Numerics& num,
                        MlaLayerState& state, const float* x, float* o);
// MLA queries: r = normed q latent [q_lora] (empty without q LoRA), q[heads][nope + rope].
void mla_queries(const ModelConfig& cfg, const MlaWeights& w, const Numerics& num, const float* x,
                 std::vector<float>& r, float* q);
// This token's cache row kv[kv_lora + rope] (normed c, raw k_pe) before the format round trip.
void mla_cache_entry(const ModelConfig& cfg, const MlaWeights& w, const Numerics& num,
                     const float* x, float* kv);
// o[heads * v] *= sigmoid(g_proj x), rounded; a no-op without the gate.
void mla_output_gate(const MlaWeights& w, const Numerics& num, const float* x, float* o);

RouterConfig moe_router_config(const ModelConfig& cfg);
// Expert input z[L]: the latent down-projection of x[H] (rounded), or x without latent MoE.
void moe_expert_input(const MoeWeights& w, const Numerics& num, const float* x, size_t L, float* z);
// From the complete weighted expert sum acc[L] (normed in place) to routed[H] (rounded).
void moe_latent_output(const ModelConfig& cfg, const MoeWeights& w, const Numerics& num, float* acc,
                       float* routed);

}  // namespace k3::cpu
