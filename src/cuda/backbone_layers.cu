// The per-layer blocks of the stock CUDA step, each the GPU form of one cpu/layer_*.cpp
// function over a batch of rows: reads b.x (the normed layer input), writes b.sub.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "cuda/backbone.h"
#include "cuda/backbone_buffers.h"
#include "cuda/backbone_ops.h"
#include "cuda/glu.h"
#include "cuda/kda_decode.h"
#include "cuda/latent_cache.h"
#include "cuda/linear_mxfp4.h"
#include "cuda/mla_decode.h"
#include "cuda/moe_dispatch.h"
#include "cuda/rms_norm.h"
#include "cuda/router.h"
#include "cuda/step_ops.h"

namespace k3::cuda {

GluAct glu_act(const ModelConfig& cfg) {
  GluAct a;
  if (cfg.hidden_act == "situ") {
    a.kind = GluAct::Kind::SiTU;
    a.beta = cfg.activation_situ_beta;
    a.has_linear_beta = cfg.activation_situ_linear_beta.has_value();
    a.linear_beta = cfg.activation_situ_linear_beta.value_or(0.0f);
  }
  return a;
}

int expected_active_experts(int local, int E, int top_k, int64_t rows, int slots) {
  const double p_miss = std::pow(1.0 - static_cast<double>(top_k) / E, static_cast<double>(rows));
  const int want = static_cast<int>(std::ceil(local * (1.0 - p_miss) - 1e-9));
  return std::clamp(want, 1, std::max(1, slots));
}

namespace {

// The MXFP4 grouped-GEMM arguments of expert tables w / scales over the groups.
Mxfp4Grouped mxfp4_groups(const void* const* w, const uint8_t* const* scales,
                          const ExpertGroups& eg, const int32_t* row_index) {
  Mxfp4Grouped g;
  g.packed = reinterpret_cast<const uint8_t* const*>(w);
  g.scales = scales;
  g.slot_expert = eg.slot_expert;
  g.slot_offsets = eg.offsets;
  g.row_index = row_index;
  g.n_slots = eg.n_slots;
  g.max_rows_per_slot = eg.max_rows;
  g.expected_active = eg.expected_active;
  g.slots_ready = eg.slots_ready;
  return g;
}

}  // namespace

void expert_linear(WeightFormat fmt, const void* const* w, const uint8_t* const* scales,
                   const ExpertGroups& eg, bool gather, const __nv_bfloat16* x, int64_t ldx,
                   int64_t N, int64_t K, void* y, bool y_fp32, cudaStream_t stream) {
  const int32_t* row_index = gather ? eg.row_index : nullptr;
  if (fmt == WeightFormat::MXFP4) {
    linear_mxfp4_grouped(mxfp4_groups(w, scales, eg, row_index), x, ldx, N, K, y, N, y_fp32,
                         stream);
  } else {
    Bf16Grouped g;
    g.w = reinterpret_cast<const __nv_bfloat16* const*>(w);
    g.slot_expert = eg.slot_expert;
    g.slot_offsets = eg.offsets;
    g.row_index = row_index;
    g.n_slots = eg.n_slots;
    linear_bf16_grouped(g, x, ldx, N, K, y, N, y_fp32, stream);
  }
}

bool expert_down_glu(const DevMoe& m, const ExpertGroups& eg, const GluAct& act, const float* gu,
                     int64_t ld_gu, int64_t up, void* y, bool y_fp32, cudaStream_t stream) {
  if (m.expert_format != WeightFormat::MXFP4) return false;
  const Mxfp4Grouped g = mxfp4_groups(m.w2, m.w2_scales, eg, nullptr);
  if (!grouped_glu_supported(g, m.inter, gu, ld_gu, up)) return false;
  linear_mxfp4_grouped_glu(g, gu, ld_gu, up, act, m.io, m.inter, y, m.io, y_fp32, stream);
  return true;
}

// Every projection of x a KDA layer reads, both paths: where the weights are concatenated one
// GEMM over [rows][q | k | v | g | f_a | b] (the KDA kernel reads its inputs there in place, by
// row strides), f_b (and the LoRA gate's g_b) from its parts; else one GEMM per matrix.
KdaProjected CudaBackbone::kda_project(int l, int64_t R) {
  Buffers& b = *buf_;
  const DevKda& k = weights_->layers[static_cast<size_t>(l)].kda;
  const auto& la = cfg_.linear_attn_config;
  const int64_t H = cfg_.hidden_size, P = cfg_.kda_proj_dim();
  if (k.in_proj.empty()) {
    // Pre-conv q, k, v side by side: [rows][3][P].
    linear(k.q_proj, b.x.data(), H, R, b.kda_u.data(), 3 * P, false, stream_);
    linear(k.k_proj, b.x.data(), H, R, b.kda_u.data() + P, 3 * P, false, stream_);
    linear(k.v_proj, b.x.data(), H, R, b.kda_u.data() + 2 * P, 3 * P, false, stream_);
    linear(k.f_a, b.x.data(), H, R, b.kda_fa.data(), k.f_a.rows, false, stream_);
    linear(k.f_b, b.kda_fa.data(), k.f_a.rows, R, b.kda_f.data(), P, false, stream_);
    linear(k.b_proj, b.x.data(), H, R, b.kda_beta.data(), la.num_heads, false, stream_);
    if (!k.g_proj.empty()) {
      linear(k.g_proj, b.x.data(), H, R, b.kda_z.data(), P, false, stream_);
    } else {
      linear(k.g_a, b.x.data(), H, R, b.kda_ga.data(), k.g_a.rows, false, stream_);
      linear(k.g_b, b.kda_ga.data(), k.g_a.rows, R, b.kda_z.data(), P, false, stream_);
    }
    return {b.kda_u.data(), b.kda_beta.data(), b.kda_z.data(), KdaDecodeStrides{}};
  }
  const KdaInProjLayout& in = k.in_layout;
  const int64_t n = in.ld;  // row stride
  K3_CHECK(in.q == 0 && in.k == P && in.v == 2 * P, "KDA in_proj: q, k, v must lead the rows");
  linear(k.in_proj, b.x.data(), H, R, b.kda_in.data(), n, false, stream_);
  linear(k.f_b, b.kda_in.data() + in.fa, n, R, b.kda_f.data(), P, false, stream_);
  KdaProjected out{b.kda_in.data(), b.kda_in.data() + in.b, b.kda_in.data() + in.g, {}};
  int64_t z_ld = n;
  if (!k.g_a.empty()) {  // LoRA output gate: g_b of the g_a rows
    linear(k.g_b, b.kda_in.data() + in.g, n, R, b.kda_z.data(), P, false, stream_);
    out.z = b.kda_z.data();
    z_ld = P;
  }
  out.strides.u = n;
  out.strides.f = P;
  out.strides.beta = n;
  out.strides.z = z_ld;
  return out;
}

void CudaBackbone::attn_kda(int l, int64_t R, const LinearEpilogue& out, bool warm_o_proj) {
  const DevKda& k = weights_->layers[static_cast<size_t>(l)].kda;
  mark("kda_proj");
  const KdaProjected in = kda_project(l, R);
  mark("kda_core");
  // The recurrence is latency-bound (a few CTAs per row): warm o_proj into L2 beside it.
  if (warm_o_proj) {
    fork_side();
    prefetch_l2({&k.o_proj});
  }
  kda_core(l, R, in.u, in.beta, in.z, in.strides);
  if (warm_o_proj) join_side();
  mark("attn_o_proj");
  project_out(k.o_proj, buf_->kda_gated.data(), cfg_.kda_proj_dim(), R, out);
}

void CudaBackbone::kda_core(int l, int64_t R, const __nv_bfloat16* u, const __nv_bfloat16* beta,
                            const __nv_bfloat16* z, const KdaDecodeStrides& strides) {
  Buffers& b = *buf_;
  const DevKda& k = weights_->layers[static_cast<size_t>(l)].kda;
  const auto& la = cfg_.linear_attn_config;
  KdaDecodeWeights w;
  w.conv = k.conv;
  w.dt_bias = k.dt_bias;
  w.a_log = k.a_log;
  w.o_norm = k.o_norm;
  w.gate_lower_bound = la.gate_lower_bound.value_or(std::numeric_limits<float>::quiet_NaN());
  w.eps = cfg_.rms_norm_eps;
  w.scale = 1.0f / std::sqrt(static_cast<float>(la.head_dim));
  KdaDecodeShape shape;
  shape.rows = R;
  shape.heads = la.num_heads;
  shape.head_dim = la.head_dim;
  shape.kernel = la.short_conv_kernel_size;
  // Verify steps keep each run's state after every token but its last (SlotPool's copies).
  KdaSnapshots snap;
  if (pool_->snapshots() > 0) {
    snap.conv = pool_->conv_snapshots(l);
    snap.state = pool_->recurrent_snapshots(l);
    snap.slots = pool_->slots();
    snap.count = pool_->snapshots();
    snap.enabled = b.keep_kda.data();
  }
  if (pool_->recurrent_dtype() == DType::F32)
    kda_decode_step(u, b.kda_f.data(), beta, z, w, b.slots.data(), pool_->conv(l),
                    static_cast<float*>(pool_->recurrent(l)), b.kda_gated.data(), shape, stream_,
                    strides, snap);
  else
    kda_decode_step(u, b.kda_f.data(), beta, z, w, b.slots.data(), pool_->conv(l),
                    static_cast<__nv_bfloat16*>(pool_->recurrent(l)), b.kda_gated.data(), shape,
                    stream_, strides, snap);
}

const __nv_bfloat16* CudaBackbone::gate_projection(const DevMla& m, int64_t R,
                                                   cudaStream_t stream) {
  if (m.g_proj.empty()) return nullptr;
  Buffers& b = *buf_;
  linear(m.g_proj, b.x.data(), cfg_.hidden_size, R, b.mla_gate.data(),
         static_cast<int64_t>(cfg_.num_attention_heads) * cfg_.v_head_dim, false, stream);
  return b.mla_gate.data();
}

void CudaBackbone::attn_mla(int l, int64_t R, const LinearEpilogue& out, bool kv_beside) {
  Buffers& b = *buf_;
  const DevMla& m = weights_->layers[static_cast<size_t>(l)].mla;
  const int64_t H = cfg_.hidden_size;
  const int nh = cfg_.num_attention_heads, nope = cfg_.qk_nope_head_dim;
  const int rope = cfg_.qk_rope_head_dim, vd = cfg_.v_head_dim, kvl = cfg_.kv_lora_rank;
  const int64_t qw = static_cast<int64_t>(nh) * (nope + rope), kvw = kvl + rope;
  constexpr float kLatentEps = ModelConfig::kMlaLatentNormEps;

  mark("mla_proj");
  // kv_beside: the kv path and the gate projection on the side stream (x is read-only here).
  const cudaStream_t kv_stream = kv_beside ? side_ : stream_;
  if (kv_beside) fork_side();
  // Queries: q LoRA (normed latent) or a plain q_proj.
  if (!m.q_a.empty()) {
    const int64_t ql = m.q_a.rows;
    linear(m.q_a, b.x.data(), H, R, b.mla_r.data(), ql, false, stream_);
    rms_norm(b.mla_r.data(), ql, m.q_a_norm, R, ql, kLatentEps, b.mla_r.data(), ql, stream_);
    linear(m.q_b, b.mla_r.data(), ql, R, b.mla_q.data(), qw, false, stream_);
  } else {
    linear(m.q_proj, b.x.data(), H, R, b.mla_q.data(), qw, false, stream_);
  }
  // This token's cache entry: normed c then raw k_pe, appended at the row's position.
  linear(m.kv_a, b.x.data(), H, R, b.mla_kv.data(), kvw, false, kv_stream);
  rms_norm(b.mla_kv.data(), kvw, m.kv_a_norm, R, kvl, kLatentEps, b.mla_kv.data(), kvw, kv_stream);
  // DCP: the entry goes to its token's rank at the local index (-1 elsewhere: skipped), and
  // this rank's lengths count the tokens it holds.
  const bool dcp = opt_.ranks.dcp();
  const int32_t* cache_pos = dcp ? b.dcp_pos.data() : b.row_pos.data();
  const int32_t* cache_len = dcp ? b.dcp_seq.data() : b.row_seq.data();
  if (pool_->latent_format() == cpu::LatentFormat::BF16) {
    mla_cache_append(b.mla_kv.data(), R, static_cast<int>(kvw), b.row_table.data(),
                     pool_->pages_per_slot(), cache_pos, pool_->page_size(), pool_->latent(l),
                     kv_stream);
  } else {
    // Packed kv_cache_dtype: append in the format, then dequantize the rows' contexts into the
    // shared bf16 scratch the attention kernel reads (plain path: 2 extra passes over the cache).
    latent_cache_append(pool_->latent_format(), b.mla_kv.data(), R, kvl, rope, b.row_table.data(),
                        pool_->pages_per_slot(), cache_pos, pool_->page_size(),
                        pool_->latent_packed(l), kv_stream);
    latent_cache_to_bf16(pool_->latent_format(), pool_->latent_packed(l), kvl, rope,
                         b.row_table.data(), pool_->pages_per_slot(), cache_len, R,
                         pool_->page_size(), pool_->latent(l), kv_stream);
  }
  const __nv_bfloat16* gate = nullptr;
  if (kv_beside) {
    K3_CUDA_CHECK(cudaEventRecord(kv_ready_, side_));
    gate = gate_projection(m, R, side_);  // beside the query path and the attention
  }

  mark("mla_core");
  const int32_t* selected = nullptr;
  const int32_t* n_selected = nullptr;
  if (m.has_indexer) {
    dsa_select(l, R);
    selected = b.dsa_sel.data();
    n_selected = b.dsa_nsel.data();
  }
  mla_absorb_q(b.mla_q.data(), m.kv_b.bf16(), R, nh, nope, rope, vd, kvl, b.mla_q_abs.data(),
               b.mla_q_pe.data(), stream_);
  const float scale = 1.0f / std::sqrt(static_cast<float>(nope + rope));
  if (kv_beside) K3_CUDA_CHECK(cudaStreamWaitEvent(stream_, kv_ready_, 0));  // the cache entry
  if (dcp)
    mla_attend_dcp(l, R, scale);
  else
    mla_decode(mla_plan(R), b.mla_q_abs.data(), b.mla_q_pe.data(), pool_->latent(l),
               b.row_table.data(), b.row_seq.data(), selected, n_selected, scale, b.mla_ws.data(),
               b.mla_o_lat.data(), /*o_bf16=*/false, stream_);
  if (kv_beside)
    join_side();  // the gate
  else
    gate = gate_projection(m, R, stream_);
  mla_unabsorb_v(b.mla_o_lat.data(), m.kv_b.bf16(), gate, R, nh, nope, vd, kvl, b.mla_o.data(),
                 stream_);
  mark("attn_o_proj");
  project_out(m.o_proj, b.mla_o.data(), static_cast<int64_t>(nh) * vd, R, out);
}

// Both paths: gate|up as one GEMM where the weights are concatenated (else one each), the GLU,
// the down-projection.
void CudaBackbone::ffn_dense(int l, int64_t R) {
  Buffers& b = *buf_;
  const DevDense& d = weights_->layers[static_cast<size_t>(l)].dense;
  const int64_t H = cfg_.hidden_size, I = d.gate.rows;
  mark("dense_ffn");
  if (d.gate_up.empty()) {
    linear(d.gate, b.x.data(), H, R, b.ffn_gu32.data(), 2 * I, true, stream_);
    linear(d.up, b.x.data(), H, R, b.ffn_gu32.data() + I, 2 * I, true, stream_);
  } else {
    linear(d.gate_up, b.x.data(), H, R, b.ffn_gu32.data(), 2 * I, true, stream_);
  }
  glu(glu_act(cfg_), b.ffn_gu32.data(), 2 * I, b.ffn_gu32.data() + I, 2 * I, R, I, b.ffn_h.data(),
      I, stream_);
  project_out(d.down, b.ffn_h.data(), I, R, {});
}

// The shared experts of x on `stream`, both paths: gate|up as one GEMM where concatenated, the
// GLU, the down-projection into shared_out() (finish_shared completes it).
void CudaBackbone::shared_experts(const DevMoe& m, int64_t R, cudaStream_t stream) {
  Buffers& b = *buf_;
  const int64_t H = cfg_.hidden_size, S = m.shared_gate.rows;
  if (!m.shared_gate_up.empty()) {
    linear(m.shared_gate_up, b.x.data(), H, R, b.ffn_gu32.data(), 2 * S, true, stream);
  } else {
    linear(m.shared_gate, b.x.data(), H, R, b.ffn_gu32.data(), 2 * S, true, stream);
    linear(m.shared_up, b.x.data(), H, R, b.ffn_gu32.data() + S, 2 * S, true, stream);
  }
  glu(glu_act(cfg_), b.ffn_gu32.data(), 2 * S, b.ffn_gu32.data() + S, 2 * S, R, S,
      b.shared_h.data(), S, stream);
  linear(m.shared_down, b.shared_h.data(), S, R, shared_out(), H, tp_sums(), stream);
}

// The routed experts over the grouping `eg` of n (row, choice) pairs, both paths: w1|w3 as one
// grouped GEMM where each expert's pair is concatenated (else one each), the GLU, w2 into
// expert_out(). glu_in_down: the GLU applied as w2 stages its input (MXFP4 w1|w3 only; one
// launch fewer, the same bits); eg_down: w2's groups (its slots_ready may differ).
void CudaBackbone::routed_experts(const DevMoe& m, const ExpertGroups& eg,
                                  const ExpertGroups& eg_down, const __nv_bfloat16* z, int64_t L,
                                  int n, bool glu_in_down) {
  Buffers& b = *buf_;
  const int64_t I = m.inter;
  const GluAct act = glu_act(cfg_);
  if (m.w13) {
    expert_linear(m.expert_format, m.w13, m.w13_scales, eg, true, z, L, 2 * I, L, b.moe_gu32.data(),
                  true, stream_);
    if (glu_in_down && expert_down_glu(m, eg_down, act, b.moe_gu32.data(), 2 * I, I, expert_out(),
                                       expert_out_fp32(), stream_))
      return;
  } else {
    // Separate halves into the interleaved buffer (row stride 2I) is not expressible with
    // expert_linear's packed output: run them into their own buffers.
    expert_linear(m.expert_format, m.w1, m.w1_scales, eg, true, z, L, I, L, b.moe_g32.data(), true,
                  stream_);
    expert_linear(m.expert_format, m.w3, m.w3_scales, eg, true, z, L, I, L, b.moe_u32.data(), true,
                  stream_);
  }
  const float* g = m.w13 ? b.moe_gu32.data() : b.moe_g32.data();
  const float* u = m.w13 ? b.moe_gu32.data() + I : b.moe_u32.data();
  const int64_t gu_ld = m.w13 ? 2 * I : I;
  glu(act, g, gu_ld, u, gu_ld, n, I, b.moe_h.data(), I, stream_);
  expert_linear(m.expert_format, m.w2, m.w2_scales, eg_down, false, b.moe_h.data(), I, L, I,
                expert_out(), expert_out_fp32(), stream_);
}

// The grouping of the pairs both paths' grouped GEMMs run over: active experts first, over
// min(E, pairs) slots, tiled for the slots expected busy (arrays in b.group_*).
ExpertGroups CudaBackbone::expert_groups(const DevMoe& m, int64_t XR) const {
  Buffers& b = *buf_;
  const int k = cfg_.num_experts_per_token;
  const int slots = std::min(m.local.count, static_cast<int>(XR * k));
  return ExpertGroups{
      b.group_expert.data(),
      b.group_offsets.data(),
      b.group_rows.data(),
      slots,
      static_cast<int>(XR),
      expected_active_experts(m.local.count, static_cast<int>(m.gate.rows), k, XR, slots)};
}

// The MoE's first half, shared by both step paths: the router on the full-width x (fp32
// logits; the bias only steers the choice) into expert_ids / expert_w, then the expert input:
// the latent down-projection (K3, width L = its rows) or x itself (Kimi-Linear, L = hidden),
// enqueued on latent_stream (stream_, or a side stream the caller forked and joins); the router
// on router_stream (null: stream_), likewise.
const __nv_bfloat16* CudaBackbone::route_and_project(const DevMoe& m, int64_t R, int64_t& L,
                                                     cudaStream_t latent_stream,
                                                     const RouterGrouping* group,
                                                     cudaStream_t router_stream,
                                                     bool router_merge_tree) {
  Buffers& b = *buf_;
  const int64_t H = cfg_.hidden_size, E = m.gate.rows;
  const cudaStream_t rs = router_stream ? router_stream : stream_;
  mark("moe_router");
  linear(m.gate, b.x.data(), H, R, b.router_logits.data(), E, /*y_fp32=*/true, rs);
  RouterPlan rp;
  rp.num_experts = static_cast<int>(E);
  rp.top_k = cfg_.num_experts_per_token;
  rp.num_expert_group = cfg_.num_expert_group;
  rp.renormalize = cfg_.moe_renormalize;
  rp.routed_scaling_factor = cfg_.routed_scaling_factor;
  rp.merge_tree = router_merge_tree;
  if (group)
    router_topk_grouped(rp, b.router_logits.data(), m.score_bias, R, b.expert_ids.data(),
                        b.expert_w.data(), *group, rs);
  else
    router_topk(rp, b.router_logits.data(), m.score_bias, R, b.expert_ids.data(), b.expert_w.data(),
                rs);
  if (m.latent_down.empty()) {
    L = H;
    return b.x.data();
  }
  L = m.latent_down.rows;
  linear(m.latent_down, b.x.data(), H, R, b.moe_z.data(), L, false, latent_stream);
  return b.moe_z.data();
}

void CudaBackbone::ffn_moe(int l, int64_t R) {
  Buffers& b = *buf_;
  const DevMoe& m = weights_->layers[static_cast<size_t>(l)].moe_w;
  const int64_t H = cfg_.hidden_size;
  const int k = cfg_.num_experts_per_token;

  int64_t L = 0;
  const __nv_bfloat16* z = route_and_project(m, R, L, stream_);
  // The expert rows: this step's, or under EP every rank's.
  const int32_t* ids = nullptr;
  const int64_t XR = expert_rows(z, ids, L, R);
  // The (row, choice) pairs grouped by expert so each chosen expert is read once for its rows.
  const int n = static_cast<int>(XR * k);
  mark("moe_experts");
  moe_group_by_expert_compact(ids, XR, k, m.local, b.group_expert.data(), b.group_offsets.data(),
                              b.group_rows.data(), b.group_pos.data(), stream_);
  const ExpertGroups eg = expert_groups(m, XR);
  routed_experts(m, eg, eg, z, L, n, /*glu_in_down=*/false);

  // Weighted sum of the choices (the complete sum: the latent norm needs all of it), then up.
  mark("moe_combine_up");
  const auto [y, y_pos] = routed_outputs(R, L);
  const bool up = !m.latent_up.empty();
  __nv_bfloat16* routed = up ? b.moe_acc.data() : b.moe_routed.data();
  moe_combine(y, b.expert_w.data(), R, k, L, up ? m.latent_norm : nullptr, cfg_.rms_norm_eps,
              routed, stream_, y_pos);
  if (up) {
    linear(m.latent_up, b.moe_acc.data(), L, R, b.moe_routed.data(), H, false, stream_);
    routed = b.moe_routed.data();
  }
  if (m.shared_gate.empty()) {
    K3_CUDA_CHECK(cudaMemcpyAsync(b.sub.data(), routed,
                                  static_cast<size_t>(R * H) * sizeof(__nv_bfloat16),
                                  cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  mark("moe_shared");
  shared_experts(m, R, stream_);
  finish_shared(R);
  add_bf16(routed, b.shared.data(), R * H, b.sub.data(), stream_);
}

}  // namespace k3::cuda
