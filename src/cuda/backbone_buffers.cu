#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cuda/backbone_buffers.h"
#include "cuda/dsa_indexer.h"
#include "cuda/router.h"

namespace k3::cuda {

void check_cuda_support(const ModelConfig& cfg, const ModelWeights& w) {
  K3_CHECK(cfg.moe_router_activation_func == "sigmoid",
           "the CUDA router implements the sigmoid router; moe_router_activation_func is \"",
           cfg.moe_router_activation_func, "\"");
  bool any_moe = false;
  for (const LayerWeights& L : w.layers) any_moe = any_moe || L.moe;
  if (any_moe) {
    RouterPlan rp;
    rp.num_experts = static_cast<int>(cfg.num_experts);
    rp.top_k = cfg.num_experts_per_token;
    rp.num_expert_group = cfg.num_expert_group;
    check_router_plan(rp);
  }
  if (cfg.dsa_config.enabled)
    K3_CHECK(cfg.dsa_config.index_rope_dim == 0, "the DSA indexer with RoPE is not supported");
  const int bank = [&] {
    int n = 0;
    for (int l = 0; l < cfg.num_hidden_layers; ++l) n += cfg.is_attn_res_write_layer(l) ? 1 : 0;
    return n;
  }();
  K3_CHECK(bank + 1 <= 16, "AttnRes bank of ", bank, " blocks exceeds the mixing kernel's 16");
  K3_CHECK(cfg.linear_attn_config.short_conv_kernel_size >= 1 &&
               cfg.linear_attn_config.short_conv_kernel_size <= 8,
           "short_conv_kernel_size must be 1..8 on the GPU");
}

namespace {

template <typename T>
DeviceBuffer<T> make(int64_t n) {
  DeviceBuffer<T> b(static_cast<size_t>(std::max<int64_t>(n, 1)));
  b.fill_bytes(0xff);  // NaN / -1 poison: a read before a write shows up in the tests
  return b;
}

int64_t rows_of(const DevMatrix& m) {
  return m.empty() ? 0 : m.rows;
}

}  // namespace

CudaBackbone::Buffers::Buffers(const ModelConfig& cfg, const DeviceWeights& w, int mr,
                               int pages_per_slot, int64_t max_context, size_t mla_workspace,
                               const RankSetup& ranks)
    : max_rows(mr), hidden(cfg.hidden_size) {
  const int64_t R = mr, H = cfg.hidden_size;
  const int64_t XR = R * (ranks.ep() ? ranks.layout.world() : 1);  // expert rows
  int blocks = 0;
  for (int l = 0; l < cfg.num_hidden_layers; ++l) blocks += cfg.is_attn_res_write_layer(l) ? 1 : 0;

  // Widths: the largest over layers, read from the weights.
  int64_t fa = 0, ga = 0, ffn_i = 0, E = 0, L = 0, inter = 0;
  for (const DevLayer& D : w.layers) {
    kda_in_n = std::max(kda_in_n, D.kda.in_layout.ld);
    fa = std::max(fa, rows_of(D.kda.f_a));
    ga = std::max(ga, rows_of(D.kda.g_a));
    ffn_i = std::max({ffn_i, rows_of(D.dense.gate), rows_of(D.moe_w.shared_gate)});
    if (D.moe) {
      E = std::max(E, D.moe_w.gate.rows);
      L = std::max(L, D.moe_w.io);
      inter = std::max(inter, D.moe_w.inter);
    }
  }
  const int64_t kp = cfg.kda_proj_dim(), kh = cfg.linear_attn_config.num_heads;
  const int64_t nh = cfg.num_attention_heads, qhd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim;
  const int64_t kvw = cfg.kv_lora_rank + cfg.qk_rope_head_dim;
  const int64_t k = cfg.num_experts_per_token;

  slots = make<int32_t>(R);
  tokens = make<int32_t>(R);
  keep_kda = make<int32_t>(1);
  row_pos = make<int32_t>(R);
  row_seq = make<int32_t>(R);
  ids = make<int32_t>(R);
  row_table = make<int32_t>(R * pages_per_slot);
  P = make<__nv_bfloat16>(R * H);
  h = make<__nv_bfloat16>(R * H);
  x = make<__nv_bfloat16>(R * H);
  sub = make<__nv_bfloat16>(R * H);
  bank = make<__nv_bfloat16>(std::max(blocks, 1) * R * H);
  kda_u = make<__nv_bfloat16>(R * 3 * kp);
  kda_fa = make<__nv_bfloat16>(R * fa);
  kda_f = make<__nv_bfloat16>(R * kp);
  kda_beta = make<__nv_bfloat16>(R * kh);
  kda_ga = make<__nv_bfloat16>(R * ga);
  kda_z = make<__nv_bfloat16>(R * kp);
  kda_gated = make<__nv_bfloat16>(R * kp);
  mla_r = make<__nv_bfloat16>(R * cfg.q_lora_rank.value_or(0));
  mla_q = make<__nv_bfloat16>(R * nh * qhd);
  mla_kv = make<__nv_bfloat16>(R * kvw);
  mla_q_abs = make<__nv_bfloat16>(R * nh * cfg.kv_lora_rank);
  mla_q_pe = make<__nv_bfloat16>(R * nh * cfg.qk_rope_head_dim);
  mla_o_lat = make<float>(R * nh * cfg.kv_lora_rank);
  mla_gate = make<__nv_bfloat16>(R * nh * cfg.v_head_dim);
  mla_o = make<__nv_bfloat16>(R * nh * cfg.v_head_dim);
  mla_ws = make<uint8_t>(static_cast<int64_t>(mla_workspace));
  if (cfg.dsa_config.enabled) {
    const auto& d = cfg.dsa_config;
    dsa_key = make<__nv_bfloat16>(R * d.index_head_dim);
    dsa_q = make<__nv_bfloat16>(R * d.index_n_heads * d.index_head_dim);
    dsa_w = make<__nv_bfloat16>(R * d.index_n_heads);
    dsa_scores = make<float>(R * max_context);
    dsa_sel = make<int32_t>(R * d.index_topk);
    dsa_nsel = make<int32_t>(R);
    dsa_ws =
        make<uint8_t>(static_cast<int64_t>(dsa_topk_workspace_bytes(R, max_context, d.index_topk)));
    dsa_ws.fill_bytes(0);  // dsa_topk leaves it zeroed after every call
  }
  router_logits = make<float>(R * E);
  expert_ids = make<int32_t>(R * k);
  expert_w = make<float>(R * k);
  group_expert = make<int32_t>(E);
  group_offsets = make<int32_t>(E + 1);
  group_rows = make<int32_t>(XR * k);
  group_pos = make<int32_t>(XR * k);
  route_done = make<int32_t>(1);
  route_done.fill_bytes(0);  // the counter starts (and every launch leaves it) at zero
  moe_z = make<__nv_bfloat16>(R * L);
  moe_g32 = make<float>(XR * k * inter);
  moe_u32 = make<float>(XR * k * inter);
  moe_h = make<__nv_bfloat16>(XR * k * inter);
  moe_y = make<__nv_bfloat16>(XR * k * L);
  moe_acc = make<__nv_bfloat16>(R * L);
  moe_routed = make<__nv_bfloat16>(R * H);
  ffn_h = make<__nv_bfloat16>(R * ffn_i);
  shared = make<__nv_bfloat16>(R * H);
  kda_in = make<__nv_bfloat16>(R * kda_in_n);
  moe_gu32 = make<float>(XR * k * 2 * inter);
  ffn_gu32 = make<float>(R * 2 * ffn_i);
  shared_h = make<__nv_bfloat16>(R * ffn_i);
  logits = make<float>(R * cfg.vocab_size);
  in_hidden = make<__nv_bfloat16>(R * H);
  fuse_cat = make<__nv_bfloat16>(R * 2 * H);

  if (!ranks.any()) return;
  red = make<float>(R * H);
  shared32 = make<float>(R * H);
  moe_y32 = make<float>(R * k * L);
  if (ranks.ep()) {
    const int64_t W = ranks.layout.world();
    ep_z = make<__nv_bfloat16>(W * R * L);
    ep_ids = make<int32_t>(W * R * k);
    ep_pairs = make<__nv_bfloat16>(W * R * k * L);
    ep_own = make<__nv_bfloat16>(R * k * L);
  }
  if (ranks.dcp()) {
    const int64_t D = ranks.layout.dcp, kvl = cfg.kv_lora_rank;
    dcp_pos = make<int32_t>(R);
    dcp_seq = make<int32_t>(D * R);
    dcp_table = make<int32_t>(D * R * pages_per_slot);
    dcp_q_abs = make<__nv_bfloat16>(D * R * nh * kvl);
    dcp_q_pe = make<__nv_bfloat16>(D * R * nh * cfg.qk_rope_head_dim);
    dcp_o = make<float>(D * R * nh * kvl);
    dcp_o_recv = make<float>(D * R * nh * kvl);
    dcp_lse = make<float>(D * R * nh);
    dcp_lse_recv = make<float>(D * R * nh);
  }
}

}  // namespace k3::cuda
