// The CPU reference backbone: the executable specification of one K3 decode step
// (embedding, Attention Residuals, KDA / MLA(+DSA) layers, dense FFN / latent MoE, final norm,
// lm_head). Prefill runs token by token through the same step.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "cpu/decode_state.h"
#include "cpu/numerics.h"
#include "model/config.h"
#include "model/model_weights.h"

namespace k3::cpu {

// Optional per-layer observer (for diff reports): called after each sublayer with the layer
// index, "attn" or "ffn", and that sublayer's output [hidden].
using LayerObserver = std::function<void(int layer, const char* part, const float* out)>;

class CpuBackbone {
 public:
  CpuBackbone(const ModelConfig& cfg, const ModelWeights& w, StateDtypes state_dtypes,
              Numerics num = {}, int64_t max_context = 0);

  DecodeState new_state() const;
  // Consumes one token at state.position; writes logits[vocab_size] (fp32).
  void step(DecodeState& state, int64_t token, float* logits,
            const LayerObserver& observe = {}) const;
  // As step, for speculative decoding: also writes the final-normed hidden state (the lm_head
  // input) to hidden_out[hidden_size] when set; the layer input is `input` ([hidden_size] fp32,
  // e.g. a draft model's fused input) instead of the token's embedding row when set.
  void step_hidden(DecodeState& state, int64_t token, float* logits, float* hidden_out,
                   const float* input = nullptr) const;
  // Feeds tokens in order; returns the logits after the last one.
  std::vector<float> prefill(DecodeState& state, const std::vector<int64_t>& tokens) const;

  const ModelConfig& config() const { return cfg_; }
  int64_t max_context() const { return max_context_; }

 private:
  void run_step(DecodeState& state, int64_t token, const float* input, float* logits,
                float* hidden_out, const LayerObserver& observe) const;

  const ModelConfig& cfg_;
  const ModelWeights& w_;
  StateDtypes dtypes_;
  Numerics num_;
  int64_t max_context_;
};

}  // namespace k3::cpu
