// The per-layer blocks of the CPU reference backbone, one token at a time. Each reads the
// normed layer input x[hidden] and writes out[hidden] (rounded per Numerics at the same points
// where the GPU path stores bf16).
#pragma once

#include "cpu/decode_state.h"
#include "cpu/numerics.h"
#include "cpu/ops_basic.h"
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

}  // namespace k3::cpu
