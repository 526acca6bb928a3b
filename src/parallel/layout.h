// A multi-rank layout in vLLM's terms, and the rank-local slice of the bound weights it implies.
//
//   world = tensor_parallel_size (tp) * data_parallel_size (dp); rank = dp_rank * tp + tp_rank.
//   TP: KDA / MLA heads, the dense FFN and the shared experts are split over the tp ranks of a
//       DP replica (q/k/v/gate/up projections by rows, o_proj / down by columns), partial
//       outputs all-reduced. Without EP the routed experts are split the same way.
//   EP (enable_expert_parallel): routed experts placed contiguously over all world ranks
//       (expert e on rank e / (E / world)); token rows are dispatched to the owners.
//   DP: each replica owns different requests; attention runs on its own rows only.
//   DCP (decode_context_parallel_size = tp): each MLA layer's latent cache is sharded by token
//       over the tp ranks (token t on tp rank t % dcp), partial attention merged by log-sum-exp.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/model_weights.h"
#include "runtime/deploy_config.h"

namespace k3::parallel {

struct ParallelLayout {
  int tp = 1;       // tensor_parallel_size
  int dp = 1;       // data_parallel_size
  bool ep = false;  // enable_expert_parallel
  int dcp = 1;      // decode_context_parallel_size: 1 or tp
  int world() const { return tp * dp; }
  int ep_size() const { return ep ? world() : 1; }
  bool multi_rank() const { return world() > 1 || ep || dcp > 1; }
};

// The layout a deployment asks for (tensor_parallel_size, data_parallel_size,
// enable_expert_parallel, decode_context_parallel_size).
ParallelLayout layout_of(const DeployConfig& d);

// Raises k3::Error naming the field when the model cannot be laid out this way (head counts or
// widths not divisible by tp, experts not divisible by the EP size, DCP other than 1 or tp, DSA
// with DCP).
void validate_layout(const ParallelLayout& layout, const ModelConfig& cfg);

// A [rows, cols] matrix sliced for one rank. A row slice is a view (pointer offset); a column
// slice is materialized into storage the shard owns: MXFP4 stays MXFP4 when the slice is whole
// 32-column blocks (the GPU reads nothing else), else it becomes exact fp32.
class RankWeights {
 public:
  RankWeights(const ModelConfig& cfg, const ModelWeights& w, const ParallelLayout& layout,
              int rank);
  RankWeights(const RankWeights&) = delete;
  RankWeights(RankWeights&&) = default;

  // The rank-local config the layer blocks see: num_attention_heads and
  // linear_attn_config.num_heads divided by tp (everything else as the model's).
  const ModelConfig& config() const { return cfg_; }
  const ModelWeights& weights() const { return w_; }
  // Routed experts held here: [expert_begin, expert_begin + expert_count) (all under no EP,
  // then each sliced along its intermediate dim). Others are empty matrices.
  int expert_begin() const { return expert_begin_; }
  int expert_count() const { return expert_count_; }

 private:
  WeightMatrix rows(const WeightMatrix& m, int64_t begin, int64_t count) const;
  WeightMatrix cols(const WeightMatrix& m, int64_t begin, int64_t count);

  ModelConfig cfg_;
  ModelWeights w_;
  int expert_begin_ = 0, expert_count_ = 0;
  std::vector<std::vector<uint8_t>> owned_;  // materialized column slices
};

}  // namespace k3::parallel
