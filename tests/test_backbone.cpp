// The CPU reference backbone end to end on synthesized tiny checkpoints: determinism, the
// DSA identity, state isolation and reuse, state dtypes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>

#include "cpu/backbone.h"
#include "cpu/generate.h"
#include "model/loaded_model.h"
#include "synth/presets.h"
#include "synth/synthesize.h"
#include "test_util.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;

// One synthesized checkpoint per preset for the whole test binary.
const LoadedModel& tiny_model(const std::string& preset) {
  static std::map<std::string, std::unique_ptr<LoadedModel>> cache;
  auto& slot = cache[preset];
  if (!slot) {
    const fs::path dir = test::temp_dir("backbone_" + preset);
    SynthOptions so;
    so.seed = 1;
    synthesize_checkpoint(synth_preset(preset), dir.string(), so);
    slot = LoadedModel::load(dir.string());
  }
  return *slot;
}

std::vector<int64_t> prompt_of(const ModelConfig& c, uint64_t seed, size_t n) {
  Rng r(seed);
  std::vector<int64_t> p;
  for (size_t i = 0; i < n; ++i) p.push_back(static_cast<int64_t>(r.next_u64() % 256));
  (void)c;
  return p;
}

std::vector<std::vector<float>> run_logits(const cpu::CpuBackbone& b,
                                           const std::vector<int64_t>& toks) {
  cpu::DecodeState st = b.new_state();
  std::vector<std::vector<float>> out;
  std::vector<float> logits(static_cast<size_t>(b.config().vocab_size));
  for (int64_t t : toks) {
    b.step(st, t, logits.data());
    out.push_back(logits);
  }
  return out;
}

TEST(Backbone, TinyGreedyDecodeIsDeterministicAndNonDegenerate) {
  const LoadedModel& m = tiny_model("tiny");
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  cpu::GenerateRequest req;
  req.prompt = prompt_of(m.config, 3, 12);
  req.max_new_tokens = 24;
  req.ignore_eos = true;
  const auto a = cpu::generate(b, req);
  const auto c = cpu::generate(b, req);
  ASSERT_EQ(a.tokens.size(), 24u);
  EXPECT_EQ(a.tokens, c.tokens);
  // Logits must carry signal: finite, spread out, not the same at every position.
  const auto logits = run_logits(b, req.prompt);
  double spread = 0;
  for (const auto& l : logits) {
    double mean = 0, var = 0;
    for (float v : l) {
      ASSERT_TRUE(std::isfinite(v));
      mean += v;
    }
    mean /= l.size();
    for (float v : l) var += (v - mean) * (v - mean);
    spread += std::sqrt(var / l.size());
  }
  EXPECT_GT(spread / logits.size(), 0.5);
  EXPECT_GT(test::max_abs_diff(logits.front(), logits.back()), 0.1);
}

// The synthetic weights are scaled so activations stay in a realistic range: every sublayer
// output has an RMS of order one, neither vanishing nor blowing up over the layers.
TEST(Backbone, SyntheticActivationsStayInARealisticRange) {
  for (const char* preset : {"tiny", "tiny-k3.1", "tiny-kimi-linear"}) {
    const LoadedModel& m = tiny_model(preset);
    const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
    cpu::DecodeState st = b.new_state();
    std::vector<float> logits(static_cast<size_t>(m.config.vocab_size));
    const size_t H = static_cast<size_t>(m.config.hidden_size);
    for (int64_t tok : prompt_of(m.config, 51, 8)) {
      b.step(st, tok, logits.data(), [&](int layer, const char* part, const float* out) {
        double ss = 0;
        for (size_t i = 0; i < H; ++i) ss += double(out[i]) * out[i];
        const double rms = std::sqrt(ss / H);
        EXPECT_GT(rms, 0.05) << preset << " layer " << layer << " " << part;
        EXPECT_LT(rms, 10.0) << preset << " layer " << layer << " " << part;
      });
    }
  }
}

TEST(Backbone, SeededSamplingIsReproducible) {
  const LoadedModel& m = tiny_model("tiny");
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  cpu::GenerateRequest req;
  req.prompt = prompt_of(m.config, 5, 6);
  req.max_new_tokens = 16;
  req.ignore_eos = true;
  req.sampling = {1.0f, 50, 0.95f, 1234};
  EXPECT_EQ(cpu::generate(b, req).tokens, cpu::generate(b, req).tokens);
}

TEST(Backbone, DsaWithTopkCoveringTheContextEqualsDenseMla) {
  const LoadedModel& m = tiny_model("tiny-k3.1");
  ModelConfig dense = m.config;
  dense.dsa_config = {};  // the indexer tensors are then ignored
  const ModelWeights dense_w = bind_weights(dense, *m.checkpoint);
  ModelConfig wide = m.config;
  wide.dsa_config.index_topk = 4096;
  const ModelWeights wide_w = bind_weights(wide, *m.checkpoint);
  const auto toks = prompt_of(m.config, 9, 20);
  const auto a = run_logits(cpu::CpuBackbone(dense, dense_w, {DType::BF16, DType::F32}), toks);
  const auto b = run_logits(cpu::CpuBackbone(wide, wide_w, {DType::BF16, DType::F32}), toks);
  for (size_t t = 0; t < toks.size(); ++t) EXPECT_LE(test::max_abs_diff(a[t], b[t]), 1e-6) << t;
  // With top-k 8 < context the sparse path really drops tokens, and the logits move.
  const auto s = run_logits(cpu::CpuBackbone(m.config, m.weights, {DType::BF16, DType::F32}), toks);
  for (size_t t = 0; t < 8; ++t) EXPECT_LE(test::max_abs_diff(a[t], s[t]), 1e-6) << t;
  EXPECT_GT(test::max_abs_diff(a.back(), s.back()), 1e-3);
}

TEST(Backbone, ResetSlotCarriesNoStaleStateAndRequestsDoNotInterfere) {
  const LoadedModel& m = tiny_model("tiny");
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  const auto p1 = prompt_of(m.config, 11, 10), p2 = prompt_of(m.config, 12, 10);
  const auto ref2 = run_logits(b, p2);
  // Interleave two requests token by token: each must see only its own state.
  cpu::DecodeState s1 = b.new_state(), s2 = b.new_state();
  std::vector<float> l1(m.config.vocab_size), l2(m.config.vocab_size);
  for (size_t i = 0; i < p1.size(); ++i) {
    b.step(s1, p1[i], l1.data());
    b.step(s2, p2[i], l2.data());
    EXPECT_EQ(l2, ref2[i]) << i;
  }
  // Reuse slot 1 for request 2 after a reset.
  s1.reset();
  for (size_t i = 0; i < p2.size(); ++i) {
    b.step(s1, p2[i], l1.data());
    EXPECT_EQ(l1, ref2[i]) << i;
  }
}

// Median over several short prompts: a single prompt can flip a top-k routing decision, which
// moves the logits by far more than the rounding that caused it (as in any MoE).
double median_rel_diff(const cpu::CpuBackbone& a, const cpu::CpuBackbone& b, size_t len) {
  std::vector<double> d;
  for (uint64_t seed = 0; seed < 9; ++seed) {
    const auto toks = prompt_of(a.config(), 100 + seed, len);
    d.push_back(test::rel_l2(run_logits(b, toks).back(), run_logits(a, toks).back()));
  }
  std::sort(d.begin(), d.end());
  return d[d.size() / 2];
}

TEST(Backbone, StateDtypesAreHonoured) {
  const LoadedModel& m = tiny_model("tiny");
  const cpu::CpuBackbone f32(m.config, m.weights, {DType::BF16, DType::F32});
  const cpu::CpuBackbone b16(m.config, m.weights, {DType::BF16, DType::BF16});
  const cpu::CpuBackbone c32(m.config, m.weights, {DType::F32, DType::F32});
  const auto toks = prompt_of(m.config, 21, 16);
  // Pre-conv projections are bf16 already, so an fp32 conv state stores the same values.
  EXPECT_EQ(run_logits(f32, toks).back(), run_logits(c32, toks).back());
  // A bf16 recurrent state rounds the delta-rule state each step: close, not identical.
  const double d = median_rel_diff(f32, b16, 3);
  EXPECT_GT(d, 0.0);
  EXPECT_LT(d, 5e-2);
  const cpu::CpuBackbone b(m.config, m.weights, {DType::F16, DType::BF16});
  const cpu::DecodeState st = b.new_state();
  EXPECT_EQ(st.kda[0].recurrent.dtype(), DType::BF16);
  EXPECT_EQ(st.kda[0].conv.dtype(), DType::F16);
  EXPECT_EQ(st.kda[3].recurrent.size(), 0u);  // layer 3 is MLA
}

TEST(Backbone, Fp32NumericsStayCloseToBf16Boundaries) {
  const LoadedModel& m = tiny_model("tiny");
  cpu::Numerics fp32;
  fp32.bf16_activations = false;
  const cpu::CpuBackbone a(m.config, m.weights, {DType::BF16, DType::F32});
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32}, fp32);
  const double d = median_rel_diff(a, b, 2);
  EXPECT_GT(d, 0.0);
  EXPECT_LT(d, 8e-2);  // ~20 bf16 roundings per layer over 9 layers, measured ~2-4%
}

TEST(Backbone, KimiLinearLayoutRunsWithoutAttnResOrLatentMoe) {
  const LoadedModel& m = tiny_model("tiny-kimi-linear");
  EXPECT_FALSE(m.config.has_attn_res());
  EXPECT_FALSE(m.config.linear_attn_config.gate_lower_bound.has_value());
  const auto toks = prompt_of(m.config, 41, 10);
  const auto l = run_logits(cpu::CpuBackbone(m.config, m.weights, {DType::BF16, DType::F32}), toks);
  for (float v : l.back()) ASSERT_TRUE(std::isfinite(v));
  EXPECT_GT(test::max_abs_diff(l.front(), l.back()), 0.1);
}

TEST(Backbone, ObserverSeesEverySublayerAndLimitsAreEnforced) {
  const LoadedModel& m = tiny_model("tiny");
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32}, {}, 4);
  cpu::DecodeState st = b.new_state();
  std::vector<float> logits(m.config.vocab_size);
  int calls = 0;
  b.step(st, 1, logits.data(), [&](int, const char*, const float*) { ++calls; });
  EXPECT_EQ(calls, 2 * m.config.num_hidden_layers);
  EXPECT_THROW(b.step(st, m.config.vocab_size, logits.data()), Error);
  for (int i = 0; i < 3; ++i) b.step(st, 2, logits.data());
  try {
    b.step(st, 2, logits.data());
    FAIL() << "context limit not enforced";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("context length 4 exceeded"), std::string::npos);
  }
}

}  // namespace
}  // namespace k3
