// Kimi Delta Attention per-token reference ops (spec 3.2). The chunked prefill form lives in
// ops_kda_chunked.cpp. Everything is fp32; the state layout is S[h][i][j] with i = key channel.
#include "cpu/ops_kda.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "cpu/ops_basic.h"

namespace k3::cpu {

void kda_short_conv_step(const float* u, float* window, const WeightMatrix& w, int64_t channels,
                         int kernel, float* y) {
  // u: [channels] fp32; window: [channels][kernel-1] fp32, oldest first; w: [channels, kernel]
  // (F32/BF16/F16); y: [channels] fp32 (may alias u)
  K3_CHECK(kernel >= 1, "kda_short_conv_step: kernel = ", kernel);
  K3_CHECK(channels > 0, "kda_short_conv_step: channels = ", channels);
  K3_CHECK(!w.empty() && w.format != WeightFormat::MXFP4, "kda_short_conv_step: conv weight ",
           w.name, " must be a dense F32/BF16/F16 matrix");
  K3_CHECK(w.rows == channels && w.cols == kernel, "kda_short_conv_step: conv weight ", w.name,
           " is [", w.rows, ", ", w.cols, "], expected [", channels, ", ", kernel, "]");
  K3_CHECK(u != nullptr && y != nullptr && (kernel == 1 || window != nullptr),
           "kda_short_conv_step: null input/output");
  const int hist = kernel - 1;  // previous pre-conv inputs kept per channel
  for (int64_t c = 0; c < channels; ++c) {
    float* win = window + c * hist;  // [kernel-1] fp32, oldest first
    const float cur = u[c];          // read before y[c] is written (y may alias u)
    float acc = 0.0f;
    for (int j = 0; j < hist; ++j) acc += w.at(c, j) * win[j];
    acc += w.at(c, hist) * cur;  // the last tap multiplies the current token
    // Shift the window by one and append the current PRE-conv input.
    for (int j = 0; j + 1 < hist; ++j) win[j] = win[j + 1];
    if (hist > 0) win[hist - 1] = cur;
    y[c] = silu(acc);
  }
}

void kda_decay_gate(const float* f, const float* dt_bias, const float* a_log, int heads,
                    int head_dim, std::optional<float> lower_bound, float* g) {
  // f, dt_bias, g: [heads][head_dim] fp32; a_log: [>= heads] fp32 (only the first `heads`
  // entries are read: the checkpoint pads A_log to 128)
  K3_CHECK(heads > 0 && head_dim > 0, "kda_decay_gate: heads = ", heads, ", head_dim = ", head_dim);
  K3_CHECK(f != nullptr && dt_bias != nullptr && a_log != nullptr && g != nullptr,
           "kda_decay_gate: null input/output");
  if (lower_bound)
    K3_CHECK(*lower_bound < 0.0f && std::isfinite(*lower_bound),
             "kda_decay_gate: lower bound must be finite and negative, got ", *lower_bound);
  for (int h = 0; h < heads; ++h) {
    const float a_scale = std::exp(a_log[h]);
    for (int d = 0; d < head_dim; ++d) {
      const int64_t i = static_cast<int64_t>(h) * head_dim + d;
      const float a = f[i] + dt_bias[i];
      // The lower bound swaps the activation (it is not a clamp): K3 gives g in (lb, 0).
      g[i] = lower_bound ? *lower_bound * sigmoid(a_scale * a) : -a_scale * softplus(a);
    }
  }
}

void kda_recurrence_step(float* state, const float* q, const float* k, const float* v,
                         const float* g, const float* beta, int heads, int head_dim, float scale,
                         float* o) {
  // state: [heads][head_dim][head_dim] fp32 (rows = key channel); q, k, v, g, o:
  // [heads][head_dim] fp32; beta: [heads] fp32
  K3_CHECK(heads > 0 && head_dim > 0, "kda_recurrence_step: heads = ", heads,
           ", head_dim = ", head_dim);
  K3_CHECK(state && q && k && v && g && beta && o, "kda_recurrence_step: null input/output");
  const int64_t D = head_dim;
  std::vector<float> u(static_cast<size_t>(D));  // [head_dim] fp32: the delta-rule update
  for (int h = 0; h < heads; ++h) {
    float* S = state + h * D * D;  // [K][V] fp32
    const float* qh = q + h * D;   // [K] fp32
    const float* kh = k + h * D;   // [K] fp32
    const float* vh = v + h * D;   // [V] fp32
    const float* gh = g + h * D;   // [K] fp32, log decay per key channel
    // 1. Decay the rows (key channels).
    for (int64_t i = 0; i < D; ++i) {
      const float alpha = std::exp(gh[i]);
      for (int64_t j = 0; j < D; ++j) S[i * D + j] *= alpha;
    }
    // 2. u = beta (v - S^T k), against the already-decayed state.
    for (int64_t j = 0; j < D; ++j) u[j] = 0.0f;
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) u[j] += S[i * D + j] * kh[i];
    for (int64_t j = 0; j < D; ++j) u[j] = beta[h] * (vh[j] - u[j]);
    // 3. Rank-one write S += k u^T.
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) S[i * D + j] += kh[i] * u[j];
    // 4. Read with the UPDATED state: o = scale S^T q.
    float* oh = o + h * D;  // [V] fp32
    for (int64_t j = 0; j < D; ++j) oh[j] = 0.0f;
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) oh[j] += S[i * D + j] * qh[i];
    for (int64_t j = 0; j < D; ++j) oh[j] *= scale;
  }
}

void kda_gated_norm(const float* o, const float* z, const float* norm_w, int heads, int head_dim,
                    float eps, float* out) {
  // o, z, out: [heads][head_dim] fp32 (out may alias o); norm_w: [head_dim] fp32, shared
  K3_CHECK(heads > 0 && head_dim > 0, "kda_gated_norm: heads = ", heads, ", head_dim = ", head_dim);
  K3_CHECK(o && z && norm_w && out, "kda_gated_norm: null input/output");
  for (int h = 0; h < heads; ++h) {
    const int64_t off = static_cast<int64_t>(h) * head_dim;
    rms_norm(o + off, norm_w, head_dim, eps, out + off);
    for (int d = 0; d < head_dim; ++d) out[off + d] *= sigmoid(z[off + d]);
  }
}

}  // namespace k3::cpu
