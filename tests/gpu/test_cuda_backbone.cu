// The stock CUDA decode step end to end against the CPU reference backbone on synthesized tiny
// checkpoints: 64-token greedy decode, logits at every step, batched rows, slot reuse, and CUDA
// graph replay against eager execution.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backbone_test_util.h"
#include "core/rng.h"
#include "cpu/backbone.h"
#include "cpu/latent_format.h"
#include "cpu/sampling.h"
#include "cuda/backbone.h"
#include "model/loaded_model.h"
#include "synth/presets.h"
#include "synth/synthesize.h"
#include "test_util.h"

namespace k3 {
namespace {

// The standard: a few GPU ops differ from the CPU in the last fp32 ulp (CUDA expf / tanhf, fused
// multiply-adds, the order of a softmax or split-K sum), which flips an occasional bf16 rounding
// of a boundary tensor; these random synthetic models amplify such flips over the layers (~25x
// over 9 layers on tiny) and router near-ties then pick other experts. So the check is the
// model's own bf16 noise floor: against the bf16 CPU reference, the GPU's logits must be no
// further (mean relative L2 over the steps, within kNoiseSlack) than the fp32 CPU reference is
// on the same tokens, and its greedy choices must agree about as often. Free-running, the GPU
// must produce the CPU's greedy tokens while the CPU's top-2 gap is wide (kFreeRunGap).
// The noise-floor test's absolute allowance: a mean rel L2 this small passes even on a seed whose
// fp32-vs-bf16 distance happens to be smaller still (seen: 1.75e-2 against a typical 1e-1).
constexpr double kNoiseAbs = 0.02;
// Slack on the noise floor: both distances are sums of chaotic trajectories, so one seed in a few
// has the GPU above the fp32 reference's distance (measured up to 1.4x with packed latent caches,
// whose block scales turn a one-ulp input change into a requantized block); greedy agreement may
// trail the fp32 reference's by kAgreeSlack of the steps: at ~60% agreement over 72 steps each
// count has a binomial spread of ~4 steps, their difference ~6, and steps / 8 (1.5 sigma) failed
// one seed in a few dozen (tiny-k3.1 with an fp8 cache: 39 vs 41); steps / 5 is ~2.4 sigma.
constexpr int kAgreeSlackDiv = 5;
constexpr double kNoiseSlack = 1.5;
// Packed latent caches: 1.51x (tiny, nvfp4_ds_mla) and 1.93x (tiny, fp8, where the fp32 reference
// drew an unusually small 0.13 mean rel L2 against a typical 0.3) on two of four seeds of one run
// (bench/RESULTS.md, fifth stop), with the stock step's bits those of the commit before it under
// the model's plans (K3_LINEAR_TUNING=0 gave the same numbers): the spread of the statistic.
constexpr double kNoiseSlackPacked = 2.0;
constexpr double kTieMargin = 0.01;  // top-2 logit gap (of the RMS) counted as a near-tie
constexpr int kDecodeTokens = 64;

// Teacher-forced decode (the bf16 CPU reference's greedy tokens) on three executors: the bf16
// CPU reference, the fp32 CPU reference and the GPU; the noise-floor standard above.
void greedy_parity(const std::string& preset, int prompt_len,
                   cpu::LatentFormat fmt = cpu::LatentFormat::BF16) {
  const LoadedModel& m = tiny_model(preset);
  const ModelConfig& cfg = m.config;
  const cpu::CpuBackbone ref(cfg, m.weights, {DType::BF16, DType::F32, fmt});
  cpu::Numerics fp32;
  fp32.bf16_activations = false;
  // The fp32 reference keeps a packed cache format (its rounding is part of the function).
  const cpu::LatentFormat fmt32 = fmt == cpu::LatentFormat::BF16 ? cpu::LatentFormat::F32 : fmt;
  const cpu::CpuBackbone ref32(cfg, m.weights, {DType::F32, DType::F32, fmt32}, fp32);
  cuda::CudaBackboneOptions opt = options(1, true);
  opt.pool.latent = fmt;
  cuda::CudaBackbone gpu(cfg, m.weights, opt);
  SCOPED_TRACE(std::string("latent format ") + std::string(cpu::latent_format_name(fmt)));
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  cpu::DecodeState st = ref.new_state(), st32 = ref32.new_state();
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  std::vector<float> want(V), want32(V), got(V);
  std::vector<int64_t> tokens = random_prompt(cfg, seed, static_cast<size_t>(prompt_len));
  const int steps = prompt_len + kDecodeTokens;
  double sum_gpu = 0, sum_ref32 = 0, worst = 0;
  int agree_gpu = 0, agree_ref32 = 0, ties = 0;
  for (int i = 0; i < steps; ++i) {
    ref.step(st, tokens[static_cast<size_t>(i)], want.data());
    ref32.step(st32, tokens[static_cast<size_t>(i)], want32.data());
    const int32_t slot = 0, tok = static_cast<int32_t>(tokens[static_cast<size_t>(i)]);
    gpu.step({&slot, 1}, {&tok, 1});
    gpu.logits_to_host(1, got.data());
    int32_t gpu_id = -1;
    gpu.greedy(1, &gpu_id);
    for (size_t v = 0; v < V; ++v)
      if (!std::isfinite(got[v])) {
        ADD_FAILURE() << preset << " step " << i << ": logit " << v << " is " << got[v];
        return;
      }
    const double scale = rms(want);
    double w = 0;
    for (size_t v = 0; v < V; ++v)
      w = std::max(w, std::fabs(static_cast<double>(got[v]) - want[v]) / scale);
    worst = std::max(worst, w);
    sum_gpu += rel_l2(got, want);
    sum_ref32 += rel_l2(want32, want);
    const int64_t cpu_id = cpu::argmax(want.data(), cfg.vocab_size);
    agree_gpu += gpu_id == cpu_id;
    agree_ref32 += cpu::argmax(want32.data(), cfg.vocab_size) == cpu_id;
    std::vector<float> sorted = want;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    ties += (sorted[0] - sorted[1]) / scale < kTieMargin;
    if (i + 1 >= static_cast<int>(tokens.size())) tokens.push_back(cpu_id);
  }
  std::printf(
      "  %s [%s], %d steps: GPU vs bf16 CPU rel L2 %.2e mean (max|d|/rms %.2e), greedy agree "
      "%d/%d; fp32 CPU vs bf16 CPU rel L2 %.2e mean, greedy agree %d/%d; %d near-ties\n",
      preset.c_str(), std::string(cpu::latent_format_name(fmt)).c_str(), steps, sum_gpu / steps,
      worst, agree_gpu, steps, sum_ref32 / steps, agree_ref32, steps, ties);
  const double slack = fmt == cpu::LatentFormat::BF16 ? kNoiseSlack : kNoiseSlackPacked;
  EXPECT_LE(sum_gpu, std::max(slack * sum_ref32, kNoiseAbs * steps))
      << preset << ": the GPU is further from the bf16 reference than the fp32 reference is";
  EXPECT_GE(agree_gpu, agree_ref32 - steps / kAgreeSlackDiv) << preset;
}

// Per-sublayer diff report over the first steps (the `k3 diff` view): every sublayer output of
// the GPU step against the CPU observer's, relative to the CPU output's RMS.
void layer_diff(const std::string& preset, int steps, double tol) {
  const LoadedModel& m = tiny_model(preset);
  const cpu::CpuBackbone ref(m.config, m.weights, {DType::BF16, DType::F32});
  cuda::CudaBackbone gpu(m.config, m.weights, options(1, true));
  std::vector<std::vector<float>> want, got;
  std::vector<std::string> names;
  gpu.set_layer_tap([&](int l, const char* part, const std::vector<float>& out) {
    got.push_back(out);
    names.push_back(std::to_string(l) + "." + part);
  });
  cpu::DecodeState st = ref.new_state();
  std::vector<float> logits(static_cast<size_t>(m.config.vocab_size));
  const auto prompt = random_prompt(m.config, 21, static_cast<size_t>(steps));
  const size_t H = static_cast<size_t>(m.config.hidden_size);
  for (int i = 0; i < steps; ++i) {
    ref.step(st, prompt[i], logits.data(),
             [&](int, const char*, const float* out) { want.emplace_back(out, out + H); });
    const int32_t slot = 0, tok = static_cast<int32_t>(prompt[i]);
    gpu.step({&slot, 1}, {&tok, 1});
  }
  ASSERT_EQ(got.size(), want.size());
  std::string report;
  double worst = 0;
  for (size_t j = 0; j < got.size(); ++j) {
    double d = 0;
    for (size_t i = 0; i < H; ++i)
      d = std::max(d, std::fabs(static_cast<double>(got[j][i]) - want[j][i]));
    const double rel = d / std::max(rms(want[j]), 1e-30);
    worst = std::max(worst, rel);
    char line[96];
    std::snprintf(line, sizeof line, " %s:%.1e", names[j].c_str(), rel);
    report += line;
    if ((j + 1) % 8 == 0) report += "\n";
  }
  std::printf("  %s sublayer max|diff|/rms over %d steps:\n%s\n", preset.c_str(), steps,
              report.c_str());
  EXPECT_LE(worst, tol) << preset;
}

// The first sublayer (same input on both sides) to within a bf16 ulp or two; deeper ones carry
// the amplified flips described at the top, so the K3 presets get a report and a loose bound.
TEST(CudaBackbone, SublayerDiffTiny) {
  layer_diff("tiny", 3, 0.5);
}
TEST(CudaBackbone, SublayerDiffTinyK31) {
  layer_diff("tiny-k3.1", 3, 0.5);
}
TEST(CudaBackbone, SublayerDiffTinyKimiLinear) {
  layer_diff("tiny-kimi-linear", 3, 1e-6);
}

TEST(CudaBackbone, TinyKimiLinearGreedy64WithinBf16NoiseFloor) {
  greedy_parity("tiny-kimi-linear", 8);
}
TEST(CudaBackbone, TinyGreedy64WithinBf16NoiseFloor) {
  greedy_parity("tiny", 8);
}
TEST(CudaBackbone, TinyK31GreedyWithinBf16NoiseFloorWithDsa) {
  greedy_parity("tiny-k3.1", 8);
}

// Packed latent caches (kv_cache_dtype fp8, fp8_ds_mla, nvfp4_ds_mla): the GPU writes the CPU
// encoder's bytes (test_cuda_latent_cache), so the step holds the same noise-floor standard.
TEST(CudaBackbone, PackedLatentCachesWithinBf16NoiseFloor) {
  for (const auto fmt :
       {cpu::LatentFormat::FP8, cpu::LatentFormat::FP8_DS_MLA, cpu::LatentFormat::NVFP4_DS_MLA}) {
    greedy_parity("tiny", 8, fmt);
    greedy_parity("tiny-k3.1", 8, fmt);
  }
}

// Free-running greedy decode of 64 tokens on each side (tiny-kimi-linear, the model whose ops give
// the CPU's bits on short contexts): the token streams must be equal for as long as the CPU's
// top-2 gap exceeds kFreeRunGap of its logit RMS, a margin fixed in advance at ~8x the measured
// mean GPU logit error there (rel L2 1.2e-2); the run stops at the first narrower gap.
constexpr double kFreeRunGap = 0.1;
TEST(CudaBackbone, FreeRunningGreedyTokensEqualCpuWhileUnambiguous) {
  const LoadedModel& m = tiny_model("tiny-kimi-linear");
  const cpu::CpuBackbone ref(m.config, m.weights, {DType::BF16, DType::F32});
  cuda::CudaBackbone gpu(m.config, m.weights, options(1, true));
  const std::vector<int64_t> prompt = random_prompt(m.config, 11, 6);
  const size_t V = static_cast<size_t>(m.config.vocab_size);
  cpu::DecodeState st = ref.new_state();
  std::vector<float> want(V);
  int64_t cpu_next = 0, gpu_next = 0;
  int compared = 0;
  bool narrow = false;
  for (size_t i = 0; i < prompt.size() + kDecodeTokens && !narrow; ++i) {
    const int64_t ct = i < prompt.size() ? prompt[i] : cpu_next;
    const int64_t gt = i < prompt.size() ? prompt[i] : gpu_next;
    ASSERT_EQ(ct, gt) << "streams parted at step " << i;
    ref.step(st, ct, want.data());
    cpu_next = cpu::argmax(want.data(), m.config.vocab_size);
    const int32_t slot = 0, tok = static_cast<int32_t>(gt);
    gpu.step({&slot, 1}, {&tok, 1});
    int32_t id = 0;
    gpu.greedy(1, &id);
    gpu_next = id;
    if (i + 1 < prompt.size()) continue;
    std::vector<float> sorted = want;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    narrow = (sorted[0] - sorted[1]) / rms(want) < kFreeRunGap;
    if (!narrow) {
      EXPECT_EQ(gpu_next, cpu_next) << "step " << i;
      ++compared;
    }
  }
  std::printf("  tiny-kimi-linear free-running: %d greedy tokens compared%s\n", compared,
              narrow ? " (stopped at a top-2 gap below kFreeRunGap)" : "");
  EXPECT_GE(compared, 1);
}

// Per-step decode of several requests at once, in permuted slots, equals each request alone;
// then a slot is reset and reused by a new request, which must see none of the old state.
TEST(CudaBackbone, BatchedRowsAndSlotReuse) {
  const LoadedModel& m = tiny_model("tiny-kimi-linear");
  const ModelConfig& cfg = m.config;
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  const int n = 3, steps = 20;
  std::vector<std::vector<int64_t>> prompts;
  for (int r = 0; r < n; ++r) prompts.push_back(random_prompt(cfg, 100 + r, steps));

  // Alone (one row per step, its own backbone).
  std::vector<std::vector<float>> alone(n);
  for (int r = 0; r < n; ++r) {
    cuda::CudaBackbone g(cfg, m.weights, options(1, true));
    std::vector<float> l(V);
    for (int i = 0; i < steps; ++i) {
      const int32_t slot = 0, tok = static_cast<int32_t>(prompts[r][i]);
      g.step({&slot, 1}, {&tok, 1});
      g.logits_to_host(1, l.data());
    }
    alone[r] = l;
  }
  // Batched, rows in slots {2, 0, 1}.
  cuda::CudaBackbone g(cfg, m.weights, options(4, true));
  const std::vector<int32_t> slots = {2, 0, 1};
  std::vector<float> all(V * n);
  for (int i = 0; i < steps; ++i) {
    std::vector<int32_t> toks;
    for (int r = 0; r < n; ++r) toks.push_back(static_cast<int32_t>(prompts[r][i]));
    g.step(slots, toks);
    g.logits_to_host(n, all.data());
  }
  for (int r = 0; r < n; ++r)
    expect_batched_close({all.begin() + r * V, all.begin() + (r + 1) * V}, alone[r],
                         "row " + std::to_string(r));
  // Reuse slot 0 (request 1's) for request 2's prompt: equals request 2 alone, bit for bit
  // against a fresh single-row run with the same plans.
  g.reset_slot(0);
  std::vector<float> l(V);
  for (int i = 0; i < steps; ++i) {
    const int32_t slot = 0, tok = static_cast<int32_t>(prompts[2][i]);
    g.step({&slot, 1}, {&tok, 1});
    g.logits_to_host(1, l.data());
  }
  EXPECT_EQ(l, alone[2]) << "a reused slot must behave like a fresh one";
  EXPECT_EQ(g.position(0), steps);
}

// Graph replay gives the same bits as eager execution, step after step.
TEST(CudaBackbone, GraphReplayEqualsEager) {
  for (const std::string preset : {"tiny", "tiny-k3.1"}) {
    const LoadedModel& m = tiny_model(preset);
    const size_t V = static_cast<size_t>(m.config.vocab_size);
    cuda::CudaBackbone eager(m.config, m.weights, options(2, false));
    cuda::CudaBackbone graph(m.config, m.weights, options(2, true));
    const auto p0 = random_prompt(m.config, 5, 12), p1 = random_prompt(m.config, 6, 12);
    std::vector<float> a(2 * V), b(2 * V);
    const std::vector<int32_t> slots = {1, 0};
    for (int i = 0; i < 12; ++i) {
      const std::vector<int32_t> toks = {static_cast<int32_t>(p0[i]), static_cast<int32_t>(p1[i])};
      eager.step(slots, toks);
      graph.step(slots, toks);
      eager.logits_to_host(2, a.data());
      graph.logits_to_host(2, b.data());
      ASSERT_EQ(a, b) << preset << " step " << i;
    }
    EXPECT_EQ(graph.graphs_captured(), 1) << preset;
    EXPECT_EQ(eager.graphs_captured(), 0) << preset;
  }
}

TEST(CudaBackbone, RefusesBadSteps) {
  const LoadedModel& m = tiny_model("tiny");
  cuda::CudaBackbone g(m.config, m.weights, options(3, true, 4));
  // A slot's rows must be consecutive (a run); {0, 1, 0} would give slot 0 two runs.
  const std::vector<int32_t> split = {0, 1, 0}, toks = {1, 2, 3};
  EXPECT_THROW(g.step(split, toks), Error);
  const int32_t slot = 0, bad = static_cast<int32_t>(m.config.vocab_size);
  EXPECT_THROW(g.step({&slot, 1}, {&bad, 1}), Error);
  const int32_t tok = 1;
  for (int i = 0; i < 4; ++i) g.step({&slot, 1}, {&tok, 1});
  EXPECT_THROW(g.step({&slot, 1}, {&tok, 1}), Error) << "context of 4 tokens exceeded";
}

}  // namespace
}  // namespace k3
