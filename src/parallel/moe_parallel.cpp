// Latent MoE over ranks. Router, latent down/up and latent norm are replicated; the shared
// experts are split over the tp ranks; routed experts are either split over the tp ranks too
// (no EP: partial outputs summed) or placed over all ranks (EP: each (row, slot) pair is sent to
// the expert's owner, computed there and sent back). Either way the weighted expert sum is
// complete on every rank before latent_norm, as the single-rank block computes it.
#include <algorithm>

#include "core/error.h"
#include "cpu/layers.h"
#include "cpu/ops_moe.h"
#include "parallel/rank_step.h"

namespace k3::parallel {
namespace {

// EP: returns y_pairs[n][top_k][L], each pair's rounded expert output, computed by the owning
// rank. Within a DP replica the rows are replicated over the tp ranks; pair p = i * top_k + j
// is dispatched by tp rank p % tp only and left zero on the others (the caller's TP all-reduce
// then adds zeros, which is exact).
void ep_dispatch_combine(const RankContext& ctx, const MoeWeights& w, const float* z, int64_t n,
                         const std::vector<int>& idx, float* y_pairs) {
  const int N = ctx.world.size(), K = ctx.model.num_experts_per_token;
  const int64_t L = ctx.model.expert_io_dim();
  const int per_rank = ctx.model.num_experts / N;
  const cpu::GluActivation act = cpu::activation_for(ctx.model);

  // Pairs this rank dispatches, grouped by owner (stable: row-major order within an owner).
  std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(N));
  for (int64_t p = 0; p < n * K; ++p) {
    if (p % ctx.layout.tp != ctx.tp_rank) continue;
    pairs[static_cast<size_t>(idx[static_cast<size_t>(p)] / per_rank)].push_back(p);
  }
  std::vector<int64_t> meta_send(static_cast<size_t>(N)), rows_send(static_cast<size_t>(N));
  std::vector<int32_t> expert_ids;  // [pairs sent] global expert id
  std::vector<float> z_send;        // [pairs sent][L]
  for (int d = 0; d < N; ++d) {
    for (int64_t p : pairs[static_cast<size_t>(d)]) {
      expert_ids.push_back(idx[static_cast<size_t>(p)]);
      const float* zr = z + (p / K) * L;
      z_send.insert(z_send.end(), zr, zr + L);
    }
    meta_send[static_cast<size_t>(d)] = static_cast<int64_t>(pairs[static_cast<size_t>(d)].size());
    rows_send[static_cast<size_t>(d)] = meta_send[static_cast<size_t>(d)] * L;
  }
  const std::vector<int64_t> meta_recv = exchange_counts(ctx.world, meta_send);
  std::vector<int64_t> rows_recv(static_cast<size_t>(N));
  int64_t total = 0;
  for (int s = 0; s < N; ++s) {
    rows_recv[static_cast<size_t>(s)] = meta_recv[static_cast<size_t>(s)] * L;
    total += meta_recv[static_cast<size_t>(s)];
  }
  std::vector<int32_t> ids_recv(static_cast<size_t>(total));
  std::vector<float> z_recv(static_cast<size_t>(total * L));
  ctx.world.all_to_all_v(expert_ids.data(), meta_send.data(), ids_recv.data(), meta_recv.data());
  ctx.world.all_to_all_v(z_send.data(), rows_send.data(), z_recv.data(), rows_recv.data());

  // The owner's work: each received pair through its expert, rounded (a bf16 tensor on the GPU).
  std::vector<float> y_recv(static_cast<size_t>(total * L));
  for (int64_t q = 0; q < total; ++q) {
    const int e = ids_recv[static_cast<size_t>(q)];
    K3_CHECK(
        e >= ctx.local.expert_begin() && e < ctx.local.expert_begin() + ctx.local.expert_count(),
        "EP: expert ", e, " dispatched to rank ", ctx.rank, ", which does not hold it");
    const ExpertWeights& ew = w.experts[static_cast<size_t>(e)];
    float* y = y_recv.data() + q * L;
    cpu::glu_mlp(ew.w1, ew.w3, ew.w2, act, ctx.num, z_recv.data() + q * L, y);
    ctx.num.round(y, static_cast<size_t>(L));
  }

  // Combine: results go back to the dispatchers in the order they came.
  std::vector<float> y_back(z_send.size());
  ctx.world.all_to_all_v(y_recv.data(), rows_recv.data(), y_back.data(), rows_send.data());
  std::fill(y_pairs, y_pairs + n * K * L, 0.0f);
  size_t q = 0;
  for (int d = 0; d < N; ++d)
    for (int64_t p : pairs[static_cast<size_t>(d)]) {
      std::copy(y_back.begin() + static_cast<std::ptrdiff_t>(q * L),
                y_back.begin() + static_cast<std::ptrdiff_t>((q + 1) * L), y_pairs + p * L);
      ++q;
    }
}

}  // namespace

void moe_parallel(const RankContext& ctx, int layer, const float* x, int64_t n, float* out) {
  const ModelConfig& cfg = ctx.model;
  const MoeWeights& w = ctx.local.weights().layers[static_cast<size_t>(layer)].moe_w;
  const int K = cfg.num_experts_per_token;
  const int64_t H = cfg.hidden_size, L = cfg.expert_io_dim();
  const cpu::GluActivation act = cpu::activation_for(cfg);
  const cpu::RouterConfig rc = cpu::moe_router_config(cfg);
  const bool shared = !w.shared_gate.empty();

  // Router (replicated) and expert inputs per row.
  std::vector<int> idx(static_cast<size_t>(n * K));       // [n][K]
  std::vector<float> weight(static_cast<size_t>(n * K));  // [n][K]
  std::vector<float> z(static_cast<size_t>(n * L));       // [n][L]
  for (int64_t i = 0; i < n; ++i) {
    cpu::route(w.gate, w.score_bias.empty() ? nullptr : w.score_bias.data(), x + i * H, rc,
               idx.data() + i * K, weight.data() + i * K);
    cpu::moe_expert_input(w, ctx.num, x + i * H, static_cast<size_t>(L), z.data() + i * L);
  }

  // One TP all-reduce for both parts: red[n][K * L + H] = expert outputs per pair, then the
  // shared experts' partial output.
  const int64_t stride = K * L + H;
  std::vector<float> red(static_cast<size_t>(n * stride), 0.0f);
  std::vector<float> y_pairs(static_cast<size_t>(n * K * L));  // [n][K][L]
  if (ctx.layout.ep) {
    ep_dispatch_combine(ctx, w, z.data(), n, idx, y_pairs.data());
  } else {
    for (int64_t p = 0; p < n * K; ++p) {  // partial outputs of this rank's expert slices
      const ExpertWeights& e = w.experts[static_cast<size_t>(idx[static_cast<size_t>(p)])];
      cpu::glu_mlp(e.w1, e.w3, e.w2, act, ctx.num, z.data() + (p / K) * L, y_pairs.data() + p * L);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    std::copy(y_pairs.begin() + i * K * L, y_pairs.begin() + (i + 1) * K * L,
              red.begin() + i * stride);
    if (shared)
      cpu::glu_mlp(w.shared_gate, w.shared_up, w.shared_down, act, ctx.num, x + i * H,
                   red.data() + i * stride + K * L);
  }
  ctx.tp.all_reduce_sum(red.data(), static_cast<int64_t>(red.size()));

  // The complete expert sum in router order, then the single-rank tail.
  std::vector<float> acc(static_cast<size_t>(L)), routed(static_cast<size_t>(H));
  for (int64_t i = 0; i < n; ++i) {
    const float* r = red.data() + i * stride;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = 0; j < K; ++j) {
      const float wj = weight[static_cast<size_t>(i * K + j)];
      for (int64_t c = 0; c < L; ++c)  // EP outputs are rounded already: rounding is idempotent
        acc[static_cast<size_t>(c)] += wj * ctx.num.round(r[j * L + c]);
    }
    cpu::moe_latent_output(cfg, w, ctx.num, acc.data(), routed.data());
    float* o = out + i * H;
    for (int64_t c = 0; c < H; ++c) {
      float v = routed[static_cast<size_t>(c)];
      if (shared) v += ctx.num.round(r[K * L + c]);
      o[c] = ctx.num.round(v);
    }
  }
}

}  // namespace k3::parallel
