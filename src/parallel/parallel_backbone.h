// The CPU reference decode step run by N rank threads (ranks as threads, InProcessGroup
// collectives): TP, EP, DP (DEP = DP attention + EP MoE) and DCP layouts (parallel/layout.h).
// It computes the same function as cpu::CpuBackbone; where a layout changes the order of fp32
// partial sums (TP all-reduces, the DCP log-sum-exp merge) the logits differ by rounding only.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/decode_state.h"
#include "cpu/numerics.h"
#include "parallel/layout.h"

namespace k3::parallel {

// One request's state: it lives on one DP replica, each of whose tp ranks holds a shard (its
// KDA heads; the MLA latent cache whole, or its tokens under DCP).
struct ParallelState {
  int dp_rank = 0;
  std::vector<cpu::DecodeState> shards;  // [tp]: shard j on rank dp_rank * tp + j
  int64_t position() const { return shards.front().position; }
};

class ParallelCpuBackbone {
 public:
  ParallelCpuBackbone(const ModelConfig& cfg, const ModelWeights& w, cpu::StateDtypes dtypes,
                      ParallelLayout layout, cpu::Numerics num = {}, int64_t max_context = 0);

  ParallelState new_state(int dp_rank = 0) const;
  // One decode step of a batch: request i consumes tokens[i] at its position and gets
  // logits[i * vocab_size, (i + 1) * vocab_size) (fp32). Every rank runs the step; a DP
  // replica with no request in the batch runs a dummy step (zero rows) in lockstep.
  void step(const std::vector<ParallelState*>& requests, const std::vector<int64_t>& tokens,
            float* logits) const;

  const ModelConfig& config() const { return cfg_; }
  const ParallelLayout& layout() const { return layout_; }
  int64_t max_context() const { return max_context_; }

 private:
  const ModelConfig& cfg_;
  const ModelWeights& w_;
  cpu::StateDtypes dtypes_;
  ParallelLayout layout_;
  cpu::Numerics num_;
  int64_t max_context_;
  std::vector<RankWeights> ranks_;  // [world]
};

}  // namespace k3::parallel
