// K3.1 DSA lightning indexer reference ops (spec 3.5; DeepSeek-V3.2 math without RoPE,
// LayerNorm (or RMSNorm) on the index keys). Index keys are cached in FP8 E4M3 with one fp32
// scale per 128 values after a Hadamard rotation, as the real cache is (132 B for d = 128).
#pragma once

#include <cstdint>

namespace k3::cpu {

// In-place orthonormal Walsh-Hadamard transform (scaled by 1/sqrt(n)); n a power of two.
void hadamard_transform(float* x, int64_t n);

// FP8 E4M3 quantization in blocks of `block` values: scale = amax / 448 (1 when amax = 0),
// q = e4m3(x / scale). q: [n] bytes, scales: [ceil(n / block)].
void quantize_fp8_blocks(const float* x, int64_t n, int64_t block, uint8_t* q, float* scales);
void dequantize_fp8_blocks(const uint8_t* q, const float* scales, int64_t n, int64_t block,
                           float* x);

// The indexer's queries as the keys are cached: each head rotated (Hadamard), then through the
// fp8 block round trip (quantize, dequantize), in place. q: [n_heads][head_dim].
void dsa_prepare_queries(float* q, int64_t n_heads, int64_t head_dim, int64_t block);

// Index scores of one query against T cached keys:
//   I[s] = sum_h head_w[h] * relu(q[h] . k_s)
// q: [n_heads][head_dim], head_w: [n_heads] (weights_proj(x) * n_heads^-1/2 * head_dim^-1/2),
// keys: [T][head_dim]. scores: [T].
void dsa_index_scores(const float* q, const float* head_w, const float* keys, int64_t T,
                      int n_heads, int head_dim, float* scores);

// Indices of the min(k, T) largest scores, ties broken by the lower index; written to idx in
// ascending index order. Returns the count.
int64_t dsa_topk(const float* scores, int64_t T, int64_t k, int64_t* idx);

}  // namespace k3::cpu
