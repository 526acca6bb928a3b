// ModelConfig: derived quantities and the consistency checks every config goes through (parsed
// or built in code). Parsing lives in config_parse.cpp, serialization in config_json.cpp.
#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"

namespace k3 {
namespace {

// The HF path of a text field: K3 nests the text model under text_config.
std::string field_path(const ModelConfig& c, std::string_view name) {
  return (c.nested_text_config ? "text_config." : "") + std::string(name);
}

template <typename... Parts>
[[noreturn]] void bad_field(const ModelConfig& c, std::string_view name, Parts&&... parts) {
  fail("config field \"", field_path(c, name), "\" ", std::forward<Parts>(parts)...);
}

void require_positive(const ModelConfig& c, std::string_view name, int64_t v) {
  if (v <= 0) bad_field(c, name, "must be positive, got ", v);
}

void require_non_negative(const ModelConfig& c, std::string_view name, int64_t v) {
  if (v < 0) bad_field(c, name, "must be >= 0, got ", v);
}

void check_layer(const ModelConfig& c, int layer) {
  K3_CHECK(layer >= 0 && layer < c.num_hidden_layers, "layer index ", layer, " out of range [0, ",
           c.num_hidden_layers, ")");
}

// kda_layers and full_attn_layers (1-based) must partition 1..num_hidden_layers exactly: the
// weight table and the decode state are both laid out from this schedule, so a hole or an overlap
// would silently mis-bind tensors.
void check_layer_schedule(const ModelConfig& c) {
  const auto& la = c.linear_attn_config;
  const int n = c.num_hidden_layers;
  const std::string kda = field_path(c, "linear_attn_config.kda_layers");
  const std::string full = field_path(c, "linear_attn_config.full_attn_layers");
  std::vector<int> owner(static_cast<size_t>(n) + 1, 0);  // 0: none, 1: KDA, 2: MLA
  auto mark = [&](const std::vector<int>& list, int tag, const std::string& path) {
    for (int l : list) {
      if (l < 1 || l > n)
        fail("config field \"", path, "\" has layer ", l, " outside 1..", n,
             " (num_hidden_layers = ", n, ")");
      if (owner[l] == tag) fail("config field \"", path, "\" lists layer ", l, " twice");
      if (owner[l] != 0) fail("layer ", l, " is in both \"", kda, "\" and \"", full, "\"");
      owner[l] = tag;
    }
  };
  mark(la.kda_layers, 1, kda);
  mark(la.full_attn_layers, 2, full);
  for (int l = 1; l <= n; ++l)
    if (owner[l] == 0) fail("layer ", l, " is in neither \"", kda, "\" nor \"", full, "\"");
}

void check_attention(const ModelConfig& c) {
  const auto& la = c.linear_attn_config;
  require_positive(c, "linear_attn_config.num_heads", la.num_heads);
  require_positive(c, "linear_attn_config.head_dim", la.head_dim);
  if (la.short_conv_kernel_size < 1)
    bad_field(c, "linear_attn_config.short_conv_kernel_size", "must be >= 1, got ",
              la.short_conv_kernel_size);
  // The K3 decay gate is g = lower_bound * sigmoid(.): a decay needs a negative bound.
  if (la.gate_lower_bound && !(std::isfinite(*la.gate_lower_bound) && *la.gate_lower_bound < 0))
    bad_field(c, "linear_attn_config.gate_lower_bound", "must be a negative number, got ",
              *la.gate_lower_bound);
  check_layer_schedule(c);

  require_positive(c, "num_attention_heads", c.num_attention_heads);
  require_positive(c, "num_key_value_heads", c.num_key_value_heads);
  if (c.q_lora_rank) require_positive(c, "q_lora_rank", *c.q_lora_rank);
  require_positive(c, "kv_lora_rank", c.kv_lora_rank);
  require_positive(c, "qk_nope_head_dim", c.qk_nope_head_dim);
  require_non_negative(c, "qk_rope_head_dim", c.qk_rope_head_dim);
  require_positive(c, "v_head_dim", c.v_head_dim);
  if (!c.mla_use_nope)
    bad_field(c, "mla_use_nope",
              "must be true: rotary MLA is not supported (Kimi K3 / Kimi-Linear MLA is NoPE; the "
              "qk_rope_head_dim part is never rotated)");
}

void check_ffn(const ModelConfig& c) {
  require_positive(c, "intermediate_size", c.intermediate_size);
  if (c.first_k_dense_replace < 0 || c.first_k_dense_replace > c.num_hidden_layers)
    bad_field(c, "first_k_dense_replace",
              "must be in [0, num_hidden_layers = ", c.num_hidden_layers, "], got ",
              c.first_k_dense_replace);
  if (c.moe_layer_freq < 1) bad_field(c, "moe_layer_freq", "must be >= 1, got ", c.moe_layer_freq);
  require_positive(c, "num_experts", c.num_experts);
  if (c.num_experts_per_token < 1 || c.num_experts_per_token > c.num_experts)
    bad_field(c, "num_experts_per_token", "must be in [1, num_experts = ", c.num_experts, "], got ",
              c.num_experts_per_token);
  require_non_negative(c, "num_shared_experts", c.num_shared_experts);
  require_positive(c, "moe_intermediate_size", c.moe_intermediate_size);
  if (c.routed_expert_hidden_size)
    require_positive(c, "routed_expert_hidden_size", *c.routed_expert_hidden_size);
  if (c.latent_moe_use_norm && !c.routed_expert_hidden_size)
    bad_field(c, "latent_moe_use_norm",
              "is true but routed_expert_hidden_size is unset (the norm acts on the latent)");
  if (c.moe_router_activation_func != "sigmoid" && c.moe_router_activation_func != "softmax")
    bad_field(c, "moe_router_activation_func", "must be \"sigmoid\" or \"softmax\", got \"",
              c.moe_router_activation_func, "\"");
  if (c.topk_method != "noaux_tc" && c.topk_method != "greedy")
    bad_field(c, "topk_method", "must be \"noaux_tc\" or \"greedy\", got \"", c.topk_method, "\"");
  if (!(std::isfinite(c.routed_scaling_factor) && c.routed_scaling_factor > 0))
    bad_field(c, "routed_scaling_factor", "must be positive, got ", c.routed_scaling_factor);
  require_positive(c, "num_expert_group", c.num_expert_group);
  if (c.topk_group < 1 || c.topk_group > c.num_expert_group)
    bad_field(c, "topk_group", "must be in [1, num_expert_group = ", c.num_expert_group, "], got ",
              c.topk_group);
  if (c.num_experts % c.num_expert_group != 0)
    bad_field(c, "num_expert_group", "must divide num_experts = ", c.num_experts, ", got ",
              c.num_expert_group);
  // Group-limited selection keeps topk_group groups; top-k must fit in them.
  if (c.use_grouped_topk &&
      c.num_experts_per_token > c.topk_group * (c.num_experts / c.num_expert_group))
    bad_field(c, "num_experts_per_token", "= ", c.num_experts_per_token, " exceeds the ",
              c.topk_group * (c.num_experts / c.num_expert_group), " experts in topk_group groups");

  if (c.hidden_act != "silu" && c.hidden_act != "situ")
    bad_field(c, "hidden_act", "must be \"silu\" or \"situ\", got \"", c.hidden_act, "\"");
  if (!(std::isfinite(c.activation_situ_beta) && c.activation_situ_beta > 0))
    bad_field(c, "activation_situ_beta", "must be positive, got ", c.activation_situ_beta);
  if (c.activation_situ_linear_beta &&
      !(std::isfinite(*c.activation_situ_linear_beta) && *c.activation_situ_linear_beta > 0))
    bad_field(c, "activation_situ_linear_beta", "must be positive, got ",
              *c.activation_situ_linear_beta);
}

void check_dsa(const ModelConfig& c) {
  const auto& d = c.dsa_config;
  if (!d.enabled) return;
  require_positive(c, "dsa_config.index_n_heads", d.index_n_heads);
  require_positive(c, "dsa_config.index_head_dim", d.index_head_dim);
  require_positive(c, "dsa_config.index_topk", d.index_topk);
  require_non_negative(c, "dsa_config.index_rope_dim", d.index_rope_dim);
  if (d.index_rope_dim > d.index_head_dim)
    bad_field(c, "dsa_config.index_rope_dim", "= ", d.index_rope_dim,
              " exceeds index_head_dim = ", d.index_head_dim);
  // Parsed as configuration; whether the engine runs "rms" is the deployment layer's call.
  if (d.index_k_norm_type != "layernorm" && d.index_k_norm_type != "rms")
    bad_field(c, "dsa_config.index_k_norm_type", "must be \"layernorm\" or \"rms\", got \"",
              d.index_k_norm_type, "\"");
  if (!c.q_lora_rank)
    bad_field(c, "dsa_config", "needs q_lora_rank: the indexer reads the MLA q latent");
}

void check_quantization(const ModelConfig& c) {
  const auto& q = c.quantization_config;
  if (!q.present) return;
  if (q.quant_method != "compressed-tensors")
    bad_field(c, "quantization_config.quant_method", "must be \"compressed-tensors\", got \"",
              q.quant_method, "\"");
  if (q.format != "mxfp4-pack-quantized")
    bad_field(c, "quantization_config.format", "must be \"mxfp4-pack-quantized\", got \"", q.format,
              "\"");
  if (q.num_bits != 4)
    bad_field(c, "quantization_config.config_groups.weights.num_bits", "must be 4 (MXFP4), got ",
              q.num_bits);
  if (q.group_size != 32)
    bad_field(c, "quantization_config.config_groups.weights.group_size",
              "must be 32 (MXFP4 blocks), got ", q.group_size);
}

void check_tokens(const ModelConfig& c) {
  // -1 means "not given"; a given id must be a row of the embedding.
  auto check = [&](const char* name, int64_t id) {
    if (id < -1 || id >= c.vocab_size)
      fail("config field \"", name, "\" = ", id, " is outside the vocabulary [0, ", c.vocab_size,
           ")");
  };
  check("bos_token_id", c.bos_token_id);
  check("pad_token_id", c.pad_token_id);
  for (int64_t id : c.eos_token_ids) {
    if (id < 0) fail("config field \"eos_token_id\" has a negative id ", id);
    check("eos_token_id", id);
  }
}

}  // namespace

void validate_model_config(const ModelConfig& c) {
  const bool k3 = c.architecture == "KimiK3ForConditionalGeneration";
  const bool linear = c.architecture == "KimiLinearForCausalLM";
  if (!k3 && !linear)
    fail(
        "config field \"architectures\" must be [\"KimiK3ForConditionalGeneration\"] or "
        "[\"KimiLinearForCausalLM\"], got \"",
        c.architecture, "\"");
  if (k3 && (c.model_type != "kimi_k3" || !c.nested_text_config))
    fail(
        "config field \"model_type\": KimiK3ForConditionalGeneration needs model_type "
        "\"kimi_k3\" with a nested text_config, got \"",
        c.model_type, "\"");
  if (linear && (c.model_type != "kimi_linear" || c.nested_text_config))
    fail(
        "config field \"model_type\": KimiLinearForCausalLM needs the flat model_type "
        "\"kimi_linear\" layout, got \"",
        c.model_type, "\"");

  require_positive(c, "vocab_size", c.vocab_size);
  require_positive(c, "hidden_size", c.hidden_size);
  require_positive(c, "num_hidden_layers", c.num_hidden_layers);
  require_positive(c, "max_position_embeddings", c.max_position_embeddings);
  if (!(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0))
    bad_field(c, "rms_norm_eps", "must be positive, got ", c.rms_norm_eps);
  if (c.attn_res_block_size < 0)
    bad_field(c, "attn_res_block_size", "must be >= 0 (0: no AttnRes), got ",
              c.attn_res_block_size);
  if (c.num_nextn_predict_layers != 0)
    bad_field(c, "num_nextn_predict_layers",
              "must be 0: multi-token prediction (MTP) layers are not supported, got ",
              c.num_nextn_predict_layers);
  check_attention(c);
  check_ffn(c);
  check_dsa(c);
  check_quantization(c);
  check_tokens(c);
}

LayerKind ModelConfig::layer_kind(int layer) const {
  check_layer(*this, layer);
  const auto& full = linear_attn_config.full_attn_layers;
  return std::find(full.begin(), full.end(), layer + 1) != full.end() ? LayerKind::MLA
                                                                      : LayerKind::KDA;
}

// DeepSeek / Kimi semantics (HF modeling): MoE iff layer_idx >= first_k_dense_replace and
// layer_idx % moe_layer_freq == 0 (not an offset from first_k_dense_replace).
bool ModelConfig::is_moe_layer(int layer) const {
  check_layer(*this, layer);
  return layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
}

bool ModelConfig::is_attn_res_write_layer(int layer) const {
  check_layer(*this, layer);
  return has_attn_res() && layer % attn_res_block_size == 0;
}

int ModelConfig::num_kda_layers() const {
  return static_cast<int>(linear_attn_config.kda_layers.size());
}

int ModelConfig::num_mla_layers() const {
  return static_cast<int>(linear_attn_config.full_attn_layers.size());
}

int64_t ModelConfig::expert_io_dim() const {
  return routed_expert_hidden_size ? int64_t(*routed_expert_hidden_size) : hidden_size;
}

std::string ModelConfig::tensor_prefix() const {
  return nested_text_config ? "language_model.model." : "model.";
}

std::string ModelConfig::lm_head_name() const {
  return nested_text_config ? "language_model.lm_head.weight" : "lm_head.weight";
}

}  // namespace k3
