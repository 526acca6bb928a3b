// The model described once: Kimi K3 / K3.1 / Kimi-Linear text configuration, read from a
// Hugging Face config.json. Field names are the HF ones; derived quantities are methods.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/dtype.h"

namespace k3 {

enum class LayerKind : uint8_t { KDA, MLA };

// `linear_attn_config` (KDA layers). Layer lists are 1-based as in the file.
struct LinearAttnConfig {
  int num_heads = 0;
  int head_dim = 0;
  int short_conv_kernel_size = 4;
  std::optional<float> gate_lower_bound;  // set: K3 sigmoid gate form; unset: softplus form
  bool use_full_rank_gate = false;        // output gate: g_proj (true) or g_a/g_b (false)
  std::vector<int> kda_layers;
  std::vector<int> full_attn_layers;
  bool operator==(const LinearAttnConfig&) const = default;
};

// K3.1 DSA lightning indexer on the MLA layers (`text_config.dsa_config`).
struct DsaConfig {
  bool enabled = false;
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  int index_rope_dim = 0;                       // > 0: indexer RoPE (the engine refuses it)
  std::string index_k_norm_type = "layernorm";  // "layernorm" | "rms"
  bool operator==(const DsaConfig&) const = default;
};

// `quantization_config` (compressed-tensors MXFP4 on the routed experts).
struct QuantizationConfig {
  bool present = false;
  std::string quant_method;  // "compressed-tensors"
  std::string format;        // "mxfp4-pack-quantized"
  int num_bits = 4;
  int group_size = 32;
  std::vector<std::string> ignore;
  bool operator==(const QuantizationConfig&) const = default;
};

struct ModelConfig {
  // Top level.
  std::string
      architecture;  // architectures[0]: KimiK3ForConditionalGeneration | KimiLinearForCausalLM
  std::string model_type;           // top-level model_type: kimi_k3 | kimi_linear
  bool nested_text_config = false;  // K3 layout: text_config nested, tensors under language_model.

  // text_config (or the flat Kimi-Linear config).
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense FFN (layers < first_k_dense_replace)
  int num_hidden_layers = 0;
  int first_k_dense_replace = 1;
  int moe_layer_freq = 1;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  std::optional<int> q_lora_rank;  // unset: plain q_proj (Kimi-Linear)
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  bool mla_use_nope = true;
  bool mla_use_output_gate = false;
  LinearAttnConfig linear_attn_config;
  int num_experts = 0;
  int num_experts_per_token = 0;
  int num_shared_experts = 0;
  int moe_intermediate_size = 0;
  std::optional<int> routed_expert_hidden_size;  // set: latent MoE (K3)
  bool latent_moe_use_norm = false;
  std::string moe_router_activation_func = "sigmoid";
  bool moe_renormalize = true;
  float routed_scaling_factor = 1.0f;
  bool use_grouped_topk = true;
  int num_expert_group = 1;
  int topk_group = 1;
  std::string topk_method = "noaux_tc";
  std::string hidden_act = "silu";  // "silu" | "situ"
  float activation_situ_beta = 4.0f;
  std::optional<float> activation_situ_linear_beta;
  int attn_res_block_size = 0;  // 0: plain additive residual (Kimi-Linear)
  float rms_norm_eps = 1e-5f;
  int64_t max_position_embeddings = 0;
  int num_nextn_predict_layers = 0;
  bool tie_word_embeddings = false;
  DType dtype = DType::BF16;  // `dtype` / `torch_dtype`
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;  // `eos_token_id`, int or list
  int64_t pad_token_id = -1;
  DsaConfig dsa_config;
  QuantizationConfig quantization_config;

  // ---- derived ----
  LayerKind layer_kind(int layer) const;          // 0-based layer
  bool is_moe_layer(int layer) const;             // false: dense FFN
  bool is_attn_res_write_layer(int layer) const;  // AttnRes on and layer % block == 0
  bool has_attn_res() const { return attn_res_block_size > 0; }
  bool has_dsa() const { return dsa_config.enabled; }
  bool experts_mxfp4() const { return quantization_config.present; }
  int num_kda_layers() const;
  int num_mla_layers() const;
  int kda_proj_dim() const { return linear_attn_config.num_heads * linear_attn_config.head_dim; }
  int q_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Width the routed experts run in: routed_expert_hidden_size (latent MoE) or hidden_size.
  int64_t expert_io_dim() const;
  int64_t shared_expert_dim() const { return int64_t(moe_intermediate_size) * num_shared_experts; }
  // Prefix of every text tensor: "language_model.model." (K3) or "model." (Kimi-Linear).
  std::string tensor_prefix() const;
  std::string lm_head_name() const;
  // Epsilons the reference uses where config.json has no field (see DESIGN.md numerics).
  static constexpr float kQkL2NormEps = 1e-6f;       // FLA l2norm on KDA q/k
  static constexpr float kMlaLatentNormEps = 1e-6f;  // q_a_layernorm / kv_a_layernorm

  // Field-for-field equality (the to_json -> parse round trip is tested with it).
  bool operator==(const ModelConfig&) const = default;
};

// Parses a config.json document; every unknown or inconsistent field raises k3::Error naming
// the field (e.g. "text_config.linear_attn_config.kda_layers").
ModelConfig parse_model_config(const nlohmann::json& doc);
// `path` is a checkpoint directory (reads path/config.json) or the file itself. Errors name the
// path (missing file, invalid JSON, or any parse error above).
ModelConfig load_model_config(const std::string& path);
// The consistency checks parse_model_config runs, for configs built in code (synth presets,
// overrides). Messages name the field with its HF path ("text_config." prefix when nested).
void validate_model_config(const ModelConfig& cfg);
// Writes the HF layout back (nested text_config for K3, flat for Kimi-Linear).
nlohmann::json model_config_to_json(const ModelConfig& cfg);

}  // namespace k3
