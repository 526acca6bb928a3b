// The synthetic K3 rank k3_bench_step times: one TP / EP rank of the full model, its layers
// replicated from a shallow template checkpoint, and the byte floor of its decode step.
//
// Sharding (as parallel::RankWeights lays a rank out): attention heads, KDA heads, the dense FFN,
// the shared experts and the lm_head vocabulary divided by tp; the router whole (every rank
// ranks all E experts); the latent down / up projections whole (the latent norm needs the
// complete expert sum, reduced in latent space before it); routed experts: this rank's
// E / ep contiguous ones (rank 0's: [0, E / ep)), the others empty.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "model/config.h"
#include "model/model_weights.h"

namespace k3::bench {

struct RankShape {
  int layers = 93, tp = 16, ep = 16;
  bool dsa = false;  // k3.1 (DSA indexer) instead of k3
};

// The rank's config (full expert count: the router's E), and the template's, which
// synthesizes only the rank's experts (E / ep) and the full shared-expert width.
ModelConfig rank_config(const RankShape& s);
ModelConfig template_config(const RankShape& s, int template_layers);

// The rank's weights from the template's: layer l takes the next template layer of its kind
// (round robin); per MoE layer a fresh [E, hidden] router and score bias (random, at the
// template router's scale: the template holds only E / ep rows), experts [0, E / ep) from the
// template and the rest empty, the shared experts cut to their TP shard. `keep` owns the new
// storage.
ModelWeights rank_weights(const ModelWeights& tmpl, const ModelConfig& rank, const RankShape& s,
                          std::deque<std::vector<uint8_t>>& keep);

// Bytes a decode step must read, per part.
struct Floor {
  double fixed = 0;   // weights every step reads
  double expert = 0;  // one routed expert (w1 + w3 + w2)
  int local_experts = 0, moe_layers = 0, mla_layers = 0, kda_layers = 0;
  double kda_state = 0;   // per row per KDA layer, read + write
  double latent_row = 0;  // per cached token per MLA layer
};
Floor floor_of(const ModelConfig& c, const ModelWeights& w);

// Expected distinct local experts a batch of `rows` touches per layer under uniform routing:
// each row picks k of E, so a given expert is missed by all rows with (1 - k / E)^rows.
double expected_local_experts(const Floor& f, const ModelConfig& c, int rows);

// The floor's bytes at `rows` rows of `ctx` cached tokens: fixed weights, the experts expected
// above, each row's latent cache (min(ctx, DSA top-k) rows per MLA layer) and KDA state.
double floor_bytes(const Floor& f, const ModelConfig& c, int rows, int64_t ctx);

}  // namespace k3::bench
