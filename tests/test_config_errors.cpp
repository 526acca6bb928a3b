// ModelConfig refusals: every unknown field, wrong type and inconsistency names its field.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"

namespace k3 {
namespace {

using json = nlohmann::json;

json fixture(const std::string& name) {
  std::ifstream in(std::string(K3_SOURCE_DIR) + "/tests/data/configs/" + name);
  EXPECT_TRUE(in) << name;
  return json::parse(in);
}

// The error message of parse_model_config(doc), or "" when it parses.
std::string parse_error(const json& doc) {
  try {
    parse_model_config(doc);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

struct ErrorCase {
  const char* fixture;
  std::function<void(json&)> mutate;
  std::string message;  // must appear in the error
};

TEST(ConfigErrors, EachRefusalNamesTheField) {
  auto tc = [](json& j) -> json& { return j["text_config"]; };
  auto la = [&](json& j) -> json& { return tc(j)["linear_attn_config"]; };
  auto qw = [&](json& j) -> json& {
    return tc(j)["quantization_config"]["config_groups"]["group_0"]["weights"];
  };
  const char* K3 = "k3.json";
  const char* KL = "kimi_linear_48b.json";
  const char* K31 = "k3_1.json";
  const ErrorCase cases[] = {
      // Unknown fields, with the full path.
      {K3, [&](json& j) { tc(j)["foo_bar"] = 1; }, "unknown config field \"text_config.foo_bar\""},
      {K3, [](json& j) { j["foo"] = 1; }, "unknown config field \"foo\""},
      {KL, [](json& j) { j["foo_bar"] = 1; }, "unknown config field \"foo_bar\""},
      {K3, [&](json& j) { la(j)["bar"] = 1; },
       "unknown config field \"text_config.linear_attn_config.bar\""},
      {K31, [&](json& j) { tc(j)["dsa_config"]["index_foo"] = 1; },
       "unknown config field \"text_config.dsa_config.index_foo\""},
      {K3, [&](json& j) { qw(j)["zzz"] = 1; },
       "unknown config field "
       "\"text_config.quantization_config.config_groups.group_0.weights.zzz\""},
      // Types.
      {K3, [&](json& j) { tc(j)["hidden_size"] = "7168"; },
       "config field \"text_config.hidden_size\" must be an integer, got string \"7168\""},
      {K3, [&](json& j) { tc(j)["hidden_size"] = 7168.5; },
       "\"text_config.hidden_size\" must be an integer"},
      {K3, [&](json& j) { tc(j)["mla_use_nope"] = 1; },
       "\"text_config.mla_use_nope\" must be a boolean"},
      {K3, [&](json& j) { la(j)["kda_layers"][0] = "1"; },
       "\"text_config.linear_attn_config.kda_layers[0]\" must be an integer"},
      {K3, [&](json& j) { tc(j)["hidden_act"] = 3; },
       "\"text_config.hidden_act\" must be a string"},
      {K3, [&](json& j) { tc(j)["rms_norm_eps"] = "1e-5"; },
       "\"text_config.rms_norm_eps\" must be a number"},
      {K3, [](json& j) { j["eos_token_id"] = "x"; },
       "\"eos_token_id\" must be an integer or a list of integers"},
      {K3, [](json& j) { j["dtype"] = "int8"; },
       "\"dtype\" must be one of bfloat16, float16, float32, got \"int8\""},
      {K3, [&](json& j) { tc(j)["linear_attn_config"] = 5; },
       "\"text_config.linear_attn_config\" must be an object"},
      {K3, [&](json& j) { tc(j).erase("hidden_size"); }, "\"text_config.hidden_size\" is required"},
      {K3, [&](json& j) { tc(j).erase("activation_situ_beta"); },
       "\"text_config.activation_situ_beta\" is required"},
      // The layer schedule.
      {K3, [&](json& j) { la(j)["kda_layers"].push_back(4); },
       "layer 4 is in both \"text_config.linear_attn_config.kda_layers\" and "
       "\"text_config.linear_attn_config.full_attn_layers\""},
      {K3, [&](json& j) { la(j)["kda_layers"].erase(0); },
       "layer 1 is in neither \"text_config.linear_attn_config.kda_layers\""},
      {K3, [&](json& j) { la(j)["full_attn_layers"].push_back(94); },
       "\"text_config.linear_attn_config.full_attn_layers\" has layer 94 outside 1..93"},
      {K3, [&](json& j) { la(j)["kda_layers"].push_back(1); },
       "\"text_config.linear_attn_config.kda_layers\" lists layer 1 twice"},
      {K3, [&](json& j) { la(j)["head_dim"] = 0; },
       "\"text_config.linear_attn_config.head_dim\" must be positive, got 0"},
      {K3, [&](json& j) { la(j)["short_conv_kernel_size"] = 0; },
       "\"text_config.linear_attn_config.short_conv_kernel_size\" must be >= 1"},
      {K3, [&](json& j) { la(j)["gate_lower_bound"] = 5.0; },
       "\"text_config.linear_attn_config.gate_lower_bound\" must be a negative number"},
      // MoE.
      {K3, [&](json& j) { tc(j)["num_experts_per_token"] = 897; },
       "\"text_config.num_experts_per_token\" must be in [1, num_experts = 896], got 897"},
      {K3, [&](json& j) { tc(j)["num_experts_per_token"] = 0; },
       "\"text_config.num_experts_per_token\" must be in [1, num_experts = 896], got 0"},
      {K3, [&](json& j) { tc(j)["topk_group"] = 2; },
       "\"text_config.topk_group\" must be in [1, num_expert_group = 1], got 2"},
      {K3, [&](json& j) { tc(j)["num_expert_group"] = 3; },
       "\"text_config.num_expert_group\" must divide num_experts = 896, got 3"},
      {K3, [&](json& j) { tc(j)["moe_router_activation_func"] = "tanh"; },
       "\"text_config.moe_router_activation_func\" must be \"sigmoid\" or \"softmax\""},
      {K3, [&](json& j) { tc(j)["topk_method"] = "aux"; }, "\"text_config.topk_method\" must be"},
      {K3, [&](json& j) { tc(j)["first_k_dense_replace"] = 94; },
       "\"text_config.first_k_dense_replace\" must be in [0, num_hidden_layers = 93], got 94"},
      {K3, [&](json& j) { tc(j)["moe_layer_freq"] = 0; },
       "\"text_config.moe_layer_freq\" must be >= 1, got 0"},
      {K3, [&](json& j) { tc(j)["routed_expert_hidden_size"] = 0; },
       "\"text_config.routed_expert_hidden_size\" must be positive, got 0"},
      {K3, [&](json& j) { tc(j)["routed_expert_hidden_size"] = nullptr; },
       "\"text_config.latent_moe_use_norm\" is true but routed_expert_hidden_size is unset"},
      {K3, [&](json& j) { tc(j)["num_experts_per_tok"] = 8; },
       "config fields \"text_config.num_experts_per_token\" and "
       "\"text_config.num_experts_per_tok\" disagree (16 vs 8)"},
      // Activation, attention, residual, MTP.
      {K3, [&](json& j) { tc(j)["hidden_act"] = "gelu"; },
       "\"text_config.hidden_act\" must be \"silu\" or \"situ\", got \"gelu\""},
      {K3, [&](json& j) { tc(j)["mla_use_nope"] = false; }, "rotary MLA is not supported"},
      {KL, [](json& j) { j.erase("mla_use_nope"); },
       "\"rope_theta\" is only accepted with mla_use_nope = true (rotary MLA is not supported)"},
      {KL,
       [](json& j) {
         j.erase("mla_use_nope");
         j.erase("rope_theta");
       },
       "\"mla_use_nope\" must be true: rotary MLA is not supported"},
      {KL,
       [](json& j) {
         j["rope_scaling"] = {{"type", "yarn"}};
       },
       "\"rope_scaling\" must be null"},
      {K3, [&](json& j) { tc(j)["qk_rope_head_dim"] = -1; },
       "\"text_config.qk_rope_head_dim\" must be >= 0, got -1"},
      {K3, [&](json& j) { tc(j)["attn_res_block_size"] = -1; },
       "\"text_config.attn_res_block_size\" must be >= 0"},
      {K3, [&](json& j) { tc(j)["num_nextn_predict_layers"] = 1; },
       "\"text_config.num_nextn_predict_layers\" must be 0: multi-token prediction (MTP)"},
      {K3, [&](json& j) { tc(j)["attention_bias"] = true; },
       "\"text_config.attention_bias\" must be false"},
      {K3, [&](json& j) { tc(j)["qk_head_dim"] = 128; },
       "\"text_config.qk_head_dim\" = 128 disagrees with qk_nope_head_dim + qk_rope_head_dim = "
       "192"},
      {KL,
       [](json& j) {
         j["layer_types"] = json::array();
         j["layer_types"].push_back("x");
       },
       "\"layer_types\" has 1 entries, num_hidden_layers is 27"},
      {KL, [](json& j) { j["mlp_layer_types"] = std::vector<std::string>(27, "sparse"); },
       "\"mlp_layer_types\" says \"sparse\" at layer 0, the derived schedule says \"dense\""},
      // Quantization.
      {K3, [&](json& j) { tc(j)["quantization_config"]["quant_method"] = "gptq"; },
       "\"text_config.quantization_config.quant_method\" must be \"compressed-tensors\""},
      {K3, [&](json& j) { tc(j)["quantization_config"]["format"] = "nvfp4-pack-quantized"; },
       "\"text_config.quantization_config.format\" must be \"mxfp4-pack-quantized\""},
      {K3, [&](json& j) { qw(j)["group_size"] = 16; },
       "\"text_config.quantization_config.config_groups.group_0.weights.group_size\" must be 32"},
      {K3, [&](json& j) { qw(j)["num_bits"] = 8; },
       "\"text_config.quantization_config.config_groups.group_0.weights.num_bits\" must be 4"},
      {K3,
       [&](json& j) {
         tc(j)["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
             {"num_bits", 8}};
       },
       "\"text_config.quantization_config.config_groups.group_0.input_activations\" must be null"},
      {K3, [&](json& j) { j["quantization_config"] = tc(j)["quantization_config"]; },
       "\"quantization_config\" appears both at the top level and in text_config"},
      {K3, [&](json& j) { qw(j)["type"] = "int"; },
       "\"text_config.quantization_config.config_groups.group_0.weights.type\" must be \"float\""},
      {K3,
       [&](json& j) {
         tc(j)["quantization_config"]["kv_cache_scheme"] = {{"num_bits", 8}};
       },
       "\"text_config.quantization_config.kv_cache_scheme\" must be null"},
      {KL,
       [](json& j) {
         j["rope_parameters"] = {{"rope_type", "yarn"}};
       },
       "\"rope_parameters.rope_type\" must be \"default\""},
      {KL, [](json& j) { j["max_position_embeddings"] = 131072; },
       "config fields \"max_position_embeddings\" and \"model_max_length\" disagree (131072 vs "
       "1048576)"},
      {KL, [](json& j) { j["dtype"] = "float16"; },
       "config fields \"dtype\" and \"torch_dtype\" disagree (F16 vs BF16)"},
      {KL, [](json& j) { j["linear_head_dim"] = 64; },
       "config fields \"linear_attn_config.head_dim\" and \"linear_head_dim\" disagree"},
      // DSA.
      {K31, [&](json& j) { tc(j)["dsa_config"]["index_k_norm_type"] = "batchnorm"; },
       "\"text_config.dsa_config.index_k_norm_type\" must be \"layernorm\" or \"rms\""},
      {K31, [&](json& j) { tc(j)["dsa_config"]["index_rope_dim"] = 200; },
       "\"text_config.dsa_config.index_rope_dim\" = 200 exceeds index_head_dim = 128"},
      {K31, [&](json& j) { tc(j)["dsa_config"]["index_topk"] = 0; },
       "\"text_config.dsa_config.index_topk\" must be positive, got 0"},
      {K31, [&](json& j) { tc(j)["dsa_config"].erase("index_n_heads"); },
       "\"text_config.dsa_config.index_n_heads\" is required"},
      // Layout and identity.
      {K3, [](json& j) { j["model_type"] = "deepseek_v3"; },
       "\"model_type\" must be \"kimi_k3\" (nested text_config) or \"kimi_linear\" (flat)"},
      {K3, [](json& j) { j["architectures"] = json::array({"LlamaForCausalLM"}); },
       "\"architectures\" must be [\"KimiK3ForConditionalGeneration\"] or"},
      {K3, [](json& j) { j["architectures"] = json::array({"KimiLinearForCausalLM"}); },
       "KimiLinearForCausalLM needs the flat model_type \"kimi_linear\" layout"},
      {K3, [&](json& j) { tc(j)["model_type"] = "kimi_k3"; },
       "\"text_config.model_type\" must be \"kimi_linear\""},
      {K3, [](json& j) { j.erase("text_config"); },
       "\"text_config\" is required for model_type \"kimi_k3\""},
      {KL, [](json& j) { j["text_config"] = json::object(); },
       "\"text_config\" is not allowed in the flat \"kimi_linear\" layout"},
      {K3, [&](json& j) { tc(j)["tie_word_embeddings"] = true; },
       "config fields \"tie_word_embeddings\" and \"text_config.tie_word_embeddings\" disagree"},
      {K3, [](json& j) { j["pad_token_id"] = 163840; },
       "\"pad_token_id\" = 163840 is outside the vocabulary [0, 163840)"},
  };
  for (const auto& c : cases) {
    json doc = fixture(c.fixture);
    c.mutate(doc);
    const std::string err = parse_error(doc);
    EXPECT_NE(err.find(c.message), std::string::npos)
        << "fixture " << c.fixture << "\n  expected: " << c.message << "\n  got: " << err;
  }
  EXPECT_GE(std::size(cases), 20u);
}

TEST(ConfigErrors, TieWordEmbeddingsTrueIsAllowed) {
  json kl = fixture("kimi_linear_48b.json");
  kl["tie_word_embeddings"] = true;
  EXPECT_TRUE(parse_model_config(kl).tie_word_embeddings);
}

}  // namespace
}  // namespace k3
