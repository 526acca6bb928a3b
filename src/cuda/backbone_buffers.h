// Activation buffers of the stock CUDA decode step, allocated once for max_rows rows (a step
// never allocates), and the model features the step supports.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/backbone.h"
#include "cuda/device_buffer.h"
#include "cuda/device_weights.h"
#include "model/config.h"
#include "model/model_weights.h"

namespace k3::cuda {

// Raises k3::Error naming the first feature of cfg / w the CUDA step cannot run.
void check_cuda_support(const ModelConfig& cfg, const ModelWeights& w);

struct CudaBackbone::Buffers {
  // ranks: the multi-rank role (RankSetup), which sizes the expert rows (ep_ranks = the EP
  // world or 1) and the rank buffers below.
  Buffers(const ModelConfig& cfg, const DeviceWeights& w, int max_rows, int pages_per_slot,
          int64_t max_context, size_t mla_workspace, const RankSetup& ranks);

  int64_t max_rows = 0, hidden = 0;
  // Step inputs and per-row values derived on the device.
  DeviceBuffer<int32_t> slots, tokens;     // [rows] int32
  DeviceBuffer<int32_t> keep_kda;          // [1] int32: nonzero = write KDA snapshots this step
  DeviceBuffer<int32_t> row_pos, row_seq;  // [rows] int32
  DeviceBuffer<int32_t> row_table;         // [rows][pages_per_slot] int32
  DeviceBuffer<int32_t> ids;               // [rows] int32 greedy ids
  // Residual stream and the AttnRes bank.
  DeviceBuffer<__nv_bfloat16> P, h, x, sub;  // [rows][hidden] bf16
  DeviceBuffer<__nv_bfloat16> bank;          // [blocks][rows][hidden] bf16
  __nv_bfloat16* bank_block(int j) {
    return bank.data() + static_cast<int64_t>(j) * max_rows * hidden;
  }
  // KDA.
  DeviceBuffer<__nv_bfloat16> kda_u;      // [rows][3][P] bf16
  DeviceBuffer<__nv_bfloat16> kda_fa;     // [rows][f_a rows] bf16
  DeviceBuffer<__nv_bfloat16> kda_f;      // [rows][P] bf16
  DeviceBuffer<__nv_bfloat16> kda_beta;   // [rows][heads] bf16
  DeviceBuffer<__nv_bfloat16> kda_ga;     // [rows][g_a rows] bf16
  DeviceBuffer<__nv_bfloat16> kda_z;      // [rows][P] bf16
  DeviceBuffer<__nv_bfloat16> kda_gated;  // [rows][P] bf16
  // MLA (+ DSA).
  DeviceBuffer<__nv_bfloat16> mla_r;      // [rows][q_lora] bf16
  DeviceBuffer<__nv_bfloat16> mla_q;      // [rows][heads][nope + rope] bf16
  DeviceBuffer<__nv_bfloat16> mla_kv;     // [rows][kv_lora + rope] bf16
  DeviceBuffer<__nv_bfloat16> mla_q_abs;  // [rows][heads][kv_lora] bf16
  DeviceBuffer<__nv_bfloat16> mla_q_pe;   // [rows][heads][rope] bf16
  DeviceBuffer<float> mla_o_lat;          // [rows][heads][kv_lora] fp32
  DeviceBuffer<__nv_bfloat16> mla_gate;   // [rows][heads * v] bf16
  DeviceBuffer<__nv_bfloat16> mla_o;      // [rows][heads * v] bf16
  DeviceBuffer<uint8_t> mla_ws;           // mla_decode workspace
  DeviceBuffer<__nv_bfloat16> dsa_key;    // [rows][index_head_dim] bf16
  DeviceBuffer<__nv_bfloat16> dsa_q;      // [rows][index_n_heads][index_head_dim] bf16
  DeviceBuffer<__nv_bfloat16> dsa_w;      // [rows][index_n_heads] bf16
  DeviceBuffer<float> dsa_scores;         // [rows][max_context] fp32
  DeviceBuffer<int32_t> dsa_sel;          // [rows][index_topk] int32
  DeviceBuffer<int32_t> dsa_nsel;         // [rows] int32
  DeviceBuffer<uint8_t> dsa_ws;           // dsa_topk's workspace (zeroed)
  // MoE and dense FFN.
  DeviceBuffer<float> router_logits;  // [rows][E] fp32
  DeviceBuffer<int32_t> expert_ids;   // [rows][top_k] int32
  DeviceBuffer<float> expert_w;       // [rows][top_k] fp32
  // The pairs grouped by expert (moe_dispatch.h): one grouped-GEMM slot per expert. Expert rows
  // (xrows) are the step's rows, or under EP every rank's: ep_ranks x rows.
  DeviceBuffer<int32_t> group_expert;      // [E] int32 expert id or -1
  DeviceBuffer<int32_t> group_offsets;     // [E + 1] int32
  DeviceBuffer<int32_t> group_rows;        // [xrows * top_k] int32 token row per grouped position
  DeviceBuffer<int32_t> group_pos;         // [xrows * top_k] int32 grouped position of (r, j)
  DeviceBuffer<int32_t> route_done;        // [1] int32 router_topk_grouped's CTA counter (0)
  DeviceBuffer<__nv_bfloat16> moe_z;       // [rows][L] bf16 latent input
  DeviceBuffer<float> moe_g32, moe_u32;    // [xrows * top_k][inter] fp32 gate / up outputs
  DeviceBuffer<__nv_bfloat16> moe_h;       // [xrows * top_k][inter] bf16 activation
  DeviceBuffer<__nv_bfloat16> moe_y;       // [xrows * top_k][L] bf16, expert-grouped order
  DeviceBuffer<__nv_bfloat16> moe_acc;     // [rows][L] bf16
  DeviceBuffer<__nv_bfloat16> moe_routed;  // [rows][hidden] bf16
  DeviceBuffer<__nv_bfloat16> ffn_h;       // [rows][max(dense I, shared I)] bf16
  DeviceBuffer<__nv_bfloat16> shared;      // [rows][hidden] bf16
  // Outputs of the concatenated GEMMs (both paths). Gate / up outputs stay fp32 up to the
  // activation (cpu glu_mlp rounds only its output).
  int64_t kda_in_n = 0;                  // widest KDA in_proj row stride (in_layout.ld)
  DeviceBuffer<__nv_bfloat16> kda_in;    // [rows][kda_in_n] bf16
  DeviceBuffer<float> moe_gu32;          // [xrows * top_k][2 * inter] fp32, w1 | w3 outputs
  DeviceBuffer<float> ffn_gu32;          // [rows][2 * max(dense I, shared I)] fp32, gate | up
  DeviceBuffer<__nv_bfloat16> shared_h;  // [rows][shared I] bf16 (the specialized side stream)
  DeviceBuffer<float> logits;            // [rows][vocab] fp32
  // A draft model's fused input (FusedInputWeights): the given hidden rows and the concat.
  DeviceBuffer<__nv_bfloat16> in_hidden;  // [rows][hidden] bf16
  DeviceBuffer<__nv_bfloat16> fuse_cat;   // [rows][2 * hidden] bf16
  // One rank of a multi-rank layout (RankSetup): partial sums before their TP all-reduce,
  // the EP exchange and DCP's attention pieces (allocated only when the layout uses them).
  DeviceBuffer<float> red;                // [rows][hidden] fp32 o_proj / down partial sums
  DeviceBuffer<float> shared32;           // [rows][hidden] fp32 shared experts' partial output
  DeviceBuffer<float> moe_y32;            // [rows * top_k][L] fp32 TP-sliced experts' partials
  DeviceBuffer<__nv_bfloat16> ep_z;       // [ep_ranks * rows][L] bf16 gathered expert inputs
  DeviceBuffer<int32_t> ep_ids;           // [ep_ranks * rows][top_k] int32 gathered expert ids
  DeviceBuffer<__nv_bfloat16> ep_pairs;   // [ep_ranks * rows * top_k][L] bf16 outputs, pair order
  DeviceBuffer<__nv_bfloat16> ep_own;     // [rows * top_k][L] bf16 this rank's pairs' outputs
  DeviceBuffer<int32_t> dcp_pos;          // [rows] int32 local cache index or -1
  DeviceBuffer<int32_t> dcp_seq;          // [dcp * rows] int32 local context lengths
  DeviceBuffer<int32_t> dcp_table;        // [dcp * rows][pages_per_slot] int32
  DeviceBuffer<__nv_bfloat16> dcp_q_abs;  // [dcp * rows][heads][kv_lora] bf16 gathered queries
  DeviceBuffer<__nv_bfloat16> dcp_q_pe;   // [dcp * rows][heads][rope] bf16
  DeviceBuffer<float> dcp_o, dcp_o_recv;  // [dcp * rows][heads][kv_lora] fp32 partials
  DeviceBuffer<float> dcp_lse, dcp_lse_recv;  // [dcp * rows][heads] fp32
};

}  // namespace k3::cuda
