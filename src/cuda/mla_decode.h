// Absorbed MLA decode (spec 3.3) over a paged bf16 latent cache, flash-decoding style: the
// token range of each row is split across CTAs (split-KV), each CTA keeps a per-head running
// (max, sum, acc) for a group of query heads, and a second kernel combines the splits in a
// fixed order (deterministic). MQA over the latent: every query head reads the same cache row,
// so one CTA loads each row once for all heads of its group.
//
// Bytes: the cache dominates. Per row and layer: tokens x (kv_lora + rope) x 2 B = 1152 B per
// token for K3 (512 + 64), independent of the head count; q and o are heads x ~3 KB. At 32k
// context that is 37.7 MB per row per layer; at H200's ~4.0 TB/s achievable HBM bandwidth the
// floor is ~9.4 us per row per layer (TP16, 6 heads per rank: the same bytes, so the same floor;
// the arithmetic, 6 x 2 x 576 FLOP per token for scores + 6 x 2 x 512 for PV, is ~11 FLOP/B, far
// below the tensor cores' ridge, but at the floor ~24 T FMA/s, more than the CUDA cores sustain
// beside the bf16 unpacking: the fp32 split kernel reaches 4-17% of the read curve, the
// tensor-core one 13-61%, bench/RESULTS.md, nineteenth stop). Over K3's 24 MLA
// layers a 32k-context row streams 0.91 GB per decode step: ~226 us per row at 4.0 TB/s. With
// DSA only the selected tokens are read (n_selected x 1152 B, gathered through block_table).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace k3::cuda {

// Host-side launch plan: fixed at plan time from host-known upper bounds, so the grid never
// depends on device-resident lengths (the launch is CUDA-graph safe).
struct MlaDecodePlan {
  int rows = 0;            // batch rows (one query token each)
  int heads = 0;           // query heads on this rank (K3 TP16: 6)
  int kv_lora = 0;         // latent width (K3: 512; else the generic kernel, see below)
  int rope = 0;            // k_pe width (K3: 64)
  int page_size = 0;       // tokens per cache page
  int max_pages = 0;       // block_table row stride
  int max_sel = 0;         // selected row stride (sparse only)
  int64_t max_tokens = 0;  // upper bound of seq_len (dense) or n_selected (sparse) over rows
  // Derived by plan_mla_decode:
  int head_groups = 0;      // CTAs along the head axis
  int heads_per_group = 0;  // <= 16
  int splits = 0;           // CTAs along the token axis
  // Asks for the split kernel on tensor cores (bf16 mma, P as three bf16 terms, every mma's
  // result added in fp32) instead of CUDA cores: 3-9x faster (bench/RESULTS.md, nineteenth
  // stop). The backbone sets it from cuda::mla_tensor_cores() (on by default, K3_MLA_MMA=0 for
  // the fp32 kernel); plan_mla_decode clears it for shapes that take the generic kernel.
  bool tensor_cores = false;
  // Cache tiles in the tensor-core split kernel's shared-memory ring: 2 (one in flight while one
  // is used, two CTAs per SM), or 4 / 5 (three / four in flight, one CTA per SM, half the
  // splits). The backbone sets it from cuda::mla_ring_tiles() (K3_MLA_RING, 2 by default);
  // plan_mla_decode sets 2 where the CUDA-core or generic kernel runs.
  int ring_tiles = 2;
};

// Fills the derived fields for a device with `sm_count` SMs; raises k3::Error on unsupported
// shapes (heads outside [1, 128], page_size < 1, or a latent shape neither 512 / 64 nor generic).
// 512 / 64 (K3) runs the split-KV kernel; any other kv_lora in [8, 1024] (multiple of 8) with
// rope in [0, 128] runs a simple generic kernel (one CTA per (head, row), splits = 1).
MlaDecodePlan plan_mla_decode(MlaDecodePlan p, int sm_count);

// Bytes of fp32 scratch the launch needs: rows x heads x splits x (kv_lora + 2) (the generic
// kernel does not touch it).
size_t mla_decode_workspace_bytes(const MlaDecodePlan& p);

// q_abs:       [rows][heads][kv_lora] bf16 (q~ = W_uk^T q_nope)
// q_pe:        [rows][heads][rope] bf16
// cache:       [num_pages][page_size][kv_lora + rope] bf16 (normed c, then k_pe); 16-B aligned
// block_table: [rows][max_pages] int32 page ids (device)
// seq_len:     [rows] int32 cached tokens per row (device); tokens 0..seq_len-1 are attended
// selected:    [rows][max_sel] int32 token positions, or null for dense (device)
// n_selected:  [rows] int32 (device; ignored when selected is null)
// workspace:   mla_decode_workspace_bytes(plan) bytes, 16-B aligned (device)
// o_latent:    [rows][heads][kv_lora] fp32 (o_bf16 false) or bf16 (o_bf16 true) = sum_t p_t c_t.
// lse:         [rows][heads] fp32 or null: log sum_t exp(scale * score_t), the softmax's
//              normalizer, so partial attentions over disjoint token sets merge exactly
//              (decode context parallelism: dcp_merge_attention).
// A row with no tokens gets o = 0 and lse = -inf. No allocation, no host sync; ordered on
// `stream`.
void mla_decode(const MlaDecodePlan& plan, const __nv_bfloat16* q_abs, const __nv_bfloat16* q_pe,
                const __nv_bfloat16* cache, const int32_t* block_table, const int32_t* seq_len,
                const int32_t* selected, const int32_t* n_selected, float softmax_scale,
                void* workspace, void* o_latent, bool o_bf16, cudaStream_t stream,
                float* lse = nullptr);

}  // namespace k3::cuda
