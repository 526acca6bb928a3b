// k3_bench_attn's DSA indexer cases (bench_dsa.cu), at K3.1's shape: index_n_heads 32,
// index_head_dim 128 (132 cached bytes per key: fp8 + one fp32 scale), top 2048.
#pragma once

#include "attn_harness.h"
#include "core/rng.h"

namespace k3::bench {

// dsa_index_scores over `rows` rows of ctx cached keys each, on CUDA cores or (mma) fp8 tensor
// cores. Bytes: keys + q + head weights + the scores written. Check: row 0's first 4096 tokens
// against the CPU (cpu::dsa_prepare_queries, cpu::dsa_index_scores), max |gpu - cpu| over the
// token's magnitude sum_h |w_h| sum_j |q_hj k_j| (the GPU tests' bound).
void bench_dsa_scores(Timer& t, int rows, int ctx, bool mma, Rng& rng);

// dsa_topk of rows x ctx fp32 scores, split (two multi-CTA kernels) or one CTA per row. Bytes:
// the scores once. Check: row 0's selection against cpu::dsa_topk.
void bench_dsa_topk(Timer& t, int rows, int ctx, bool split, Rng& rng);

}  // namespace k3::bench
