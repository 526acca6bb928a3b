// Kimi Delta Attention reference ops (spec 3.2), one decode token at a time plus the chunked
// prefill form. State layout: S[h][i][j], i = key channel (rows), j = value channel.
#pragma once

#include <cstdint>
#include <optional>

#include "model/weight_matrix.h"

namespace k3::cpu {

// Causal depthwise short conv + SiLU for `channels` channels and one new token.
//   u[channels]: current pre-conv input.
//   window[channels][kernel-1]: previous pre-conv inputs, oldest first; shifted and u appended.
//   w: [channels, kernel] (tap kernel-1 multiplies the current token).
//   y[channels] = silu(sum_j w[c][j] * x(t-kernel+1+j)).
void kda_short_conv_step(const float* u, float* window, const WeightMatrix& w, int64_t channels,
                         int kernel, float* y);

// Log-space decay gate g[heads*head_dim] from f = f_b(f_a(x)) and dt_bias (a = f + dt_bias):
//   lower_bound set: g = lower_bound * sigmoid(exp(a_log[h]) * a)      (K3)
//   unset:           g = -exp(a_log[h]) * softplus(a)                   (Kimi-Linear)
void kda_decay_gate(const float* f, const float* dt_bias, const float* a_log, int heads,
                    int head_dim, std::optional<float> lower_bound, float* g);

// One delta-rule step for every head (q, k already L2-normalized):
//   S <- diag(exp(g_h)) S;  u = beta_h (v_h - S^T k_h);  S <- S + k_h u^T;  o_h = scale S^T q_h
// state: [heads][head_dim][head_dim] fp32; q, k, v, g: [heads][head_dim]; beta: [heads];
// o: [heads][head_dim].
void kda_recurrence_step(float* state, const float* q, const float* k, const float* v,
                         const float* g, const float* beta, int heads, int head_dim, float scale,
                         float* o);

// The same recurrence over T tokens in chunk-parallel (WY / UT-transform) form, chunk_size
// tokens at a time; equal to T calls of kda_recurrence_step up to fp32 rounding.
// q, k, v, g: [T][heads][head_dim]; beta: [T][heads]; o: [T][heads][head_dim].
void kda_recurrence_chunked(float* state, const float* q, const float* k, const float* v,
                            const float* g, const float* beta, int64_t T, int heads, int head_dim,
                            float scale, int chunk_size, float* o);

// Gated RMSNorm per head: out[h] = rms_norm(o[h]; norm_w[head_dim], eps) * sigmoid(z[h]).
void kda_gated_norm(const float* o, const float* z, const float* norm_w, int heads, int head_dim,
                    float eps, float* out);

}  // namespace k3::cpu
