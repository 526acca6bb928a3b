// `k3 diff`: the specialized decode step (StepPath::Specialized) against the stock one, sublayer
// by sublayer. One CudaBackbone with two slots: slot 0 steps on the stock path, slot 1 on the
// specialized path, both fed the same token every step (the prompt, then the stock path's
// greedy token), so any difference is the executors' and not their inputs'. A layer tap
// collects every sublayer's output of both; a second pass without the tap (graphs, as served)
// lets each path run free on its own greedy tokens and reports where they first part.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "cli/commands/diff_hook.h"
#include "model/config.h"

namespace k3 {
struct LoadedModel;
}

namespace k3::cuda {

struct StepDiffOptions {
  int steps = 64;                                     // generated tokens after the prompt
  std::vector<int32_t> prompt;                        // teacher-forced token ids (at least one)
  double tolerance = cli::kDefaultStepDiffTolerance;  // bound on every rel L2
  bool verbose = false;                               // per-step logits lines and tokens
};

// One sublayer's distance over the teacher-forced steps (a = specialized, b = stock).
struct SublayerDiff {
  int layer = 0;
  LayerKind kind = LayerKind::KDA;
  std::string part;       // "attn" or "ffn"
  double max_rel_l2 = 0;  // max over steps of |a - b| / |b|
  double max_abs = 0;     // max over steps and elements of |a - b|
  int worst_step = -1;    // step of max_rel_l2
};

// A teacher-forced step whose argmax differs; rel_gap is the stock logits' top-2 gap over their
// RMS (a near tie, ~0, flips on summation order alone).
struct ArgmaxMismatch {
  int step = 0;
  int32_t stock = 0, specialized = 0;
  double rel_gap = 0;
};

struct StepDiffReport {
  double tolerance = 0;
  int prompt_tokens = 0;
  int steps = 0;                        // teacher-forced steps: prompt + generated - 1
  std::vector<SublayerDiff> sublayers;  // layer order, attn then ffn
  std::vector<double> logits_rel_l2;    // [steps]
  int argmax_agree = 0;                 // of `steps`
  // [steps] the stock argmax of each teacher-forced step: after the prompt's last token these
  // are the generated tokens, and step i + 1 is fed step i's.
  std::vector<int32_t> teacher_stock;
  std::vector<ArgmaxMismatch> mismatches;
  // Free-running greedy: each path on its own tokens after the prompt.
  std::vector<int32_t> free_stock, free_specialized;  // [generated tokens]
  int first_divergence = -1;  // index into the generated tokens; -1: identical

  double max_sublayer_rel_l2() const;
  double max_logits_rel_l2() const;
  // Every rel L2 within tolerance and the teacher-forced argmax equal on every step.
  bool passed() const;
};

// Runs both passes on the GPU (current device) and prints the table and summary to out.
StepDiffReport diff_specialized_vs_stock(const LoadedModel& model, const StepDiffOptions& opt,
                                         std::ostream& out);

// The `k3 diff` runner (cli::StepDiffRunner) that main() installs in CUDA builds.
bool run_step_diff(const LoadedModel& model, const cli::StepDiffArgs& args, std::ostream& out);

}  // namespace k3::cuda
