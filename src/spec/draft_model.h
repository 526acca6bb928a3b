// A speculative draft model for K3 targets, and its drafter.
//
// Design (MTP / EAGLE style; a simplification of the published K3 DSpark drafts, which tap the
// hidden states of 5 target layers, draft a 7-token block in one non-causal pass and add Markov
// and confidence heads): draft entry i fuses the token x[i+1] with the target's final-normed
// hidden state h[i] (which predicted x[i+1]):
//   input_i = eh_proj(concat(RMSNorm_e(embed(x[i+1])), RMSNorm_h(h[i])))
// and runs it through dense MLA + dense FFN layers (a K3-layout checkpoint with no KDA and no
// MoE, run by the CPU backbone with its own MLA cache per request), final norm and lm_head, to
// predict x[i+2]. Drafting k tokens chains k steps, the draft's own output hidden state standing
// in for the target's; those chained entries are dropped afterwards, so the draft cache only
// ever holds entries built from real target hidden states.
//
// Checkpoint: the dense MLA body (config.json + shards; synth preset "tiny-draft") plus
// draft_head.safetensors with eh_proj.weight [hidden, 2 * hidden] bf16 and enorm.weight /
// hnorm.weight [hidden] bf16. Embedding and lm_head are the draft checkpoint's own (DSpark
// shares the target's; the synthetic draft stores copies of its own shape).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "cpu/backbone.h"
#include "io/safetensors.h"
#include "model/loaded_model.h"
#include "model/weight_matrix.h"
#include "spec/drafter.h"

namespace k3::spec {

inline constexpr const char* kDraftHeadFile = "draft_head.safetensors";

class DraftModel {
 public:
  // Loads dir (the body and draft_head.safetensors); k3::Error when it does not fit `target`
  // (hidden size, vocabulary) or is not all dense MLA.
  static std::unique_ptr<DraftModel> load(const std::string& dir, const ModelConfig& target);

  const cpu::CpuBackbone& backbone() const { return *backbone_; }
  int64_t hidden_size() const { return model_->config.hidden_size; }
  int64_t vocab_size() const { return model_->config.vocab_size; }
  // out[hidden] = eh_proj(concat(enorm(embed(token)), hnorm(hidden[hidden]))), bf16-rounded.
  void fuse(int64_t token, const float* hidden, float* out) const;

  // The weights, for executors of their own (the CUDA drafter): the dense MLA body and the
  // head's eh_proj [hidden, 2 * hidden] bf16, enorm / hnorm [hidden].
  const LoadedModel& body() const { return *model_; }
  const WeightMatrix& eh_proj() const { return eh_proj_; }
  const std::vector<float>& enorm() const { return enorm_; }
  const std::vector<float>& hnorm() const { return hnorm_; }

 private:
  std::unique_ptr<LoadedModel> model_;
  std::unique_ptr<SafetensorsFile> head_;
  WeightMatrix eh_proj_;
  std::vector<float> enorm_, hnorm_;  // [hidden]
  std::unique_ptr<cpu::CpuBackbone> backbone_;
};

// The draft's next token from its logits ([vocab] fp32), appended to d: the argmax for greedy
// requests, else a draw from the draft's distribution after the request's temperature / top-k /
// top-p, which is reported too (DraftTokens::probs) for rejection sampling.
int64_t pick_draft_token(const float* logits, int64_t vocab, const cpu::SamplingParams& sampling,
                         Rng& rng, DraftTokens& d);

// The draft-model drafter of one request (see the header comment for the entries it keeps).
// Greedy requests draft argmax tokens; sampled ones draw from the draft's distribution after
// the request's temperature / top-k / top-p and report it (DraftTokens::probs) for rejection
// sampling.
class DraftModelDrafter final : public Drafter {
 public:
  DraftModelDrafter(const DraftModel& model, const cpu::SamplingParams& sampling);
  bool needs_hidden() const override { return true; }
  void observe(const float* hidden, int64_t n) override;
  DraftTokens propose(std::span<const int64_t> context, int n) override;

 private:
  const DraftModel& m_;
  cpu::SamplingParams sampling_;
  Rng rng_;
  cpu::DecodeState st_;         // entry i: (x[i+1], h[i])
  int64_t observed_ = 0;        // target hidden states reported so far
  std::vector<float> pending_;  // [observed_ - st_.position][hidden]: not yet fed
  std::vector<float> logits_;   // [vocab] after the last real entry
  std::vector<float> hidden_;   // [hidden] draft output hidden after the last real entry
};

// Writes a synthetic draft checkpoint for `target` into dir: the "tiny-draft" body resized to
// the target's hidden size / vocabulary, and a draft head. Deterministic in seed.
void synthesize_draft_checkpoint(const ModelConfig& target, const std::string& dir, uint64_t seed);
// Only the draft head (kDraftHeadFile) for a draft body `draft` already written to dir (what
// `k3 synth --preset tiny-draft` adds).
void synthesize_draft_head(const ModelConfig& draft, const std::string& dir, uint64_t seed);

}  // namespace k3::spec
