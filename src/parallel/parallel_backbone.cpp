// The step loop of one rank, and the threads that run all ranks of a step. The loop is
// cpu::CpuBackbone::step over this rank's rows, with the sharded sublayers finished by a TP
// all-reduce of their partial outputs (summed in fp32, rounded once after the sum, where the
// single-rank block rounds its output).
#include "parallel/parallel_backbone.h"

#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "cpu/layers.h"
#include "cpu/ops_attn_res.h"
#include "parallel/rank_step.h"

namespace k3::parallel {
namespace {

// The AttnRes bank of one row: banked block sums, mixed with the running partial sum P.
struct Bank {
  std::vector<std::vector<float>> blocks;  // each [hidden]
  void mix(const std::vector<float>& P, const std::vector<float>& w, int64_t H, float eps,
           const cpu::Numerics& num, float* out) const {
    std::vector<const float*> src;
    for (const auto& b : blocks) src.push_back(b.data());
    src.push_back(P.data());
    cpu::attn_res_mix(src.data(), static_cast<int>(src.size()), w.data(), H, eps, out);
    num.round(out, static_cast<size_t>(H));
  }
};

struct RankRows {
  std::vector<cpu::DecodeState*> states;  // this rank's shard of each local request
  std::vector<int64_t> tokens;
  std::vector<float*> logits;  // [vocab] per row; null on tp ranks other than 0
};

// Attention input mix (AttnRes bank or residual stream) and norm, for every row: x[n][H].
void attn_res_or_stream(const ModelConfig& cfg, const std::vector<float>& score_w,
                        const cpu::Numerics& num, std::vector<Bank>& banks,
                        const std::vector<std::vector<float>>& P, const float* norm_w, float* x) {
  const int64_t H = cfg.hidden_size;
  std::vector<float> h(static_cast<size_t>(H));
  for (size_t i = 0; i < P.size(); ++i) {
    if (cfg.has_attn_res() && !banks[i].blocks.empty())
      banks[i].mix(P[i], score_w, H, cfg.rms_norm_eps, num, h.data());
    else
      h = P[i];
    cpu::rms_norm(h.data(), norm_w, H, cfg.rms_norm_eps, x + static_cast<int64_t>(i) * H);
    num.round(x + static_cast<int64_t>(i) * H, static_cast<size_t>(H));
  }
}

void rank_step(const RankContext& ctx, RankRows& rows) {
  const ModelConfig& cfg = ctx.model;
  const ModelConfig& lc = ctx.local.config();
  const ModelWeights& w = ctx.local.weights();
  const cpu::Numerics& num = ctx.num;
  const int64_t H = cfg.hidden_size, n = static_cast<int64_t>(rows.states.size());
  const size_t Hz = static_cast<size_t>(H);

  std::vector<std::vector<float>> P(static_cast<size_t>(n), std::vector<float>(Hz));
  for (int64_t i = 0; i < n; ++i)
    w.embed.row_to_float(rows.tokens[static_cast<size_t>(i)], P[static_cast<size_t>(i)].data());
  std::vector<Bank> banks(static_cast<size_t>(n));
  std::vector<float> x(static_cast<size_t>(n) * Hz), sub(static_cast<size_t>(n) * Hz);
  std::vector<int64_t> positions;
  for (auto* s : rows.states) positions.push_back(s->position);

  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    // Attention side. A write layer banks the raw partial sum and restarts it.
    const bool restart = cfg.is_attn_res_write_layer(l);
    attn_res_or_stream(cfg, L.attn_res_attn, num, banks, P, L.input_norm.data(), x.data());
    if (restart)
      for (int64_t i = 0; i < n; ++i)
        banks[static_cast<size_t>(i)].blocks.push_back(P[static_cast<size_t>(i)]);
    if (L.kind == LayerKind::KDA) {
      std::vector<float> gated(static_cast<size_t>(lc.kda_proj_dim()));
      for (int64_t i = 0; i < n; ++i) {
        cpu::kda_attention_core(lc, L.kda, num,
                                rows.states[static_cast<size_t>(i)]->kda[static_cast<size_t>(l)],
                                x.data() + i * H, gated.data());
        cpu::linear(L.kda.o_proj, gated.data(), sub.data() + i * H);
      }
    } else {
      const size_t ow = static_cast<size_t>(lc.num_attention_heads * lc.v_head_dim);
      std::vector<float> o(static_cast<size_t>(n) * ow);  // [n][local heads * v]
      if (ctx.layout.dcp > 1) {
        std::vector<cpu::MlaLayerState*> st;
        for (auto* s : rows.states) st.push_back(&s->mla[static_cast<size_t>(l)]);
        mla_dcp_attention(ctx, l, x.data(), st, positions, o.data());
      } else {
        for (int64_t i = 0; i < n; ++i)
          cpu::mla_attention_core(lc, L.mla, num,
                                  rows.states[static_cast<size_t>(i)]->mla[static_cast<size_t>(l)],
                                  x.data() + i * H, o.data() + static_cast<size_t>(i) * ow);
      }
      for (int64_t i = 0; i < n; ++i)
        cpu::linear(L.mla.o_proj, o.data() + static_cast<size_t>(i) * ow, sub.data() + i * H);
    }
    ctx.tp.all_reduce_sum(sub.data(), n * H);
    num.round(sub);
    for (int64_t i = 0; i < n; ++i) {
      float* Pi = P[static_cast<size_t>(i)].data();
      const float* si = sub.data() + i * H;
      for (int64_t c = 0; c < H; ++c) Pi[c] = restart ? si[c] : num.round(Pi[c] + si[c]);
    }

    // MLP side.
    attn_res_or_stream(cfg, L.attn_res_mlp, num, banks, P, L.post_attn_norm.data(), x.data());
    if (L.moe) {
      moe_parallel(ctx, l, x.data(), n, sub.data());
    } else {
      for (int64_t i = 0; i < n; ++i)
        cpu::glu_mlp(L.dense.gate, L.dense.up, L.dense.down, cpu::activation_for(cfg), num,
                     x.data() + i * H, sub.data() + i * H);
      ctx.tp.all_reduce_sum(sub.data(), n * H);
      num.round(sub);
    }
    for (int64_t i = 0; i < n; ++i) {
      float* Pi = P[static_cast<size_t>(i)].data();
      const float* si = sub.data() + i * H;
      for (int64_t c = 0; c < H; ++c) Pi[c] = num.round(Pi[c] + si[c]);
    }
  }

  // Final mix, norm and the (replicated) lm_head; tp rank 0 writes the logits.
  attn_res_or_stream(cfg, w.output_attn_res, num, banks, P, w.final_norm.data(), x.data());
  for (int64_t i = 0; i < n; ++i) {
    if (rows.logits[static_cast<size_t>(i)])
      cpu::linear(w.lm_head, x.data() + i * H, rows.logits[static_cast<size_t>(i)]);
    ++rows.states[static_cast<size_t>(i)]->position;
  }
}

}  // namespace

ParallelCpuBackbone::ParallelCpuBackbone(const ModelConfig& cfg, const ModelWeights& w,
                                         cpu::StateDtypes dtypes, ParallelLayout layout,
                                         cpu::Numerics num, int64_t max_context)
    : cfg_(cfg),
      w_(w),
      dtypes_(dtypes),
      layout_(layout),
      num_(num),
      max_context_(max_context > 0 ? max_context : cfg.max_position_embeddings) {
  validate_layout(layout_, cfg_);
  for (int r = 0; r < layout_.world(); ++r) ranks_.emplace_back(cfg_, w_, layout_, r);
}

ParallelState ParallelCpuBackbone::new_state(int dp_rank) const {
  K3_CHECK(dp_rank >= 0 && dp_rank < layout_.dp, "dp rank ", dp_rank, " outside [0, ", layout_.dp,
           ")");
  ParallelState s;
  s.dp_rank = dp_rank;
  for (int j = 0; j < layout_.tp; ++j)
    s.shards.push_back(cpu::make_decode_state(ranks_[static_cast<size_t>(j)].config(), dtypes_));
  return s;
}

void ParallelCpuBackbone::step(const std::vector<ParallelState*>& requests,
                               const std::vector<int64_t>& tokens, float* logits) const {
  K3_CHECK(requests.size() == tokens.size(), "step: ", requests.size(), " requests but ",
           tokens.size(), " tokens");
  const int world = layout_.world(), tp = layout_.tp;
  std::vector<RankRows> rows(static_cast<size_t>(world));
  for (size_t i = 0; i < requests.size(); ++i) {
    ParallelState& s = *requests[i];
    K3_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab_size, "token id ", tokens[i],
             " is outside the vocabulary [0, ", cfg_.vocab_size, ")");
    K3_CHECK(s.dp_rank >= 0 && s.dp_rank < layout_.dp && static_cast<int>(s.shards.size()) == tp,
             "request ", i, " has a state made for another layout");
    K3_CHECK(s.position() < max_context_, "context length ", max_context_, " exceeded");
    for (int j = 0; j < tp; ++j) {
      RankRows& rr = rows[static_cast<size_t>(s.dp_rank * tp + j)];
      rr.states.push_back(&s.shards[static_cast<size_t>(j)]);
      rr.tokens.push_back(tokens[i]);
      rr.logits.push_back(j == 0 ? logits + i * static_cast<size_t>(cfg_.vocab_size) : nullptr);
    }
  }

  // Groups live for one step: the world (EP) group and one TP group per DP replica.
  InProcessGroup world_group(world);
  std::vector<std::unique_ptr<InProcessGroup>> tp_groups;
  for (int d = 0; d < layout_.dp; ++d) tp_groups.push_back(std::make_unique<InProcessGroup>(tp));
  std::mutex error_mu;
  std::exception_ptr error;
  auto run = [&](int r) {
    const int d = r / tp, j = r % tp;
    try {
      const RankContext ctx{cfg_,
                            ranks_[static_cast<size_t>(r)],
                            layout_,
                            num_,
                            r,
                            j,
                            d,
                            world_group.comm(r),
                            tp_groups[static_cast<size_t>(d)]->comm(j)};
      rank_step(ctx, rows[static_cast<size_t>(r)]);
    } catch (...) {
      {
        std::lock_guard lock(error_mu);
        if (!error) error = std::current_exception();  // the first failure, not the aborts
      }
      world_group.abort();
      for (auto& g : tp_groups) g->abort();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < world; ++r) threads.emplace_back(run, r);
  run(0);
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace k3::parallel
