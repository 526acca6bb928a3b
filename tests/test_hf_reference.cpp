// The CPU reference against an implementation it shares no code with: transformers'
// KimiLinearForCausalLM (5.17, float32) run on the same synthetic checkpoint
// (tools/hf/reference_logits.py on the H200's Python; fixture in tests/data/hf_reference).
// Checks KDA (softplus gate, low-rank output gate, short conv, delta rule), NoPE MLA, the
// sigmoid router with correction bias, shared experts and the dense layer end to end.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cpu/backbone.h"
#include "model/loaded_model.h"
#include "synth/presets.h"
#include "synth/synthesize.h"
#include "test_util.h"

namespace k3 {
namespace {

// FNV-1a 64 over (name, bytes) of every tensor in name order: ties the fixture to the exact
// synthetic checkpoint it was computed on.
std::string checkpoint_fingerprint(const Checkpoint& ckpt) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](const uint8_t* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  };
  for (const auto& name : ckpt.names()) {
    mix(reinterpret_cast<const uint8_t*>(name.data()), name.size());
    const TensorView& t = ckpt.tensor(name);
    mix(t.data, t.nbytes);
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

TEST(HfReference, TinyKimiLinearLogitsMatchTransformers) {
  const auto fixture = nlohmann::json::parse(
      std::ifstream(std::string(K3_SOURCE_DIR) + "/tests/data/hf_reference/tiny-kimi-linear.json"));
  const std::filesystem::path dir = test::temp_dir("hf_ref");
  SynthOptions so;
  so.seed = fixture["seed"].get<uint64_t>();
  synthesize_checkpoint(synth_preset(fixture["preset"].get<std::string>()), dir.string(), so);
  const auto model = LoadedModel::load(dir.string());
  ASSERT_EQ(checkpoint_fingerprint(*model->checkpoint),
            fixture["checkpoint_fnv1a64"].get<std::string>())
      << "the synthetic checkpoint changed: regenerate the fixture with "
         "tools/hf/reference_logits.py";

  // fp32 throughout, like the reference run: no bf16 activations, an fp32 latent cache.
  cpu::Numerics fp32;
  fp32.bf16_activations = false;
  const cpu::CpuBackbone b(model->config, model->weights,
                           {DType::F32, DType::F32, cpu::LatentFormat::F32}, fp32);
  cpu::DecodeState st = b.new_state();
  std::vector<float> logits(static_cast<size_t>(model->config.vocab_size));
  const auto& tokens = fixture["tokens"];
  for (size_t t = 0; t < tokens.size(); ++t) {
    b.step(st, tokens[t].get<int64_t>(), logits.data());
    const auto ref = fixture["logits"][t].get<std::vector<float>>();
    // fp32 vs fp32 with different summation orders (and a chunked KDA on the reference side):
    // measured ~1e-6 to 4e-6.
    EXPECT_LT(test::rel_l2(logits, ref), 2e-5) << "position " << t;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace k3
