// The specialized decode step (decode_backend = latency_specialized): the same function as the
// stock step over the same state and boundary tensors, scheduled as fewer, fused kernels. Its
// GEMMs and its AttnRes mix + norm kernel are the stock step's (the same shapes, so the same
// tuned plans and bits); it fuses the small ops around them and overlaps them.
//
// Per layer, the attention providers are the input projection (one GEMM over the concatenated
// q|k|v|g|f_a|b rows of a KDA layer), the core (the fused KDA kernel: conv + gates + recurrence
// + gated norm; MLA's cache append + absorbed attention) and the o-projection, whose store adds
// the residual; the MoE half is router (grouping the pairs in its top-k kernel) -> one grouped
// GEMM for w1|w3 of every chosen expert -> w2 applying the GLU as it stages its input ->
// combine + latent norm -> latent up (its store adds the shared experts and the residual), with
// the latent down and the shared experts on a side stream beside the router and the routed
// experts. The step is captured per capture size with programmatic (PDL) edges between its
// kernels, so each GEMM streams its first weight tiles while the kernel before it drains;
// beside the latency-bound cores, a side-stream kernel can warm the next projection's weights
// into L2.
#include <cmath>

#include "core/error.h"
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
    if (L.kind == LayerKind::KDA)
      attn_kda(l, R, residual, opt_.tuning.l2_prefetch_bytes > 0);
    else
      attn_mla(l, R, residual, opt_.tuning.mla_kv_beside);
    tap(l, "attn", R);
    if (!fold) attn_residual(restart, R);

    mark("ffn_norm");
    mix_norm(n_blocks, L.attn_res_mlp, L.post_attn_norm, R);
    bool added = false;
    if (L.moe)
      added = ffn_moe_fused(l, R);
    else
      ffn_dense(l, R);
    tap(l, "ffn", R);
    if (!added) add_bf16(b.P.data(), b.sub.data(), R * H, b.P.data(), stream_);
  }

  mark("lm_head");
  mix_norm(n_blocks, W.output_attn_res, W.final_norm, R);
  linear(W.lm_head, b.x.data(), H, R, b.logits.data(), cfg_.vocab_size, /*y_fp32=*/true, stream_);
  advance_rows(b.slots.data(), R, pool_->positions(), stream_);
}

bool CudaBackbone::ffn_moe_fused(int l, int64_t R) {
  Buffers& b = *buf_;
  const DevMoe& m = weights_->layers[static_cast<size_t>(l)].moe_w;
  const int64_t H = cfg_.hidden_size;
  const int k = cfg_.num_experts_per_token;
  const bool shared = !m.shared_gate.empty();

  // The shared experts on the side stream from the same x, beside the routed work.
  const auto shared_side = [&] {
    if (!shared) return;
    shared_experts(m, R, side_);
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
  if (!beside) shared_side();         // from the start, beside router, latent and experts
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
  const __nv_bfloat16* z =
      route_and_project(m, R, L, beside && !swap ? side_ : stream_, grouped ? &grouping : nullptr,
                        swap ? side_ : stream_, opt_.tuning.router_merge_tree);
  const bool join_now = beside && (ep || swap);  // EP gathers z; swapped, the ids are the side's
  if (join_now) {
    join_side();  // z (and the routing) ready
    shared_side();
  }
  const int32_t* ids = nullptr;
  const int64_t XR = expert_rows(z, ids, L, R);
  // Active experts first: the grouped GEMMs cover min(E, rows * k) slots, not E.
  if (!grouped)
    moe_group_by_expert_compact(ids, XR, k, m.local, b.group_expert.data(), b.group_offsets.data(),
                                b.group_rows.data(), b.group_pos.data(), stream_);
  if (beside && !join_now) {
    join_side();  // z is ready
    shared_side();
  }

  mark("moe_experts");
  // The down-projection applies the GLU as it stages its input (one launch fewer), where the
  // kernel takes these operands (MXFP4, fused w1|w3 output rows); else GLU, then the GEMM. Its
  // slot arrays were complete before w1|w3 began: it streams its first weights early.
  const ExpertGroups eg = expert_groups(m, XR);
  ExpertGroups eg_down = eg;
  eg_down.slots_ready = opt_.tuning.early_down_weights;
  routed_experts(m, eg, eg_down, z, L, static_cast<int>(XR * k),
                 opt_.tuning.glu_in_down_proj_for(R));

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
  const auto combine = [&] {
    moe_combine(y, b.expert_w.data(), R, k, L, up ? m.latent_norm : nullptr, cfg_.rms_norm_eps,
                routed, stream_, y_pos);
  };
  const bool combine_in_up =
      fold && opt_.tuning.combine_in_latent_up && m.latent_up.format == WeightFormat::BF16;
  if (!combine_in_up) combine();
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
    const CombinedInput in{y, y_pos, b.expert_w.data(), k, m.latent_norm, cfg_.rms_norm_eps};
    if (combine_in_up && linear_bf16_combined(in, b.moe_acc.data(), m.latent_up.bf16(), R, H, L,
                                              b.sub.data(), H, tail, stream_))
      return true;
    if (combine_in_up) combine();  // the shape's plan is not the GEMV
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
