// ModelConfig: the three published layouts parse with their exact values, the derived layer
// schedule, the to_json round trip, aliases, accepted extras and load_model_config. The refusal
// messages are in test_config_errors.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "synth/presets.h"

namespace k3 {
namespace {

using json = nlohmann::json;

json fixture(const std::string& name) {
  std::ifstream in(std::string(K3_SOURCE_DIR) + "/tests/data/configs/" + name);
  EXPECT_TRUE(in) << name;
  return json::parse(in);
}

TEST(ConfigK3, PublishedValues) {
  const ModelConfig c = parse_model_config(fixture("k3.json"));
  EXPECT_EQ(c.architecture, "KimiK3ForConditionalGeneration");
  EXPECT_EQ(c.model_type, "kimi_k3");
  EXPECT_TRUE(c.nested_text_config);
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.intermediate_size, 33792);
  EXPECT_EQ(c.num_hidden_layers, 93);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.moe_layer_freq, 1);
  EXPECT_EQ(c.num_attention_heads, 96);
  EXPECT_EQ(c.num_key_value_heads, 96);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_TRUE(c.mla_use_nope);
  EXPECT_TRUE(c.mla_use_output_gate);
  const auto& la = c.linear_attn_config;
  EXPECT_EQ(la.num_heads, 96);
  EXPECT_EQ(la.head_dim, 128);
  EXPECT_EQ(la.short_conv_kernel_size, 4);
  EXPECT_EQ(la.gate_lower_bound, -5.0f);
  EXPECT_TRUE(la.use_full_rank_gate);
  EXPECT_EQ(la.kda_layers.size(), 69u);
  EXPECT_EQ(la.full_attn_layers.size(), 24u);
  EXPECT_EQ(c.num_experts, 896);
  EXPECT_EQ(c.num_experts_per_token, 16);
  EXPECT_EQ(c.num_shared_experts, 2);
  EXPECT_EQ(c.moe_intermediate_size, 3072);
  EXPECT_EQ(c.routed_expert_hidden_size, 3584);
  EXPECT_TRUE(c.latent_moe_use_norm);
  EXPECT_EQ(c.moe_router_activation_func, "sigmoid");
  EXPECT_TRUE(c.moe_renormalize);
  EXPECT_EQ(c.routed_scaling_factor, 1.0f);
  EXPECT_TRUE(c.use_grouped_topk);
  EXPECT_EQ(c.num_expert_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.hidden_act, "situ");
  EXPECT_EQ(c.activation_situ_beta, 4.0f);
  EXPECT_EQ(c.activation_situ_linear_beta, 25.0f);
  EXPECT_EQ(c.attn_res_block_size, 12);
  EXPECT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_EQ(c.max_position_embeddings, 1048576);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.dtype, DType::BF16);
  EXPECT_EQ(c.bos_token_id, 163584);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{163586});
  EXPECT_EQ(c.pad_token_id, 163839);
  EXPECT_FALSE(c.has_dsa());
  const auto& q = c.quantization_config;
  EXPECT_TRUE(c.experts_mxfp4());
  EXPECT_EQ(q.quant_method, "compressed-tensors");
  EXPECT_EQ(q.format, "mxfp4-pack-quantized");
  EXPECT_EQ(q.num_bits, 4);
  EXPECT_EQ(q.group_size, 32);
  ASSERT_EQ(q.ignore.size(), 6u);
  EXPECT_EQ(q.ignore[2], "re:.*mlp\\.(gate|up|gate_up|down)_proj.*");
  EXPECT_EQ(c.kda_proj_dim(), 12288);
  EXPECT_EQ(c.q_head_dim(), 192);
  EXPECT_EQ(c.expert_io_dim(), 3584);
  EXPECT_EQ(c.shared_expert_dim(), 6144);
  EXPECT_EQ(c.tensor_prefix(), "language_model.model.");
  EXPECT_EQ(c.lm_head_name(), "language_model.lm_head.weight");
}

TEST(ConfigK3, LayerSchedule) {
  const ModelConfig c = parse_model_config(fixture("k3.json"));
  EXPECT_EQ(c.num_kda_layers(), 69);
  EXPECT_EQ(c.num_mla_layers(), 24);
  int mla = 0, moe = 0;
  std::vector<int> writes;
  for (int l = 0; l < 93; ++l) {
    const bool is_mla = c.layer_kind(l) == LayerKind::MLA;
    EXPECT_EQ(is_mla, (l + 1) % 4 == 0 || l == 92) << l;
    mla += is_mla;
    moe += c.is_moe_layer(l);
    if (c.is_attn_res_write_layer(l)) {
      writes.push_back(l);
      EXPECT_FALSE(is_mla) << "AttnRes write layer " << l << " is MLA";
    }
  }
  EXPECT_EQ(mla, 24);
  EXPECT_EQ(moe, 92);
  EXPECT_EQ(c.layer_kind(0), LayerKind::KDA);
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_EQ(c.layer_kind(91), LayerKind::MLA);
  EXPECT_EQ(c.layer_kind(92), LayerKind::MLA);
  EXPECT_EQ(writes, (std::vector<int>{0, 12, 24, 36, 48, 60, 72, 84}));
  EXPECT_THROW(c.layer_kind(93), Error);
  EXPECT_THROW(c.layer_kind(-1), Error);
  EXPECT_THROW(c.is_moe_layer(93), Error);
  EXPECT_THROW(c.is_attn_res_write_layer(93), Error);
}

TEST(ConfigKimiLinear, PublishedValues) {
  const ModelConfig c = parse_model_config(fixture("kimi_linear_48b.json"));
  EXPECT_EQ(c.architecture, "KimiLinearForCausalLM");
  EXPECT_EQ(c.model_type, "kimi_linear");
  EXPECT_FALSE(c.nested_text_config);
  EXPECT_EQ(c.hidden_size, 2304);
  EXPECT_EQ(c.num_hidden_layers, 27);
  EXPECT_EQ(c.intermediate_size, 9216);
  EXPECT_EQ(c.moe_intermediate_size, 1024);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 32);
  EXPECT_FALSE(c.q_lora_rank.has_value());
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.q_head_dim(), 192);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_FALSE(c.mla_use_output_gate);
  EXPECT_EQ(c.linear_attn_config.num_heads, 32);
  EXPECT_EQ(c.linear_attn_config.head_dim, 128);
  EXPECT_EQ(c.linear_attn_config.full_attn_layers, (std::vector<int>{4, 8, 12, 16, 20, 24, 27}));
  EXPECT_EQ(c.num_kda_layers(), 20);
  EXPECT_EQ(c.num_mla_layers(), 7);
  EXPECT_FALSE(c.linear_attn_config.gate_lower_bound.has_value());  // softplus gate form
  EXPECT_FALSE(c.linear_attn_config.use_full_rank_gate);            // low-rank g_a / g_b
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_token, 8);
  EXPECT_EQ(c.num_shared_experts, 1);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.446f);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_FALSE(c.has_attn_res());
  EXPECT_FALSE(c.routed_expert_hidden_size.has_value());
  EXPECT_FALSE(c.latent_moe_use_norm);
  EXPECT_EQ(c.expert_io_dim(), 2304);
  EXPECT_EQ(c.max_position_embeddings, 1048576);  // from model_max_length
  EXPECT_EQ(c.dtype, DType::BF16);                // from torch_dtype
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{163586});
  EXPECT_FALSE(c.experts_mxfp4());
  EXPECT_FALSE(c.has_dsa());
  EXPECT_EQ(c.tensor_prefix(), "model.");
  EXPECT_EQ(c.lm_head_name(), "lm_head.weight");
  EXPECT_EQ(c.layer_kind(26), LayerKind::MLA);
  EXPECT_EQ(c.layer_kind(25), LayerKind::KDA);
  for (int l = 0; l < 27; ++l) EXPECT_FALSE(c.is_attn_res_write_layer(l));
}

TEST(ConfigK31, DsaFields) {
  const ModelConfig c = parse_model_config(fixture("k3_1.json"));
  EXPECT_TRUE(c.has_dsa());
  EXPECT_EQ(c.dsa_config.index_n_heads, 32);
  EXPECT_EQ(c.dsa_config.index_head_dim, 128);
  EXPECT_EQ(c.dsa_config.index_topk, 2048);
  EXPECT_EQ(c.dsa_config.index_rope_dim, 0);
  EXPECT_EQ(c.dsa_config.index_k_norm_type, "layernorm");
  ModelConfig base = parse_model_config(fixture("k3.json"));
  base.dsa_config = c.dsa_config;
  EXPECT_EQ(base, c);  // K3.1 = K3 + dsa_config
}

TEST(ConfigRoundTrip, AllFixturesAndPresets) {
  for (const char* name : {"k3.json", "k3_1.json", "kimi_linear_48b.json"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = parse_model_config(fixture(name));
    const json j = model_config_to_json(c);
    EXPECT_EQ(j.contains("text_config"), c.nested_text_config);
    EXPECT_EQ(parse_model_config(j), c);
    EXPECT_EQ(model_config_to_json(parse_model_config(j)), j);
  }
  for (const auto& name : synth_preset_names()) {
    SCOPED_TRACE(name);
    const ModelConfig c = synth_preset(name);
    EXPECT_NO_THROW(validate_model_config(c));
    EXPECT_EQ(parse_model_config(model_config_to_json(c)), c);
  }
}

TEST(ConfigAliases, HfSpellingsMapOntoCanonicalFields) {
  const json canonical = fixture("kimi_linear_48b.json");
  json aliased = canonical;
  const std::pair<const char*, const char*> renames[] = {
      {"num_experts_per_token", "num_experts_per_tok"},
      {"num_shared_experts", "n_shared_experts"},
      {"moe_renormalize", "norm_topk_prob"},
      {"num_expert_group", "n_group"},
      {"num_experts", "num_local_experts"},
      {"intermediate_size", "dense_ffn_hidden"}};
  for (auto [from, to] : renames) {
    aliased[to] = aliased[from];
    aliased.erase(from);
  }
  aliased["max_position_embeddings"] = 1048576;  // both spellings, same value: fine
  aliased["linear_num_heads"] = 32;
  EXPECT_EQ(parse_model_config(aliased), parse_model_config(canonical));
  json k3 = fixture("k3.json");
  k3.erase("dtype");
  k3["torch_dtype"] = "bfloat16";
  k3["text_config"]["dtype"] = "bfloat16";
  EXPECT_EQ(parse_model_config(k3).dtype, DType::BF16);
}

TEST(ConfigTokens, TopLevelWinsTextConfigFallsBack) {
  json k3 = fixture("k3.json");
  k3["text_config"]["eos_token_id"] = 163585;  // the top level (163586) wins
  EXPECT_EQ(parse_model_config(k3).eos_token_ids, std::vector<int64_t>{163586});
  k3.erase("eos_token_id");
  EXPECT_EQ(parse_model_config(k3).eos_token_ids, std::vector<int64_t>{163585});
  k3["eos_token_id"] = json::array({163585, 163586});
  EXPECT_EQ(parse_model_config(k3).eos_token_ids, (std::vector<int64_t>{163585, 163586}));
  k3.erase("bos_token_id");
  k3["text_config"]["bos_token_id"] = 163584;
  EXPECT_EQ(parse_model_config(k3).bos_token_id, 163584);
}

TEST(ConfigIgnored, HfExtrasAreAccepted) {
  json k3 = fixture("k3.json");
  k3["auto_map"] = {{"AutoConfig", "configuration_kimi_k3.KimiK3Config"}};
  k3["ignore_index"] = -100;
  k3["image_placeholder"] = "<|kimi_image_placeholder|>";
  k3["vision_config"]["anything"] = {{"nested", true}};
  auto& t = k3["text_config"];
  t["architectures"] = json::array({"KimiLinearForCausalLM"});
  t["auto_map"] = k3["auto_map"];
  t["initializer_range"] = 0.02;
  t["use_cache"] = true;
  t["top_k"] = 50;
  t["head_dim"] = 64;
  t["qk_head_dim"] = 192;
  t["rope_theta"] = 10000.0;
  t["rope_scaling"] = nullptr;
  t["tie_word_embeddings"] = false;
  t["quantization_config"]["quantization_status"] = "compressed";
  t["quantization_config"]["config_groups"]["group_0"]["weights"]["observer"] = "minmax";
  json lt = json::array(), mlp = json::array();
  for (int l = 0; l < 93; ++l) {
    lt.push_back((l + 1) % 4 == 0 || l == 92 ? "full_attention" : "linear_attention");
    mlp.push_back(l == 0 ? "dense" : "sparse");
  }
  t["layer_types"] = lt;
  t["mlp_layer_types"] = mlp;
  EXPECT_EQ(parse_model_config(k3), parse_model_config(fixture("k3.json")));
}

TEST(ConfigLoad, FileDirectoryMissingAndInvalid) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("k3_config_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::copy_file(std::string(K3_SOURCE_DIR) + "/tests/data/configs/k3.json", dir / "config.json",
                fs::copy_options::overwrite_existing);
  EXPECT_EQ(load_model_config(dir.string()).hidden_size, 7168);
  EXPECT_EQ(load_model_config((dir / "config.json").string()).num_hidden_layers, 93);

  auto error_of = [](const std::string& p) -> std::string {
    try {
      load_model_config(p);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string missing = (dir / "nope.json").string();
  EXPECT_NE(error_of(missing).find("cannot read model config " + missing), std::string::npos);
  const fs::path empty_dir = dir / "empty";
  fs::create_directories(empty_dir);
  EXPECT_NE(error_of(empty_dir.string()).find((empty_dir / "config.json").string()),
            std::string::npos);
  const fs::path bad = dir / "bad.json";
  std::ofstream(bad) << "{\"model_type\": \"kimi_k3\",";
  EXPECT_NE(error_of(bad.string()).find("invalid JSON in model config " + bad.string()),
            std::string::npos);
  const fs::path wrong = dir / "wrong.json";
  std::ofstream(wrong) << "{\"model_type\": \"kimi_k3\", \"text_config\": 3}";
  const std::string e = error_of(wrong.string());
  EXPECT_NE(e.find(wrong.string() + ": config field \"text_config\" must be an object"),
            std::string::npos)
      << e;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace k3
