// `k3 diff`'s engine (cuda/step_diff.h) on synthesized tiny checkpoints: the report is complete
// (every sublayer of every layer, finite numbers, one logits distance per step), its free-running
// stock tokens are the teacher-forced stock tokens (graphs replay the eager bits), and the
// specialized step equals the stock one bit for bit under measured GEMM plans (the engine's
// default): both paths launch the same GEMMs, so they tune to the same plans, and every fusion of
// the specialized step rounds as the launches it replaces.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "backbone_test_util.h"
#include "cli/commands/diff_hook.h"
#include "cpu/backbone.h"
#include "cpu/ops_moe.h"
#include "cpu/sampling.h"
#include "cuda/step_diff.h"
#include "test_util.h"

namespace k3 {
namespace {

// Few steps keep the tapped (eager, one host copy per sublayer) pass short.
constexpr int kPromptTokens = 8;
constexpr int kSteps = 16;
// The command's default bound (the report's verdict; the tests ask for bit identity besides).
// Before the stock step launched the concatenated GEMMs too, the paths' GEMMs were tuned apart
// and this test failed about one run in six on an H100 (bench/RESULTS.md, fourteenth stop).
constexpr double kTolerance = cli::kDefaultStepDiffTolerance;
// A teacher-forced argmax may differ only at a near tie: the stock logits' top-2 gap below this
// share of their RMS (as the free-running check of test_cuda_specialized.cu).
constexpr double kTieGap = 0.1;
// The random tiny K3 model amplifies a one-ulp bf16 flip ~25x over its layers (test_cuda_backbone
// and test_cuda_specialized), so its standard is the bf16 noise floor: mean logits rel L2 within
// this factor of the fp32 CPU reference's distance from the bf16 one on the same tokens.
constexpr double kNoiseSlack = 1.5;

// Router near-ties: where the two paths' router inputs differ (a regression of their bit
// identity), a top-k selection whose margin is within bf16 noise may pick another expert, an
// O(1) change that every later step inherits and that hides where the paths first parted (run
// 41: logits rel L2 0.435 on tiny-kimi-linear, whose CPU run has a margin of 2.1e-5 at the first
// token; forty other prompts' smallest margins ranged 5e-5 .. 3e-3). So a prompt whose CPU bf16
// run, greedy as the diff's stock tokens, holds a margin below this is replaced by the next
// seed's: a regression then shows as the rounding difference that locates it.
constexpr float kRouterTieMargin = 1e-4f;

std::vector<int32_t> tie_free_prompt(const std::string& preset, uint64_t seed) {
  const LoadedModel& m = tiny_model(preset);
  const cpu::CpuBackbone ref = bf16_reference(m);
  const int64_t V = m.config.vocab_size;
  std::vector<int32_t> prompt;
  for (uint64_t attempt = 0; attempt < 8; ++attempt) {
    prompt.clear();
    for (const int64_t t : random_prompt(m.config, seed + attempt, kPromptTokens))
      prompt.push_back(static_cast<int32_t>(t));
    const cpu::RouterMarginProbe probe;
    cpu::DecodeState st = ref.new_state();
    std::vector<float> logits(static_cast<size_t>(V));
    int64_t tok = prompt[0];
    for (int i = 0; i < kPromptTokens + kSteps - 1; ++i) {
      ref.step(st, tok, logits.data());
      tok = i + 1 < kPromptTokens ? prompt[static_cast<size_t>(i + 1)]
                                  : cpu::argmax(logits.data(), V);
    }
    if (probe.min_margin() >= kRouterTieMargin) return prompt;
    std::printf("%s: the prompt of seed %llu has a router near-tie (margin %.2e); next seed\n",
                preset.c_str(), static_cast<unsigned long long>(seed + attempt),
                static_cast<double>(probe.min_margin()));
  }
  ADD_FAILURE() << preset << ": 8 prompts in a row with a router near-tie";
  return prompt;
}

cuda::StepDiffReport diff(const std::string& preset, const std::vector<int32_t>& prompt) {
  const LoadedModel& m = tiny_model(preset);
  cuda::StepDiffOptions o;
  o.steps = kSteps;
  o.tolerance = kTolerance;
  o.prompt = prompt;
  std::ostringstream text;
  cuda::StepDiffReport r = cuda::diff_specialized_vs_stock(m, o, text);
  std::printf("%s:\n%s", preset.c_str(), text.str().c_str());
  return r;
}

// Shape and consistency of the report, whatever the numbers.
void expect_complete(const std::string& preset, const cuda::StepDiffReport& r) {
  const ModelConfig& cfg = tiny_model(preset).config;
  const int steps = kPromptTokens + kSteps - 1;
  EXPECT_EQ(r.steps, steps) << preset;
  EXPECT_EQ(r.prompt_tokens, kPromptTokens) << preset;
  ASSERT_EQ(r.sublayers.size(), static_cast<size_t>(2 * cfg.num_hidden_layers)) << preset;
  for (size_t k = 0; k < r.sublayers.size(); ++k) {
    const cuda::SublayerDiff& s = r.sublayers[k];
    const int layer = static_cast<int>(k / 2);
    EXPECT_EQ(s.layer, layer) << preset << " entry " << k;
    EXPECT_EQ(s.kind, cfg.layer_kind(layer)) << preset << " layer " << layer;
    EXPECT_EQ(s.part, k % 2 ? "ffn" : "attn") << preset << " entry " << k;
    EXPECT_TRUE(std::isfinite(s.max_rel_l2) && std::isfinite(s.max_abs))
        << preset << " layer " << layer << " " << s.part;
    EXPECT_GE(s.worst_step, 0) << preset;
    EXPECT_LT(s.worst_step, steps) << preset;
  }
  ASSERT_EQ(r.logits_rel_l2.size(), static_cast<size_t>(steps)) << preset;
  for (int i = 0; i < steps; ++i)
    EXPECT_TRUE(std::isfinite(r.logits_rel_l2[static_cast<size_t>(i)])) << preset << " step " << i;
  ASSERT_EQ(r.teacher_stock.size(), static_cast<size_t>(steps)) << preset;
  EXPECT_EQ(r.argmax_agree + static_cast<int>(r.mismatches.size()), steps) << preset;
  // The stock path runs eagerly with the tap and as graphs without it: the same bits, so the
  // same greedy tokens; the generated token j is the teacher-forced argmax of step P - 1 + j.
  ASSERT_EQ(r.free_stock.size(), static_cast<size_t>(kSteps)) << preset;
  ASSERT_EQ(r.free_specialized.size(), static_cast<size_t>(kSteps)) << preset;
  for (int j = 0; j < kSteps; ++j)
    EXPECT_EQ(r.free_stock[static_cast<size_t>(j)],
              r.teacher_stock[static_cast<size_t>(kPromptTokens - 1 + j)])
        << preset << " generated token " << j;
  // With the argmax equal on every teacher-forced step, free-running sees the same inputs.
  if (r.mismatches.empty()) EXPECT_EQ(r.first_divergence, -1) << preset;
}

struct NoiseFloor {
  double mean_rel_l2 = 0;  // fp32 CPU logits vs bf16 CPU logits, mean over the steps
  int agree = 0;           // steps where their argmax agrees
};

// The fp32 CPU reference against the bf16 one, fed the report's tokens.
NoiseFloor cpu_noise_floor(const std::string& preset, const std::vector<int32_t>& prompt,
                           const cuda::StepDiffReport& r) {
  const LoadedModel& m = tiny_model(preset);
  const ModelConfig& cfg = m.config;
  const cpu::CpuBackbone ref = bf16_reference(m), ref32 = fp32_reference(m);
  cpu::DecodeState st = ref.new_state(), st32 = ref32.new_state();
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  std::vector<float> want(V), want32(V);
  NoiseFloor f;
  for (int i = 0; i < r.steps; ++i) {
    // Step i's token: the prompt, then the previous step's stock argmax (as the diff fed it).
    const int64_t tok = i < static_cast<int>(prompt.size())
                            ? prompt[static_cast<size_t>(i)]
                            : r.teacher_stock[static_cast<size_t>(i - 1)];
    ref.step(st, tok, want.data());
    ref32.step(st32, tok, want32.data());
    f.mean_rel_l2 += rel_l2(want32, want) / r.steps;
    f.agree +=
        cpu::argmax(want32.data(), cfg.vocab_size) == cpu::argmax(want.data(), cfg.vocab_size);
  }
  return f;
}

TEST(CudaStepDiff, TinyKimiLinearBitIdentical) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const cuda::StepDiffReport r =
      diff("tiny-kimi-linear", tie_free_prompt("tiny-kimi-linear", seed));
  expect_complete("tiny-kimi-linear", r);
  EXPECT_LE(r.max_sublayer_rel_l2(), kTolerance);
  EXPECT_LE(r.max_logits_rel_l2(), kTolerance);
  EXPECT_EQ(r.max_sublayer_rel_l2(), 0.0) << "the paths' boundary tensors are not bit-identical";
  EXPECT_EQ(r.max_logits_rel_l2(), 0.0) << "the paths' logits are not bit-identical";
  for (const auto& mm : r.mismatches)
    EXPECT_LT(mm.rel_gap, kTieGap) << "step " << mm.step << ": stock " << mm.stock
                                   << ", specialized " << mm.specialized << " at a clear gap";
  if (r.mismatches.empty()) EXPECT_TRUE(r.passed());
}

TEST(CudaStepDiff, TinyBitIdenticalWithinNoiseFloor) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const std::vector<int32_t> prompt = tie_free_prompt("tiny", seed);
  const cuda::StepDiffReport r = diff("tiny", prompt);
  expect_complete("tiny", r);
  double mean = 0;
  for (const double d : r.logits_rel_l2) mean += d;
  mean /= r.steps;
  const NoiseFloor f = cpu_noise_floor("tiny", prompt, r);
  std::printf(
      "  tiny: specialized vs stock logits rel L2 %.2e mean (max sublayer %.2e), argmax "
      "%d/%d; fp32 vs bf16 CPU %.2e mean, argmax %d/%d\n",
      mean, r.max_sublayer_rel_l2(), r.argmax_agree, r.steps, f.mean_rel_l2, f.agree, r.steps);
  EXPECT_LE(mean, kNoiseSlack * f.mean_rel_l2);
  EXPECT_EQ(r.max_sublayer_rel_l2(), 0.0) << "the paths' boundary tensors are not bit-identical";
  EXPECT_EQ(r.max_logits_rel_l2(), 0.0) << "the paths' logits are not bit-identical";
  EXPECT_GE(r.argmax_agree, f.agree - r.steps / 5);  // binomial spread: test_cuda_backbone
  // The bound the lead quotes for `k3 diff --model tiny` (report only: the amplification of the
  // random K3 model, not the executors, decides it).
  if (!r.passed())
    std::printf("  tiny: not within %.1e; k3 diff on this model needs a looser --tolerance\n",
                kTolerance);
}

}  // namespace
}  // namespace k3
