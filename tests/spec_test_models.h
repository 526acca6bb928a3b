// Shared by the speculative-decoding tests: one synthesized tiny checkpoint per preset for the
// whole test binary, and a repetitive prompt (so the n-gram drafter finds matches).
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cpu/backbone.h"
#include "cpu/generate.h"
#include "cpu/sampling.h"
#include "model/loaded_model.h"
#include "spec/drafter.h"
#include "synth/presets.h"
#include "synth/synthesize.h"
#include "test_util.h"

namespace k3::test {

inline const LoadedModel& spec_model(const std::string& preset) {
  static std::map<std::string, std::unique_ptr<LoadedModel>> cache;
  auto& slot = cache[preset];
  if (!slot) {
    const auto dir = temp_dir("spec_" + preset);
    SynthOptions so;
    so.seed = 7;
    synthesize_checkpoint(synth_preset(preset), dir.string(), so);
    slot = LoadedModel::load(dir.string());
  }
  return *slot;
}

// `period` distinct ids from `seed`, repeated `reps` times.
inline std::vector<int64_t> repetitive_prompt(uint64_t seed, size_t period, size_t reps) {
  Rng r(seed);
  std::vector<int64_t> unit;
  for (size_t i = 0; i < period; ++i) unit.push_back(static_cast<int64_t>(r.next_u64() % 200) + 1);
  std::vector<int64_t> p;
  for (size_t k = 0; k < reps; ++k) p.insert(p.end(), unit.begin(), unit.end());
  return p;
}

// A greedy case the n-gram drafter (1..4) can predict at least once: the prompt, its plain
// greedy continuation of `tokens` tokens, and the index of the first token a draft predicts.
// Random synthetic weights rarely copy their context, so acceptances are rare: greedy runs from
// seeded repetitive prompts are searched for one. Since prefill and decode run the same step,
// prompt + run[0, j) continues exactly with run[j, ...), so the case starts a few tokens before
// that acceptance. Deterministic (fixed synth seed and prompt seeds): always the same case.
struct AcceptingCase {  // greedy, ignore_eos
  std::vector<int64_t> prompt;
  cpu::GenerateResult plain;
  int first_accept = -1;  // index into plain.tokens of the first token a draft predicts
};

inline AcceptingCase accepting_case(const cpu::CpuBackbone& b, const std::string& key, int tokens) {
  static std::map<std::string, AcceptingCase> cache;
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  constexpr int kLead = 6;     // tokens of the case before its first acceptance
  constexpr int kSearch = 80;  // tokens searched per prompt (short cases keep the tests fast)
  const auto vocab = b.config().vocab_size;
  for (uint64_t seed = 1; seed <= 32; ++seed) {
    const std::vector<int64_t> prompt = repetitive_prompt(seed, 4, 4);
    cpu::DecodeState st = b.new_state();
    std::vector<float> logits = b.prefill(st, prompt);
    std::vector<int64_t> ctx = prompt;  // prompt + run
    spec::NgramDrafter d(1, 4);
    int accept = -1;  // index into the run of the first token a draft predicts
    while (true) {
      const int k = static_cast<int>(ctx.size() - prompt.size());  // index of the next token
      // The speculative run accepts run[k] iff the draft after prompt + run[0, k) starts with it.
      const int64_t tok = cpu::argmax(logits.data(), vocab);
      if (accept < 0 && k >= 1) {
        const auto prop = d.propose(ctx, 1).tokens;
        if (!prop.empty() && prop[0] == tok) accept = k;
      }
      ctx.push_back(tok);
      const int j = std::max(0, accept - kLead);  // the case's prompt takes run[0, j)
      if (accept >= 0 && k + 1 == j + tokens) {
        AcceptingCase c;
        c.prompt.assign(ctx.begin(), ctx.begin() + static_cast<int64_t>(prompt.size()) + j);
        c.plain.tokens.assign(ctx.begin() + static_cast<int64_t>(prompt.size()) + j, ctx.end());
        c.plain.finish_reason = "length";
        c.first_accept = accept - j;
        return cache[key] = c;
      }
      if (accept < 0 && k + 1 >= kSearch) break;
      b.step(st, tok, logits.data());
    }
  }
  ADD_FAILURE() << "no search run gave the n-gram drafter an accepted draft";
  return {};
}

}  // namespace k3::test
