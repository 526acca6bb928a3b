// Attention Residuals mixing (spec 3.4): softmax over RMS-normalized scores, raw-value mix.
#pragma once

#include <cstdint>

namespace k3::cpu {

// sources: n_sources pointers to [dim] vectors; score_w: [dim] (norm.weight * proj.weight, fp32).
// s_j = <v_j * rsqrt(mean(v_j^2) + eps), score_w>, p = softmax(s), out = sum_j p_j v_j (fp32).
// probs (optional, [n_sources]) receives p.
void attn_res_mix(const float* const* sources, int n_sources, const float* score_w, int64_t dim,
                  float eps, float* out, float* probs = nullptr);

}  // namespace k3::cpu
