// K3.1 DSA lightning indexer on the GPU (CPU reference: cpu/ops_dsa.h and dsa_select in
// cpu/layer_mla.cpp): the paged fp8 index-key cache append, the index scores
// I[s] = sum_h w_h relu(q_h . k_s), and the exact top-k selection over them.
//
// Numerics: the key path (norm, Hadamard, block fp8) and the query path (Hadamard, fp8 round
// trip) use the CPU's operation order with round-to-nearest fp32 ops (no FMA contraction), so
// key bytes, key scales and dequantized queries equal the CPU's bit for bit. Only the score dot
// products sum in a different order (fp32, ~1e-6 relative).
//
// Bytes per decode row: key append hd + 4 * blocks (132 B for K3.1); scores read
// seq_len x 132 B of keys (131072 tokens: 17 MB per row per layer) plus nh x hd x 2 B of q;
// the split top-k reads the scores twice (1 MB per row at 131072 tokens), then its candidates.
// Measured on an H100 at K3.1 shapes (nh 32, hd 128): scores on fp8 tensor cores 14.5 / 22 us
// per row at 32768 / 131072 tokens (CUDA cores: 130 / 214 us, bound by the per-head warp
// reductions); top-2048 split 19 / 26 us, one CTA per row 61 / 289 us (bench/RESULTS.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace k3::cuda {

// Normalizes, rotates and quantizes row r's index key into the cache at position[r] (page
// block_table[r][pos / page_size], slot pos % page_size); rows with position < 0 or outside the
// block table are skipped. Norm: LayerNorm with weight and bias (norm_b non-null) or RMSNorm
// (norm_b null), eps as given (the model's rms_norm_eps). hd: a power of two in [32, 1024];
// scale blocks of min(hd, 128) values (cpu::index_scale_blocks).
// key:         [rows][hd] bf16 (wk output, already bf16 as the CPU rounds it)
// norm_w:      [hd] fp32; norm_b: [hd] fp32 or null (device)
// block_table: [rows][max_pages] int32; position: [rows] int32 (device)
// key_cache:   [num_pages][page_size][hd] E4M3
// scale_cache: [num_pages][page_size][blocks] fp32
void dsa_index_key_append(const __nv_bfloat16* key, int64_t rows, int hd, const float* norm_w,
                          const float* norm_b, float eps, const int32_t* block_table, int max_pages,
                          const int32_t* position, int page_size, uint8_t* key_cache,
                          float* scale_cache, cudaStream_t stream);

// scores[r][s] for s < min(seq_len[r], max_tokens); other entries are not written. The grid
// comes from host bounds (rows, max_tokens); lengths come from the device.
// q:       [rows][nh][hd] bf16 (wq_b output); head_w: [rows][nh] bf16 (weights_proj output)
// head_scale: 1 / sqrt(nh * hd); nh * hd <= 12288
// scores:  [rows][max_tokens] fp32
// tensor_cores: where hd is 128 and nh a multiple of 16 up to 64 (K3.1: 32 x 128), the scores as
// one fp8 mma GEMM of the E4M3 queries and keys (dsa_scores_mma.cu; the backbone passes
// cuda::dsa_tensor_cores(), on unless K3_DSA_MMA=0); other shapes take the
// CUDA-core kernel either way.
void dsa_index_scores(const __nv_bfloat16* q, const __nv_bfloat16* head_w, float head_scale,
                      int64_t rows, int nh, int hd, const uint8_t* key_cache,
                      const float* scale_cache, const int32_t* block_table, int max_pages,
                      const int32_t* seq_len, int page_size, float* scores, int64_t max_tokens,
                      bool tensor_cores, cudaStream_t stream);

// Workspace bytes dsa_topk needs for up to `rows` rows of `stride` scores: per row a histogram,
// counters, a bitmap of the scores and a candidate list (~4.1 B per score).
size_t dsa_topk_workspace_bytes(int64_t rows, int64_t stride, int topk);

// Per row, T = min(seq_len[r], stride): the indices of the min(topk, T) largest scores, ties
// broken by the lower index (cpu::dsa_topk's set), in ascending order; selected[r][m..topk)
// = -1, n_selected[r] = m. -0 and +0 are equal scores, as on the CPU; NaN scores are not
// supported (the CPU raises on them). split (dsa_topk.cu; the backbone passes
// cuda::dsa_topk_split(), on unless K3_DSA_TOPK_SPLIT=0; 3-10x faster): many CTAs per row,
// a histogram of the keys' top bits, then the scores above the threshold bin into a bitmap and a
// radix select among those in it. Else one CTA per row: 4 radix-select passes over the
// order-preserving bits, then an ordered compaction (workspace unused). rows <= 65535.
// scores:    [rows][stride] fp32; seq_len: [rows] int32 (device)
// selected:  [rows][topk] int32; n_selected: [rows] int32
// workspace: dsa_topk_workspace_bytes(rows, stride, topk) bytes, zeroed once before the first
//            split call (every call leaves it zeroed); one stream at a time
void dsa_topk(const float* scores, int64_t stride, const int32_t* seq_len, int64_t rows, int topk,
              int32_t* selected, int32_t* n_selected, void* workspace, bool split,
              cudaStream_t stream);

}  // namespace k3::cuda
