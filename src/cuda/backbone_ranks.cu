// The collectives of a multi-rank step (RankSetup; the CPU reference is parallel/*.cpp): the
// TP sum of each sharded sublayer, the EP exchange of the routed experts' rows and outputs, and
// DCP's attention over a token-sharded latent cache. Both step paths call these pieces, so one
// rank's stock and specialized steps still compute the same function.
#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cuda/backbone.h"
#include "cuda/backbone_buffers.h"
#include "cuda/check.h"
#include "cuda/graph_pdl.h"
#include "cuda/linear_plan.h"
#include "cuda/mla_decode.h"
#include "cuda/moe_dispatch.h"
#include "cuda/rank_ops.h"

namespace k3::cuda {

void CudaBackbone::setup_ranks() {
  const RankSetup& r = opt_.ranks;
  if (!r.any()) return;
  const parallel::ParallelLayout& lo = r.layout;
  K3_CHECK(lo.tp >= 1 && lo.dp >= 1 && r.rank >= 0 && r.rank < lo.world(), "rank ", r.rank,
           " outside a layout of tp ", lo.tp, " x dp ", lo.dp);
  K3_CHECK(!opt_.stub_collectives,
           "stub_collectives stands in for collectives on one rank alone; this rank has "
           "communicators");
  if (r.world)
    K3_CHECK(r.world->size() == lo.world() && r.world->rank() == r.rank,
             "the world communicator is rank ", r.world->rank(), " of ", r.world->size(),
             ", the layout says rank ", r.rank, " of ", lo.world());
  if (r.tp)
    K3_CHECK(r.tp->size() == lo.tp && r.tp->rank() == r.tp_rank(), "the tp communicator is rank ",
             r.tp->rank(), " of ", r.tp->size(), ", the layout says tp rank ", r.tp_rank(), " of ",
             lo.tp);
  K3_CHECK(lo.tp == 1 || r.tp, "tensor_parallel_size ", lo.tp, " needs the tp communicator");
  K3_CHECK(!lo.ep || r.world, "enable_expert_parallel needs the world communicator");
  K3_CHECK(lo.dcp == 1 || lo.dcp == lo.tp, "decode_context_parallel_size ", lo.dcp,
           " must be 1 or tensor_parallel_size ", lo.tp);
  K3_CHECK(!r.dcp() || !cfg_.dsa_config.enabled,
           "decode_context_parallel_size > 1 is not supported with DSA (the indexer's top-k needs "
           "every cached index key)");
  // A communicator that waits on the host cannot sit in a graph: such ranks step eagerly.
  for (const DeviceCommunicator* c : {r.world, r.tp})
    if (c && !c->graph_safe()) opt_.use_graphs = false;
  // Every rank must pick the same GEMM plans: the computations ranks replicate (router, latent
  // projections, lm_head) then give the same bits everywhere, so every rank routes alike.
  set_linear_tuning(false);
}

void CudaBackbone::check_expert_slices() const {
  const RankSetup& rk = opt_.ranks;
  for (size_t l = 0; l < weights_->layers.size(); ++l) {
    const DevMoe& m = weights_->layers[l].moe_w;
    if (!weights_->layers[l].moe) continue;
    if (rk.ep()) {
      // EP rank r holds experts [r * E / world, (r + 1) * E / world) (parallel::RankWeights).
      const int per = static_cast<int>(m.gate.rows) / rk.layout.world();
      K3_CHECK(m.local.begin == rk.rank * per && m.local.count == per, "MoE layer ", l,
               " holds experts [", m.local.begin, ", ", m.local.begin + m.local.count,
               "), not expert-parallel rank ", rk.rank, "'s [", rk.rank * per, ", ",
               (rk.rank + 1) * per, ")");
      K3_CHECK(
          static_cast<int64_t>(rk.layout.world()) * opt_.max_rows * cfg_.num_experts_per_token <=
              kMaxGroupedPairs,
          "expert parallelism over ", rk.layout.world(), " ranks at ", opt_.max_rows,
          " rows each gathers more than ", kMaxGroupedPairs,
          " (row, expert) pairs per step; lower the rows per step");
    } else {
      K3_CHECK(m.local.count == m.gate.rows || opt_.stub_collectives, "MoE layer ", l,
               " holds experts [", m.local.begin, ", ", m.local.begin + m.local.count, ") of ",
               m.gate.rows,
               ": an expert-parallel slice runs only with its EP communicator or with "
               "stub_collectives (one rank alone)");
    }
  }
}

void CudaBackbone::collective(const std::function<void()>& run) {
  record_foreign_nodes(stream_, foreign_nodes_, run);
}

void CudaBackbone::tp_sum_to_bf16(float* partial, int64_t n, __nv_bfloat16* out) {
  collective([&] { opt_.ranks.tp->all_reduce_sum(partial, n, stream_); });
  finish_tp_sum(partial, n, out, nullptr, false, stream_);
}

void CudaBackbone::project_out(const DevMatrix& w, const __nv_bfloat16* in, int64_t K, int64_t R,
                               const LinearEpilogue& out) {
  Buffers& b = *buf_;
  const int64_t H = cfg_.hidden_size;
  if (!tp_sums()) {
    linear(w, in, K, R, b.sub.data(), H, out, stream_);
    return;
  }
  K3_CHECK(out.add == nullptr, "project_out: a TP rank adds nothing before its sum");
  // fp32 partials, summed over the ranks, rounded once (where the single rank rounds its GEMM).
  linear(w, in, K, R, b.red.data(), H, /*y_fp32=*/true, stream_);
  collective([&] { opt_.ranks.tp->all_reduce_sum(b.red.data(), R * H, stream_); });
  finish_tp_sum(b.red.data(), R * H, b.sub.data(), out.res, out.res_copy, stream_);
}

int64_t CudaBackbone::expert_rows(const __nv_bfloat16*& z, const int32_t*& ids, int64_t L,
                                  int64_t R) {
  Buffers& b = *buf_;
  ids = b.expert_ids.data();
  if (!opt_.ranks.ep()) return R;
  const int W = opt_.ranks.layout.world(), k = cfg_.num_experts_per_token;
  DeviceCommunicator& world = *opt_.ranks.world;
  collective([&] {
    world.all_gather(z, R * L, DevType::BF16, b.ep_z.data(), stream_);
    world.all_gather(b.expert_ids.data(), R * k, DevType::I32, b.ep_ids.data(), stream_);
  });
  // Rows replicated over a replica's tp ranks: each pair computed for one of them only.
  ep_keep_own_pairs(b.ep_ids.data(), W, R, k, opt_.ranks.layout.tp, stream_);
  z = b.ep_z.data();
  ids = b.ep_ids.data();
  return W * R;
}

void* CudaBackbone::expert_out() const {
  return expert_out_fp32() ? static_cast<void*>(buf_->moe_y32.data())
                           : static_cast<void*>(buf_->moe_y.data());
}

std::pair<const __nv_bfloat16*, const int32_t*> CudaBackbone::routed_outputs(int64_t R, int64_t L) {
  Buffers& b = *buf_;
  const int k = cfg_.num_experts_per_token;
  if (opt_.ranks.ep()) {
    // Every gathered pair's output in (row, choice) order, zero where another rank owns the
    // expert; summing over the ranks then hands each its rows' pairs exactly (x + 0 = x).
    const int W = opt_.ranks.layout.world();
    pairs_from_grouped(b.moe_y.data(), b.group_pos.data(), W * R * k, L, b.ep_pairs.data(),
                       stream_);
    collective([&] {
      opt_.ranks.world->reduce_scatter_sum(b.ep_pairs.data(), b.ep_own.data(), R * k * L,
                                           DevType::BF16, stream_);
      // A replica's pairs were split over its tp ranks: add the others' (zeros here).
      if (opt_.ranks.tp && opt_.ranks.layout.tp > 1)
        opt_.ranks.tp->all_reduce_sum(b.ep_own.data(), R * k * L, DevType::BF16, stream_);
    });
    return {b.ep_own.data(), nullptr};
  }
  // TP-sliced experts: each pair's partial output summed over the ranks, then rounded.
  if (expert_out_fp32()) tp_sum_to_bf16(b.moe_y32.data(), R * k * L, b.moe_y.data());
  return {b.moe_y.data(), b.group_pos.data()};
}

void* CudaBackbone::shared_out() const {
  return tp_sums() ? static_cast<void*>(buf_->shared32.data())
                   : static_cast<void*>(buf_->shared.data());
}

void CudaBackbone::finish_shared(int64_t R) {
  if (tp_sums()) tp_sum_to_bf16(buf_->shared32.data(), R * cfg_.hidden_size, buf_->shared.data());
}

void CudaBackbone::mla_attend_dcp(int l, int64_t R, float scale) {
  Buffers& b = *buf_;
  DeviceCommunicator& tp = *opt_.ranks.tp;
  const int D = opt_.ranks.layout.dcp, nh = cfg_.num_attention_heads;
  const int kvl = cfg_.kv_lora_rank, rope = cfg_.qk_rope_head_dim;
  // Every rank's absorbed queries ([D][R][heads]: D * R attention rows of this rank's head
  // count), attended over the tokens this rank holds.
  collective([&] {
    tp.all_gather(b.mla_q_abs.data(), R * nh * kvl, DevType::BF16, b.dcp_q_abs.data(), stream_);
    if (rope > 0)
      tp.all_gather(b.mla_q_pe.data(), R * nh * rope, DevType::BF16, b.dcp_q_pe.data(), stream_);
  });
  mla_decode(mla_plan(D * R), b.dcp_q_abs.data(), b.dcp_q_pe.data(), pool_->latent(l),
             b.dcp_table.data(), b.dcp_seq.data(), nullptr, nullptr, scale, b.mla_ws.data(),
             b.dcp_o.data(), /*o_bf16=*/false, stream_, b.dcp_lse.data());
  // Block c of the partials (rank c's queries) goes back to rank c; this rank receives every
  // rank's partial for its own heads and merges them in rank order.
  const std::vector<int64_t> o_counts(static_cast<size_t>(D), R * nh * kvl);
  const std::vector<int64_t> lse_counts(static_cast<size_t>(D), R * nh);
  collective([&] {
    tp.all_to_all_v(b.dcp_o.data(), o_counts.data(), b.dcp_o_recv.data(), o_counts.data(),
                    DevType::F32, stream_);
    tp.all_to_all_v(b.dcp_lse.data(), lse_counts.data(), b.dcp_lse_recv.data(), lse_counts.data(),
                    DevType::F32, stream_);
  });
  dcp_merge_attention(b.dcp_o_recv.data(), b.dcp_lse_recv.data(), D, R, nh, kvl, b.mla_o_lat.data(),
                      stream_);
}

}  // namespace k3::cuda
