// What one rank thread of a ParallelCpuBackbone step sees, and the sublayers that need
// collectives. Every function here is called by every rank of the groups it uses, in the same
// order, with n = this rank's row count (0 on an idle DP rank: it still joins every collective).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/decode_state.h"
#include "cpu/numerics.h"
#include "parallel/communicator.h"
#include "parallel/layout.h"

namespace k3::parallel {

struct RankContext {
  const ModelConfig& model;  // the full model (not divided)
  const RankWeights& local;  // this rank's slice, with its rank-local config
  ParallelLayout layout;
  cpu::Numerics num;
  int rank = 0, tp_rank = 0, dp_rank = 0;
  Communicator& world;  // all ranks (the EP group)
  Communicator& tp;     // the tp ranks of this DP replica (also the DCP group)
};

// MLA with the latent cache sharded by token over the tp ranks (DCP): for each row i, appends
// the new token to this rank's shard when its position % dcp == tp_rank, then writes the o_proj
// input of this rank's heads: o[n][local heads * v_head_dim] (merged, gated, rounded).
//   x: [n][hidden] normed layer inputs, states: [n] this rank's shards of the requests' states.
void mla_dcp_attention(const RankContext& ctx, int layer, const float* x,
                       const std::vector<cpu::MlaLayerState*>& states,
                       const std::vector<int64_t>& positions, float* o);

// Latent MoE of layer `layer` over this rank's rows: out[n][hidden] (rounded), equal to
// cpu::moe_ffn per row up to fp32 summation order (TP partial sums). x: [n][hidden].
void moe_parallel(const RankContext& ctx, int layer, const float* x, int64_t n, float* out);

}  // namespace k3::parallel
