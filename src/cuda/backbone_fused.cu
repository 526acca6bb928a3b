// The specialized decode step (decode_backend = latency_specialized): the same function as the
// stock step over the same state and boundary tensors, scheduled as fewer, fused kernels.
//
// Per layer, the attention providers are the input projection (one GEMM over the concatenated
// q|k|v|g|f_a|b rows of a KDA layer), the core (the fused KDA kernel: conv + gates + recurrence
// + gated norm; MLA's cache append + absorbed attention) and the o-projection; the MoE half is
// router -> compacted expert grouping -> one grouped GEMM for w1|w3 of every chosen expert ->
// GLU -> w2 -> combine + latent norm -> latent up, with the shared experts on a side stream
// overlapping the routed ones. The AttnRes mix and the following RMSNorm are one kernel. The
// step is captured per capture size with programmatic (PDL) edges between its kernels, so each
// GEMM streams its first weight tiles while the kernel before it drains; beside the
// latency-bound cores, a side-stream kernel warms the next projection's weights into L2.
#include <cmath>

#include "core/error.h"
#include "cuda/attn_res.h"
#include "cuda/attn_res_norm.h"
#include "cuda/backbone.h"
#include "cuda/backbone_buffers.h"
#include "cuda/backbone_ops.h"
#include "cuda/check.h"
#include "cuda/glu.h"
#include "cuda/kda_decode.h"
#include "cuda/l2_prefetch.h"
#include "cuda/moe_dispatch.h"
#include "cuda/rms_norm.h"
#include "cuda/router.h"
#include "cuda/step_ops.h"

namespace k3::cuda {

void CudaBackbone::fork_side() {
  K3_CUDA_CHECK(cudaEventRecord(fork_, stream_));
  K3_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
}

void CudaBackbone::join_side() {
  K3_CUDA_CHECK(cudaEventRecord(join_, side_));
  K3_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_, 0));
}

// Warms the first l2_prefetch_bytes of the next matrices into L2 on the side stream (the caller
// forks before and joins after the kernel it runs beside).
void CudaBackbone::prefetch_l2(std::initializer_list<const DevMatrix*> next) {
  L2PrefetchList list;
  size_t budget = opt_.tuning.l2_prefetch_bytes;
  for (const DevMatrix* m : next) {
    if (budget == 0 || m->empty() || list.n == L2PrefetchList::kMax) break;
    const size_t elem = m->format == WeightFormat::F32 ? 4 : 2;
    const size_t bytes = m->format == WeightFormat::MXFP4
                             ? static_cast<size_t>(m->rows * m->cols / 2)
                             : static_cast<size_t>(m->rows * m->cols) * elem;
    const size_t take = std::min(bytes, budget);
    list.r[list.n++] = L2Range{m->data, take};
    budget -= take;
  }
  if (list.n > 0) l2_prefetch(list, /*ctas=*/16, side_);
}

void CudaBackbone::mix_norm(int n_blocks, const float* score_w, const float* norm_w, int64_t R) {
  Buffers& b = *buf_;
  const int64_t H = cfg_.hidden_size;
  if (!cfg_.has_attn_res()) {
    rms_norm(b.P.data(), H, norm_w, R, H, cfg_.rms_norm_eps, b.x.data(), H, stream_);
    return;
  }
  AttnResSources src;
  K3_CHECK(n_blocks + 1 <= AttnResSources::kMax, "AttnRes bank of ", n_blocks, " blocks");
  for (int j = 0; j < n_blocks; ++j) src.src[j] = b.bank_block(j);
  src.src[n_blocks] = b.P.data();
  attn_res_mix_norm(src, n_blocks + 1, H, score_w, R, H, cfg_.rms_norm_eps, norm_w, b.x.data(), H,
                    stream_);
}

void CudaBackbone::enqueue_specialized(int64_t R) {
  Buffers& b = *buf_;
  const DeviceWeights& W = *weights_;
  const int64_t H = cfg_.hidden_size;
  mark("embed");
  prepare_step_rows(R);
  embed_input(R);

  int n_blocks = 0;
  for (int l = 0; l < cfg_.num_hidden_layers; ++l) {
    const DevLayer& L = W.layers[static_cast<size_t>(l)];
    mark("attn_norm");
    // The attention input mixes the bank as it stands before this layer's write (the stock
    // order): with no block yet it is the plain norm of P.
    const bool restart = cfg_.is_attn_res_write_layer(l);
    if (cfg_.has_attn_res() && n_blocks > 0)
      mix_norm(n_blocks, L.attn_res_attn, L.input_norm, R);
    else
      rms_norm(b.P.data(), H, L.input_norm, R, H, cfg_.rms_norm_eps, b.x.data(), H, stream_);
    if (restart) write_bank_block(n_blocks++, R);
    // The residual (P = sub at a restart, else P += sub) in the o-projection's store.
    LinearEpilogue residual;
    const bool fold = opt_.tuning.fold_residual_adds;
    residual.res = fold ? b.P.data() : nullptr;
    residual.res_copy = restart;
    if (L.kind == LayerKind::KDA && !L.kda.in_proj.empty()) {
      attn_kda_fused(l, R, residual);
    } else if (L.kind == LayerKind::KDA) {
      attn_kda(l, R);
    } else {
      attn_mla(l, R, residual, opt_.tuning.mla_kv_beside);
    }
    tap(l, "attn", R);
    if (!fold || (L.kind == LayerKind::KDA && L.kda.in_proj.empty())) attn_residual(restart, R);

    mark("ffn_norm");
    mix_norm(n_blocks, L.attn_res_mlp, L.post_attn_norm, R);
    bool added = false;
    if (L.moe)
      added = ffn_moe_fused(l, R);
    else
      ffn_dense_fused(l, R);
    tap(l, "ffn", R);
    if (!added) add_bf16(b.P.data(), b.sub.data(), R * H, b.P.data(), stream_);
  }

  mark("lm_head");
  mix_norm(n_blocks, W.output_attn_res, W.final_norm, R);
  linear(W.lm_head, b.x.data(), H, R, b.logits.data(), cfg_.vocab_size, /*y_fp32=*/true, stream_);
  advance_rows(b.slots.data(), R, pool_->positions(), stream_);
}

void CudaBackbone::attn_kda_fused(int l, int64_t R, const LinearEpilogue& out) {
  Buffers& b = *buf_;
  const DevKda& k = weights_->layers[static_cast<size_t>(l)].kda;
  const KdaInProjLayout& in = k.in_layout;
  const int64_t H = cfg_.hidden_size, P = cfg_.kda_proj_dim(), n = in.ld;  // row stride
  K3_CHECK(in.q == 0 && in.k == P && in.v == 2 * P, "KDA in_proj: q, k, v must lead the rows");
  mark("kda_proj");
  // One GEMM for every projection of x: [rows][q | k | v | g | f_a | b].
  linear(k.in_proj, b.x.data(), H, R, b.kda_in.data(), n, false, stream_);
  linear(k.f_b, b.kda_in.data() + in.fa, n, R, b.kda_f.data(), P, false, stream_);
  const __nv_bfloat16* z = b.kda_in.data() + in.g;
  int64_t z_ld = n;
  if (!k.g_a.empty()) {  // LoRA output gate: g_b of the g_a rows
    linear(k.g_b, b.kda_in.data() + in.g, n, R, b.kda_z.data(), P, false, stream_);
    z = b.kda_z.data();
    z_ld = P;
  }
  mark("kda_core");
  KdaDecodeStrides st;
  st.u = n;
  st.f = P;
  st.beta = n;
  st.z = z_ld;
  // The recurrence is latency-bound (a few CTAs per row): warm o_proj into L2 beside it.
  const bool warm = opt_.tuning.l2_prefetch_bytes > 0;
  if (warm) {
    fork_side();
    prefetch_l2({&k.o_proj});
  }
  kda_core(l, R, b.kda_in.data(), b.kda_in.data() + in.b, z, st);
  if (warm) join_side();
  mark("attn_o_proj");
  project_out(k.o_proj, b.kda_gated.data(), P, R, out);
}

void CudaBackbone::ffn_dense_fused(int l, int64_t R) {
  Buffers& b = *buf_;
  const DevDense& d = weights_->layers[static_cast<size_t>(l)].dense;
  if (d.gate_up.empty()) {
    ffn_dense(l, R);
    return;
  }
  const int64_t H = cfg_.hidden_size, I = d.gate.rows;
  mark("dense_ffn");
  linear(d.gate_up, b.x.data(), H, R, b.ffn_gu32.data(), 2 * I, true, stream_);
  glu(glu_act(cfg_), b.ffn_gu32.data(), 2 * I, b.ffn_gu32.data() + I, 2 * I, R, I, b.ffn_h.data(),
      I, stream_);
  project_out(d.down, b.ffn_h.data(), I, R, {});
}

bool CudaBackbone::ffn_moe_fused(int l, int64_t R) {
  Buffers& b = *buf_;
  const DevMoe& m = weights_->layers[static_cast<size_t>(l)].moe_w;
  const int64_t H = cfg_.hidden_size;
  const int k = cfg_.num_experts_per_token;
  const GluAct act = glu_act(cfg_);
  const bool shared = !m.shared_gate.empty();

  // The shared experts on the side stream from the same x, beside the routed work.
  const auto shared_experts = [&] {
    if (!shared) return;
    const int64_t S = m.shared_gate.rows;
    if (!m.shared_gate_up.empty()) {
      linear(m.shared_gate_up, b.x.data(), H, R, b.ffn_gu32.data(), 2 * S, true, side_);
    } else {
      linear(m.shared_gate, b.x.data(), H, R, b.ffn_gu32.data(), 2 * S, true, side_);
      linear(m.shared_up, b.x.data(), H, R, b.ffn_gu32.data() + S, 2 * S, true, side_);
    }
    glu(act, b.ffn_gu32.data(), 2 * S, b.ffn_gu32.data() + S, 2 * S, R, S, b.shared_h.data(), S,
        side_);
    linear(m.shared_down, b.shared_h.data(), S, R, shared_out(), H, tp_sums(), side_);
    // Then the latent up-projection's first bytes into L2, by loads, beside the latency-bound
    // routed experts (joined with the shared experts before the layer ends).
    const size_t warm = opt_.tuning.l2_warm_latent_up_bytes;
    if (warm > 0 && !m.latent_up.empty()) {
      L2PrefetchList list;
      list.r[0] = L2Range{m.latent_up.data,
                          std::min(warm, static_cast<size_t>(m.latent_up.rows * m.latent_up.cols) *
                                             sizeof(__nv_bfloat16))};
      list.n = 1;
      l2_prefetch(list, /*ctas=*/64, side_, /*by_load=*/true);
    }
  };
  const bool beside = opt_.tuning.latent_beside_router;
  if (beside || shared) fork_side();  // (every fork is joined before the layer ends)
  if (!beside) shared_experts();      // from the start, beside router, latent and experts
  int64_t L = 0;
  // Under EP the expert rows are every rank's, gathered once z is ready.
  const bool ep = opt_.ranks.ep();
  // The grouping in the top-k kernel where the ids are this step's own.
  RouterGrouping grouping;
  grouping.local = m.local;
  grouping.slot_expert = b.group_expert.data();
  grouping.slot_offsets = b.group_offsets.data();
  grouping.row_index = b.group_rows.data();
  grouping.position = b.group_pos.data();
  grouping.done = b.route_done.data();
  const bool grouped = opt_.tuning.group_in_router && !ep && R * k <= kMaxRouterGroupedPairs;
  // beside: the latent down-projection on the side stream next to the router GEMM and top-k
  // (both read x only), the shared experts after it there.
  // swap: the router on the side stream instead, the latent down leading the main chain.
  const bool swap = beside && opt_.tuning.router_beside_latent;
  const __nv_bfloat16* z = route_and_project(m, R, L, beside && !swap ? side_ : stream_,
                                             grouped ? &grouping : nullptr, swap ? side_ : stream_);
  const bool join_now = beside && (ep || swap);  // EP gathers z; swapped, the ids are the side's
  if (join_now) {
    join_side();  // z (and the routing) ready
    shared_experts();
  }
  const int32_t* ids = nullptr;
  const int64_t XR = expert_rows(z, ids, L, R);
  const int rows = static_cast<int>(XR);
  const int n = static_cast<int>(XR * k);
  // Active experts first: the grouped GEMMs cover min(E, rows * k) slots, not E.
  const int slots = std::min(m.local.count, n);
  if (!grouped)
    moe_group_by_expert_compact(ids, XR, k, m.local, b.group_expert.data(), b.group_offsets.data(),
                                b.group_rows.data(), b.group_pos.data(), stream_);
  if (beside && !join_now) {
    join_side();  // z is ready
    shared_experts();
  }

  mark("moe_experts");
  const int64_t I = m.inter;
  const ExpertGroups eg{
      b.group_expert.data(),
      b.group_offsets.data(),
      b.group_rows.data(),
      slots,
      rows,
      expected_active_experts(m.local.count, static_cast<int>(m.gate.rows), k, XR, slots)};
  if (m.w13) {
    expert_linear(m.expert_format, m.w13, m.w13_scales, eg, true, z, L, 2 * I, L, b.moe_gu32.data(),
                  true, stream_);
  } else {
    // Separate halves into the same interleaved buffer (row stride 2I) is not expressible
    // with expert_linear's packed output: run them into the stock buffers instead.
    expert_linear(m.expert_format, m.w1, m.w1_scales, eg, true, z, L, I, L, b.moe_g32.data(), true,
                  stream_);
    expert_linear(m.expert_format, m.w3, m.w3_scales, eg, true, z, L, I, L, b.moe_u32.data(), true,
                  stream_);
  }
  // The down-projection applies the GLU as it stages its input (one launch fewer), where the
  // kernel takes these operands (MXFP4, fused w1|w3 output rows); else GLU, then the GEMM. Its
  // slot arrays were complete before w1|w3 began: it streams its first weights early.
  ExpertGroups eg_down = eg;
  eg_down.slots_ready = opt_.tuning.early_down_weights;
  if (!(m.w13 && opt_.tuning.glu_in_down_proj_for(R) &&
        expert_down_glu(m, eg_down, act, b.moe_gu32.data(), 2 * I, I, expert_out(),
                        expert_out_fp32(), stream_))) {
    const float* g = m.w13 ? b.moe_gu32.data() : b.moe_g32.data();
    const float* u = m.w13 ? b.moe_gu32.data() + I : b.moe_u32.data();
    const int64_t gu_ld = m.w13 ? 2 * I : I;
    glu(act, g, gu_ld, u, gu_ld, n, I, b.moe_h.data(), I, stream_);
    expert_linear(m.expert_format, m.w2, m.w2_scales, eg_down, false, b.moe_h.data(), I, L, I,
                  expert_out(), expert_out_fp32(), stream_);
  }

  mark("moe_combine_up");
  const auto [y, y_pos] = routed_outputs(R, L);
  const bool up = !m.latent_up.empty();
  __nv_bfloat16* routed = up ? b.moe_acc.data() : b.moe_routed.data();
  const bool fold = up && opt_.tuning.fold_moe_residual_for(R);
  const bool early_join = fold && shared && opt_.tuning.join_before_combine;
  if (early_join) {
    join_side();
    finish_shared(R);
  }
  moe_combine(y, b.expert_w.data(), R, k, L, up ? m.latent_norm : nullptr, cfg_.rms_norm_eps,
              routed, stream_, y_pos);
  if (fold) {
    // The latent up-projection's store adds the shared experts' output (sub = routed + shared)
    // and the layer's residual (P += sub), rounding as the separate adds.
    if (shared && !early_join) {
      join_side();
      finish_shared(R);
    }
    LinearEpilogue tail;
    tail.add = shared ? b.shared.data() : nullptr;
    tail.res = b.P.data();
    linear(m.latent_up, b.moe_acc.data(), L, R, b.sub.data(), H, tail, stream_);
    return true;
  }
  if (up) {
    linear(m.latent_up, b.moe_acc.data(), L, R, b.moe_routed.data(), H, false, stream_);
    routed = b.moe_routed.data();
  }
  if (!shared) {
    K3_CUDA_CHECK(cudaMemcpyAsync(b.sub.data(), routed,
                                  static_cast<size_t>(R * H) * sizeof(__nv_bfloat16),
                                  cudaMemcpyDeviceToDevice, stream_));
    return false;
  }
  join_side();
  finish_shared(R);
  // sub = routed + shared, then P += sub, in one launch.
  add_bf16_residual(routed, b.shared.data(), R * H, b.sub.data(), b.P.data(), stream_);
  return true;
}

}  // namespace k3::cuda
