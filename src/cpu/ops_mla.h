// Gated NoPE MLA reference ops (spec 3.3): absorbed decode over a latent cache, and the
// materialised form it must equal. No RoPE anywhere: k_pe is used as stored.
#pragma once

#include <cstdint>

#include "model/weight_matrix.h"

namespace k3::cpu {

struct MlaDims {
  int heads = 0;
  int nope = 0;     // qk_nope_head_dim
  int rope = 0;     // qk_rope_head_dim (unrotated)
  int v = 0;        // v_head_dim
  int kv_lora = 0;  // kv_lora_rank
};

// One query token against cached tokens.
//   q_nope: [heads][nope], q_pe: [heads][rope]
//   kv_b: kv_b_proj [heads*(nope+v), kv_lora]; head h rows h*(nope+v) + [0,nope) are W_uk,
//         + [nope, nope+v) are W_uv.
//   cache_c: [T][kv_lora] (normed latent), cache_pe: [T][rope].
//   selected: null for all T tokens, else n_selected token indices (DSA sparse attention).
//   out: [heads][v].
// Absorbed: q~ = W_uk^T q_nope; s_t = (q~.c_t + q_pe.pe_t) * scale; softmax; o = W_uv sum p c.
// bf16_q_abs: q~ rounded to bf16, as the GPU stores it (the attention kernel's bf16 query).
void mla_absorbed_decode(const float* q_nope, const float* q_pe, const WeightMatrix& kv_b,
                         const float* cache_c, const float* cache_pe, int64_t T,
                         const int64_t* selected, int64_t n_selected, const MlaDims& d,
                         float softmax_scale, float* out, bool bf16_q_abs = false);

// Materialised form: k_t[h] = [W_uk c_t ; pe_t], v_t[h] = W_uv c_t, plain softmax attention.
void mla_naive_decode(const float* q_nope, const float* q_pe, const WeightMatrix& kv_b,
                      const float* cache_c, const float* cache_pe, int64_t T,
                      const int64_t* selected, int64_t n_selected, const MlaDims& d,
                      float softmax_scale, float* out);

}  // namespace k3::cpu
