// The small kernels around the collectives of a multi-rank step (cuda/backbone_ranks.cu): the
// end of a TP partial sum, expert-parallel pair bookkeeping, and decode context parallelism's
// row values and log-sum-exp merge. Each is the GPU form of a step of parallel/*.cpp (the CPU
// multi-rank reference). No allocation, no host sync: per-step values come from device memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

// The end of a sharded sublayer once its fp32 partial outputs are summed over the TP ranks
// (the CPU rounds once after the sum): out = bf16(sum); with res, the residual as the fused
// GEMM epilogue does it: res = res_copy ? out : bf16(res + out).
// sum: [n] fp32; out, res: [n] bf16 (device).
void finish_tp_sum(const float* sum, int64_t n, __nv_bfloat16* out, __nv_bfloat16* res,
                   bool res_copy, cudaStream_t stream);

// Expert parallelism, after every rank's rows were gathered: ids [ranks][rows][top_k] int32 of
// `ranks` source ranks. A source's rows are replicated over the tp ranks of its replica, so pair
// p = r * top_k + j of source s is computed for tp rank p % tp only (s % tp == p % tp); the
// other copies get id -1 (no rank's expert: left out of every grouping and summed as zero).
void ep_keep_own_pairs(int32_t* ids, int ranks, int64_t rows, int top_k, int tp,
                       cudaStream_t stream);

// Expert outputs back to (row, choice) order: pairs[p] = position[p] >= 0 ? grouped[position[p]]
// : 0. grouped: [*][width] bf16 (expert-grouped order, moe_group_by_expert's positions);
// position: [n_pairs] int32; pairs: [n_pairs][width] bf16 (device).
void pairs_from_grouped(const __nv_bfloat16* grouped, const int32_t* position, int64_t n_pairs,
                        int64_t width, __nv_bfloat16* pairs, cudaStream_t stream);

// Decode context parallelism over `dcp` ranks (this one `rank`): token t is cached on rank
// t % dcp at local index t / dcp. From the rows' global positions (prepare_rows):
//   local_pos[r]               = position[r] / dcp if position[r] % dcp == rank, else -1 (the
//                                row's new token is cached elsewhere: the append skips it)
//   seq_rep[c * rows + r]      = tokens of row r's context this rank holds, (position + dcp -
//                                rank) / dcp, for every c < dcp
//   table_rep[c * rows + r][:] = table[r][:]  ([dcp * rows][pages])
// so one attention launch covers every rank's queries (dcp * rows rows) over this rank's tokens.
void dcp_rows(const int32_t* position, const int32_t* table, int64_t rows, int pages, int dcp,
              int rank, int32_t* local_pos, int32_t* seq_rep, int32_t* table_rep,
              cudaStream_t stream);

// Merges the partial attentions of `parts` ranks over disjoint token sets (flash-decoding's
// log-sum-exp merge, summed in rank order): out[r][h] = sum_c e^(lse_c - M) o_c / sum_c
// e^(lse_c - M), M = max_c lse_c, over c with tokens (lse > -inf); a row no rank holds a token
// of gets 0.
// o: [parts][rows][heads][width] fp32; lse: [parts][rows][heads] fp32; out: [rows][heads][width]
void dcp_merge_attention(const float* o, const float* lse, int parts, int64_t rows, int heads,
                         int width, float* out, cudaStream_t stream);

}  // namespace k3::cuda
