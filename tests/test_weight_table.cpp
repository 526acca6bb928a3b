// The weight table against the spec's own accounting (k3-architecture.md section 6) and
// against checkpoints that are wrong in known ways.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/model_weights.h"
#include "model/weight_table.h"
#include "synth/presets.h"
#include "synth/synthesize.h"
#include "test_util.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  return test::temp_dir("wt_" + name);
}

TEST(WeightTable, FullK3MatchesThePublishedParameterAndByteCounts) {
  const ModelConfig c = synth_preset("k3");
  const auto table = weight_table(c);
  double params = 0, routed = 0, bytes = 0;
  size_t expert_tensors = 0;
  for (const auto& e : table) {
    const double n = static_cast<double>(numel(e.shapes[0]));
    bytes += n * dtype_size(e.dtypes[0]);
    if (e.kind == WeightKind::RoutedExpert) {
      ++expert_tensors;
      // weight_packed holds two params a byte; weight_scale holds no params.
      if (e.names[0].find("weight_packed") != std::string::npos) routed += 2 * n;
      continue;
    }
    params += n;
  }
  params += routed;
  // Spec 6.1: 2,779.5 B total, 2,722.74 B routed; 6.1 checkpoint bytes: 1,559.9 GB.
  EXPECT_NEAR(routed / 1e9, 2722.74, 0.01);
  EXPECT_NEAR(params / 1e9, 2779.5, 0.3);
  EXPECT_NEAR((params - routed) / 1e9, 56.74, 0.05);
  EXPECT_NEAR(bytes / 1e9, 1559.9, 0.5);
  EXPECT_EQ(expert_tensors, size_t(92) * 896 * 6);  // w1/w2/w3 x packed/scale
  EXPECT_EQ(checkpoint_bytes(c), static_cast<uint64_t>(bytes));
}

TEST(WeightTable, K3NamesFollowTheReleaseLayout) {
  const ModelConfig c = synth_preset("k3");
  const auto table = weight_table(c);
  std::map<std::string, const WeightEntry*> by;
  for (const auto& e : table) by[e.names[0]] = &e;
  const std::string p = "language_model.model.layers.";
  ASSERT_TRUE(by.count("language_model.model.embed_tokens.weight"));
  ASSERT_TRUE(by.count("language_model.lm_head.weight"));
  ASSERT_TRUE(by.count("language_model.model.output_attn_res_proj.weight"));
  // Layer 0: KDA + dense FFN; layer 3: MLA + MoE; layers 91 and 92 are both MLA.
  EXPECT_TRUE(by.count(p + "0.self_attn.q_conv1d.weight"));
  EXPECT_TRUE(by.count(p + "0.mlp.gate_proj.weight"));
  EXPECT_EQ(by.at(p + "0.self_attn.A_log")->shapes[0], (Shape{128}));  // padded to head_dim
  EXPECT_EQ(by.at(p + "0.self_attn.q_conv1d.weight")->dtypes[0], DType::F32);
  EXPECT_TRUE(by.count(p + "3.self_attn.kv_b_proj.weight"));
  EXPECT_EQ(by.at(p + "3.self_attn.q_b_proj.weight")->shapes[0], (Shape{18432, 1536}));
  EXPECT_TRUE(by.count(p + "91.self_attn.kv_a_proj_with_mqa.weight"));
  EXPECT_TRUE(by.count(p + "92.self_attn.kv_a_proj_with_mqa.weight"));
  EXPECT_EQ(by.at(p + "5.block_sparse_moe.experts.895.w2.weight_packed")->shapes[0],
            (Shape{3584, 1536}));
  EXPECT_EQ(by.at(p + "5.block_sparse_moe.experts.0.w1.weight_scale")->shapes[0],
            (Shape{3072, 112}));
  // g_proj has the same shape in KDA and MLA layers: resolved by layer type.
  EXPECT_EQ(by.at(p + "0.self_attn.g_proj.weight")->kind, WeightKind::KdaProj);
  EXPECT_EQ(by.at(p + "3.self_attn.g_proj.weight")->kind, WeightKind::MlaProj);
  EXPECT_FALSE(by.count(p + "3.self_attn.indexer.wk.weight"));
}

TEST(WeightTable, K31AddsTheIndexerAndKimiLinearUsesItsOwnLayout) {
  std::map<std::string, const WeightEntry*> by;
  const auto t31 = weight_table(synth_preset("k3.1"));
  for (const auto& e : t31) by[e.names[0]] = &e;
  const std::string p = "language_model.model.layers.3.self_attn.indexer.";
  EXPECT_EQ(by.at(p + "wq_b.weight")->shapes[0], (Shape{32 * 128, 1536}));
  EXPECT_EQ(by.at(p + "wk.weight")->shapes[0], (Shape{128, 7168}));
  EXPECT_TRUE(by.count(p + "k_norm.bias"));
  EXPECT_EQ(by.at(p + "weights_proj.weight")->shapes[0], (Shape{32, 7168}));

  by.clear();
  const auto tkl = weight_table(synth_preset("kimi-linear-48b"));
  for (const auto& e : tkl) by[e.names[0]] = &e;
  EXPECT_TRUE(by.count("model.layers.0.self_attn.g_a_proj.weight"));
  EXPECT_EQ(by.at("model.layers.0.self_attn.A_log")->shapes[0], (Shape{1, 1, 32, 1}));
  EXPECT_TRUE(by.count("model.layers.3.self_attn.q_proj.weight"));
  EXPECT_FALSE(by.count("model.layers.3.self_attn.g_proj.weight"));  // no MLA output gate
  EXPECT_EQ(by.at("model.layers.1.block_sparse_moe.experts.0.w1.weight")->shapes[0],
            (Shape{1024, 2304}));
  const auto& dense = *by.at("model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(dense.names.at(1), "model.layers.0.block_sparse_moe.gate_proj.weight");
  EXPECT_TRUE(by.count("lm_head.weight"));
}

// Writes the tiny checkpoint with one tensor dropped and one reshaped; the load error lists both.
TEST(WeightTable, OneErrorListsEveryMissingAndMismatchedTensor) {
  const ModelConfig c = synth_preset("tiny");
  const auto table = weight_table(c);
  std::vector<TensorSpec> specs;
  const std::string dropped = "language_model.model.layers.1.self_attn.k_proj.weight";
  const std::string reshaped = "language_model.model.layers.3.self_attn.kv_b_proj.weight";
  for (const auto& e : table) {
    if (e.names[0] == dropped) continue;
    Shape s = e.shapes[0];
    if (e.names[0] == reshaped) s[0] += 1;
    specs.push_back({e.names[0], e.dtypes[0], s});
  }
  specs.push_back({"vision_tower.patch_embed.weight", DType::BF16, {4, 4}});
  const fs::path dir = fresh_dir("broken");
  write_sharded_checkpoint(dir.string(), specs, 1 << 20, [](size_t, uint8_t* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(i * 7 + 1);
  });
  const auto ckpt = Checkpoint::open(dir.string());
  const WeightCheck r = check_weights(*ckpt, table);
  ASSERT_EQ(r.missing.size(), 1u);
  ASSERT_EQ(r.mismatched.size(), 1u);
  EXPECT_EQ(r.unknown, std::vector<std::string>{"vision_tower.patch_embed.weight"});
  try {
    require_weights(*ckpt, table);
    FAIL() << "a broken checkpoint was accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("missing: " + dropped), std::string::npos) << msg;
    EXPECT_NE(msg.find("mismatched: " + reshaped + ": got BF16 [129, 32]"), std::string::npos)
        << msg;
    EXPECT_EQ(msg.find("vision_tower"), std::string::npos) << msg;
  }
  fs::remove_all(dir);
}

TEST(WeightTable, NonZeroALogPaddingIsRefused) {
  ModelConfig c = synth_preset("tiny");
  const fs::path dir = fresh_dir("alog");
  synthesize_checkpoint(c, dir.string(), {});
  // Rewrite the checkpoint with a poisoned padding entry in layer 0's A_log.
  const auto table = weight_table(c);
  std::vector<TensorSpec> specs;
  for (const auto& e : table) specs.push_back({e.names[0], e.dtypes[0], e.shapes[0]});
  const fs::path dir2 = fresh_dir("alog2");
  {
    const auto src = Checkpoint::open(dir.string());
    write_sharded_checkpoint(dir2.string(), specs, 1 << 30, [&](size_t i, uint8_t* out, size_t n) {
      const TensorView& t = src->tensor(specs[i].name);
      std::memcpy(out, t.data, n);
      if (specs[i].name == "language_model.model.layers.0.self_attn.A_log") {
        const float poison = 0.5f;
        std::memcpy(out + 4 * (n / 4 - 1), &poison, 4);
      }
    });
  }
  const auto ckpt = Checkpoint::open(dir2.string());
  try {
    bind_weights(c, *ckpt);
    FAIL() << "non-zero A_log padding was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("A_log: padding entry 31"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
  fs::remove_all(dir2);
}

}  // namespace
}  // namespace k3
