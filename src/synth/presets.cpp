#include "synth/presets.h"

#include <algorithm>

#include "core/error.h"
#include "synth/tokenizer_synth.h"

namespace k3 {
namespace {

// The published K3 text config (spec section 1.2).
ModelConfig k3_full() {
  ModelConfig c;
  c.architecture = "KimiK3ForConditionalGeneration";
  c.model_type = "kimi_k3";
  c.nested_text_config = true;
  c.vocab_size = 163840;
  c.hidden_size = 7168;
  c.intermediate_size = 33792;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 1;
  c.num_attention_heads = 96;
  c.num_key_value_heads = 96;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.mla_use_nope = true;
  c.mla_use_output_gate = true;
  c.linear_attn_config.num_heads = 96;
  c.linear_attn_config.head_dim = 128;
  c.linear_attn_config.short_conv_kernel_size = 4;
  c.linear_attn_config.gate_lower_bound = -5.0f;
  c.linear_attn_config.use_full_rank_gate = true;
  c.num_experts = 896;
  c.num_experts_per_token = 16;
  c.num_shared_experts = 2;
  c.moe_intermediate_size = 3072;
  c.routed_expert_hidden_size = 3584;
  c.latent_moe_use_norm = true;
  c.routed_scaling_factor = 1.0f;
  c.hidden_act = "situ";
  c.activation_situ_beta = 4.0f;
  c.activation_situ_linear_beta = 25.0f;
  c.attn_res_block_size = 12;
  c.rms_norm_eps = 1e-5f;
  c.max_position_embeddings = 1048576;
  c.dtype = DType::BF16;
  c.bos_token_id = 163584;
  c.eos_token_ids = {163586};
  c.pad_token_id = 163839;
  c.quantization_config.present = true;
  c.quantization_config.quant_method = "compressed-tensors";
  c.quantization_config.format = "mxfp4-pack-quantized";
  c.quantization_config.ignore = {
      "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
      "re:.*lm_head.*",   "re:.*vision_tower.*",   "re:.*mm_projector.*"};
  set_k3_layer_schedule(c, 93);
  return c;
}

void add_dsa(ModelConfig& c, int heads, int head_dim, int topk) {
  c.dsa_config.enabled = true;
  c.dsa_config.index_n_heads = heads;
  c.dsa_config.index_head_dim = head_dim;
  c.dsa_config.index_topk = topk;
  c.dsa_config.index_rope_dim = 0;
  c.dsa_config.index_k_norm_type = "layernorm";
}

// The dimensions every tiny preset shares: the structure of the full model at a size the CPU
// decodes in milliseconds. Vocabulary: 256 byte tokens plus specials (the byte-level fallback).
void shrink_to_tiny(ModelConfig& c) {
  c.vocab_size = 320;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.kv_lora_rank = 32;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 16;
  c.linear_attn_config.num_heads = 4;
  c.linear_attn_config.head_dim = 32;
  c.moe_intermediate_size = 64;
  c.max_position_embeddings = 4096;
  c.bos_token_id = 256;
  c.eos_token_ids = {258};
  c.pad_token_id = 319;
}

ModelConfig k3_tiny() {
  ModelConfig c = k3_full();
  shrink_to_tiny(c);
  // The synthetic BPE tokenizer's layout instead of the byte-level one: 768 ranks, then the
  // specials where K3 has them (bos [BOS], eos <|end_of_msg|>, pad [PAD]).
  c.vocab_size = kTinyVocabSize;
  c.bos_token_id = kTinyBpeRanks;
  c.eos_token_ids = {kTinyBpeRanks + 2};
  c.pad_token_id = kTinyVocabSize - 1;
  c.q_lora_rank = 64;
  c.num_experts = 16;
  c.num_experts_per_token = 4;
  c.routed_expert_hidden_size = 64;
  c.attn_res_block_size = 3;  // bank fills within 9 layers, as K3's does within 93
  set_k3_layer_schedule(c, 9);
  return c;
}

// Kimi-Linear-48B-A3B-Instruct (spec 1.2): flat config, bf16 experts, no AttnRes / latent MoE,
// softplus decay gate, low-rank output gate, plain q_proj.
ModelConfig kimi_linear_48b() {
  ModelConfig c;
  c.architecture = "KimiLinearForCausalLM";
  c.model_type = "kimi_linear";
  c.nested_text_config = false;
  c.vocab_size = 163840;
  c.hidden_size = 2304;
  c.intermediate_size = 9216;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 32;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.mla_use_nope = true;
  c.linear_attn_config.num_heads = 32;
  c.linear_attn_config.head_dim = 128;
  c.linear_attn_config.short_conv_kernel_size = 4;
  c.num_experts = 256;
  c.num_experts_per_token = 8;
  c.num_shared_experts = 1;
  c.moe_intermediate_size = 1024;
  c.routed_scaling_factor = 2.446f;
  c.hidden_act = "silu";
  c.rms_norm_eps = 1e-5f;
  c.max_position_embeddings = 1048576;
  c.dtype = DType::BF16;
  c.bos_token_id = 163584;
  c.eos_token_ids = {163586};
  c.pad_token_id = 163839;
  c.linear_attn_config.full_attn_layers = {4, 8, 12, 16, 20, 24, 27};
  for (int l = 1; l <= 27; ++l)
    if (std::find(c.linear_attn_config.full_attn_layers.begin(),
                  c.linear_attn_config.full_attn_layers.end(),
                  l) == c.linear_attn_config.full_attn_layers.end())
      c.linear_attn_config.kda_layers.push_back(l);
  c.num_hidden_layers = 27;
  return c;
}

ModelConfig kimi_linear_tiny() {
  ModelConfig c = kimi_linear_48b();
  shrink_to_tiny(c);
  c.num_experts = 8;
  c.num_experts_per_token = 2;
  set_k3_layer_schedule(c, 6);
  return c;
}

// The body of a tiny speculative draft checkpoint for the tiny K3 presets (src/spec/draft_model.h):
// two dense MLA layers of the target's width and vocabulary, no KDA, no MoE. Its draft head
// (the fusion of token embedding and target hidden state) is written by the spec module.
ModelConfig k3_tiny_draft() {
  ModelConfig c = k3_tiny();
  c.num_hidden_layers = 2;
  c.linear_attn_config.kda_layers.clear();
  c.linear_attn_config.full_attn_layers = {1, 2};
  c.first_k_dense_replace = 2;
  return c;
}

struct Preset {
  const char* name;
  ModelConfig (*make)();
};

const Preset kPresets[] = {
    {"tiny", k3_tiny},
    {"tiny-k3.1",
     [] {
       ModelConfig c = k3_tiny();
       add_dsa(c, 4, 32, 8);  // top-k 8 < context so the sparse path really selects
       return c;
     }},
    {"tiny-kimi-linear", kimi_linear_tiny},
    {"tiny-draft", k3_tiny_draft},
    {"k3", k3_full},
    {"k3.1",
     [] {
       ModelConfig c = k3_full();
       add_dsa(c, 32, 128, 2048);
       return c;
     }},
    {"kimi-linear-48b", kimi_linear_48b},
};

}  // namespace

void set_k3_layer_schedule(ModelConfig& c, int n) {
  K3_CHECK(n >= 1, "num_hidden_layers must be >= 1, got ", n);
  c.num_hidden_layers = n;
  c.linear_attn_config.kda_layers.clear();
  c.linear_attn_config.full_attn_layers.clear();
  for (int l = 1; l <= n; ++l) {
    const bool mla = (l % 4 == 0) || (l == n && n > 1);
    (mla ? c.linear_attn_config.full_attn_layers : c.linear_attn_config.kda_layers).push_back(l);
  }
  c.first_k_dense_replace = std::min(c.first_k_dense_replace, n);
}

std::vector<std::string> synth_preset_names() {
  std::vector<std::string> out;
  for (const auto& p : kPresets) out.emplace_back(p.name);
  return out;
}

ModelConfig synth_preset(const std::string& name) {
  for (const auto& p : kPresets)
    if (name == p.name) return p.make();
  std::string known;
  for (const auto& p : kPresets) known += std::string(known.empty() ? "" : ", ") + p.name;
  fail("unknown synth preset \"", name, "\" (known: ", known, ")");
}

ModelConfig apply_overrides(ModelConfig c, const PresetOverrides& o) {
  if (o.num_hidden_layers) set_k3_layer_schedule(c, *o.num_hidden_layers);
  if (o.num_experts) {
    K3_CHECK(*o.num_experts >= 1, "--experts must be >= 1, got ", *o.num_experts);
    c.num_experts = *o.num_experts;
    c.num_experts_per_token = std::min(c.num_experts_per_token, c.num_experts);
  }
  return c;
}

}  // namespace k3
