// DSA lightning indexer reference ops (spec 3.5). The indexer only decides WHICH cached tokens
// the MLA attends to; its numerics matter for the selection, not for the attention values.
#include "cpu/ops_dsa.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"

namespace k3::cpu {

void hadamard_transform(float* x, int64_t n) {
  // x: [n], transformed in place.
  K3_CHECK(n > 0 && (n & (n - 1)) == 0, "Hadamard transform needs a power-of-two length, got ", n);
  // Sylvester butterflies: after the pass with half-width h, every aligned 2h block holds the
  // unnormalised WHT of its input. log2(n) passes, n/2 butterflies each.
  for (int64_t h = 1; h < n; h *= 2) {
    for (int64_t i = 0; i < n; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  // 1/sqrt(n) makes it orthonormal (and its own inverse), so dot products are preserved.
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) x[i] *= norm;
}

void quantize_fp8_blocks(const float* x, int64_t n, int64_t block, uint8_t* q, float* scales) {
  // x: [n] fp32, q: [n] E4M3 codes, scales: [ceil(n / block)] fp32.
  K3_CHECK(n >= 0 && block > 0, "FP8 block quantization: bad n=", n, " block=", block);
  for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    const int64_t b1 = std::min(n, b0 + block);
    float amax = 0.0f;
    for (int64_t i = b0; i < b1; ++i) {
      // A non-finite key would poison every index score computed against it.
      K3_CHECK(std::isfinite(x[i]), "FP8 block quantization: non-finite input ", x[i], " at ", i);
      amax = std::max(amax, std::fabs(x[i]));
    }
    // amax maps to the largest E4M3 magnitude; an all-zero block keeps scale 1 (q = 0 anyway).
    const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
    scales[bi] = scale;
    for (int64_t i = b0; i < b1; ++i) q[i] = float_to_e4m3(x[i] / scale);
  }
}

void dequantize_fp8_blocks(const uint8_t* q, const float* scales, int64_t n, int64_t block,
                           float* x) {
  // q: [n] E4M3 codes, scales: [ceil(n / block)] fp32, x: [n] fp32.
  K3_CHECK(n >= 0 && block > 0, "FP8 block dequantization: bad n=", n, " block=", block);
  for (int64_t i = 0; i < n; ++i) x[i] = e4m3_to_float(q[i]) * scales[i / block];
}

void dsa_prepare_queries(float* q, int64_t n_heads, int64_t head_dim, int64_t block) {
  K3_CHECK(n_heads > 0 && head_dim > 0 && block > 0, "DSA queries: bad n_heads=", n_heads,
           " head_dim=", head_dim, " block=", block);
  std::vector<uint8_t> q8(static_cast<size_t>(head_dim));
  std::vector<float> qs(static_cast<size_t>((head_dim + block - 1) / block));
  for (int64_t h = 0; h < n_heads; ++h) {
    float* qh = q + h * head_dim;  // [head_dim]
    hadamard_transform(qh, head_dim);
    quantize_fp8_blocks(qh, head_dim, block, q8.data(), qs.data());
    dequantize_fp8_blocks(q8.data(), qs.data(), head_dim, block, qh);
  }
}

void dsa_index_scores(const float* q, const float* head_w, const float* keys, int64_t T,
                      int n_heads, int head_dim, float* scores) {
  // q: [n_heads][head_dim], head_w: [n_heads], keys: [T][head_dim], scores: [T].
  K3_CHECK(n_heads > 0 && head_dim > 0 && T >= 0, "DSA index scores: bad n_heads=", n_heads,
           " head_dim=", head_dim, " T=", T);
  for (int64_t s = 0; s < T; ++s) {
    const float* k = keys + s * head_dim;  // [head_dim], one key shared by all index heads
    float acc = 0.0f;
    for (int h = 0; h < n_heads; ++h) {
      const float* qh = q + static_cast<int64_t>(h) * head_dim;  // [head_dim]
      float d = 0.0f;
      for (int j = 0; j < head_dim; ++j) d += qh[j] * k[j];
      // ReLU before the head weight: a head only votes for keys it matches positively.
      acc += head_w[h] * std::max(d, 0.0f);
    }
    scores[s] = acc;
  }
}

int64_t dsa_topk(const float* scores, int64_t T, int64_t k, int64_t* idx) {
  // scores: [T], idx: [min(k, T)] out, ascending token index.
  K3_CHECK(T >= 0 && k >= 0, "DSA top-k: bad T=", T, " k=", k);
  for (int64_t s = 0; s < T; ++s)
    K3_CHECK(!std::isnan(scores[s]), "DSA top-k: NaN index score at token ", s);
  const int64_t m = std::min(k, T);
  if (m == T) {  // everything is selected: no ranking needed
    std::iota(idx, idx + T, int64_t{0});
    return T;
  }
  std::vector<int64_t> order(static_cast<size_t>(T));
  std::iota(order.begin(), order.end(), int64_t{0});
  // Strict total order (score descending, then index ascending): the selected set is unique,
  // so CPU and GPU must pick the same tokens even with tied scores.
  const auto better = [scores](int64_t a, int64_t b) {
    if (scores[a] != scores[b]) return scores[a] > scores[b];
    return a < b;
  };
  std::nth_element(order.begin(), order.begin() + m, order.end(), better);
  std::sort(order.begin(), order.begin() + m);
  std::copy(order.begin(), order.begin() + m, idx);
  return m;
}

}  // namespace k3::cpu
