// The quantization_config / dsa_config sub-objects (both directions) and ModelConfig -> JSON in
// the HF layout: nested text_config for K3 / K3.1, flat for Kimi-Linear. parse(to_json(c)) == c.
#include <charconv>
#include <cstdlib>
#include <string>

#include "model/config.h"
#include "model/config_fields.h"

namespace k3 {
namespace config_detail {
namespace {

// Fields that describe a compressed-tensors feature the engine does not implement: they must be
// null (or absent) rather than silently ignored.
void require_null(Fields& f, std::string_view key, const char* why) {
  if (const json* v = f.take(key); v && !v->is_null() && !(v->is_object() && v->empty()))
    field_error(f.path(key), "must be null: ", why);
}

void parse_group(const json& g, const std::string& prefix, QuantizationConfig& q,
                 std::optional<std::string>& format) {
  Fields gf(g, prefix);
  if (auto f = get<std::string>(gf, "format")) {
    if (*f != "mxfp4-pack-quantized")
      field_error(gf.path("format"), "must be \"mxfp4-pack-quantized\", got \"", *f, "\"");
    format = format.value_or(*f);
  }
  get<std::vector<std::string>>(gf, "targets");  // the weight table decides what is MXFP4
  const json* wj = gf.take("weights");
  if (!wj) field_error(gf.path("weights"), "is required");
  Fields w(*wj, gf.path("weights."));
  q.num_bits = require<int>(w, "num_bits");
  if (q.num_bits != 4) field_error(w.path("num_bits"), "must be 4 (MXFP4), got ", q.num_bits);
  q.group_size = require<int>(w, "group_size");
  if (q.group_size != 32)
    field_error(w.path("group_size"), "must be 32 (MXFP4 blocks), got ", q.group_size);
  if (auto t = get<std::string>(w, "type"); t && *t != "float")
    field_error(w.path("type"), "must be \"float\" (E2M1), got \"", *t, "\"");
  if (auto s = get<bool>(w, "symmetric"); s && !*s)
    field_error(w.path("symmetric"), "must be true (MXFP4 has no zero point)");
  if (auto s = get<std::string>(w, "strategy"); s && *s != "group")
    field_error(w.path("strategy"), "must be \"group\", got \"", *s, "\"");
  if (auto s = get_nullable<std::string>(w, "scale_dtype"); s && *s != "torch.uint8")
    field_error(w.path("scale_dtype"), "must be \"torch.uint8\" (E8M0 scales), got \"", *s, "\"");
  if (auto d = get<bool>(w, "dynamic"); d && *d)
    field_error(w.path("dynamic"), "must be false (the weights are stored quantized)");
  w.take("observer");  // calibration-time settings
  w.take("observer_kwargs");
  require_null(w, "actorder", "activation-order reordering is not supported");
  require_null(w, "block_structure", "block quantization is not supported");
  require_null(w, "zp_dtype", "MXFP4 has no zero point");
  w.finish();
  require_null(gf, "input_activations", "the checkpoint's experts are weight-only (W4A16)");
  require_null(gf, "output_activations", "output quantization is not supported");
  gf.finish();
}

}  // namespace

QuantizationConfig parse_quantization_config(const json& j, const std::string& path) {
  Fields f(j, path + ".");
  QuantizationConfig q;
  q.present = true;
  q.quant_method = require<std::string>(f, "quant_method");
  if (q.quant_method != "compressed-tensors")
    field_error(f.path("quant_method"), "must be \"compressed-tensors\", got \"", q.quant_method,
                "\"");
  std::optional<std::string> format = get<std::string>(f, "format");
  if (format && *format != "mxfp4-pack-quantized")
    field_error(f.path("format"), "must be \"mxfp4-pack-quantized\", got \"", *format, "\"");
  if (const json* groups = f.take("config_groups"); groups && !groups->is_null()) {
    Fields gs(*groups, f.path("config_groups."));
    for (const auto& [name, g] : groups->items()) {
      gs.take(name);
      parse_group(g, gs.path(name) + ".", q, format);
    }
  }
  q.format = need(format, f.path("format"));
  set_if(q.ignore, get<std::vector<std::string>>(f, "ignore"));
  require_null(f, "kv_cache_scheme", "choose the KV cache format with the deploy kv_cache_dtype");
  require_null(f, "sparsity_config", "sparse compression is not supported");
  require_null(f, "transform_config", "weight transforms are not supported");
  for (const char* k : {"quantization_status", "global_compression_ratio", "version"}) f.take(k);
  f.finish();
  return q;
}

DsaConfig parse_dsa_config(const json& j, const std::string& path) {
  Fields f(j, path + ".");
  DsaConfig d;
  d.enabled = true;
  d.index_n_heads = require<int>(f, "index_n_heads");
  d.index_head_dim = require<int>(f, "index_head_dim");
  d.index_topk = require<int>(f, "index_topk");
  set_if(d.index_rope_dim, get<int>(f, "index_rope_dim"));
  set_if(d.index_k_norm_type, get<std::string>(f, "index_k_norm_type"));
  f.finish();
  return d;
}

}  // namespace config_detail

namespace {

using json = nlohmann::json;

// The shortest decimal that reads back as the same float ("1e-05", not 9.99999974737875e-06).
json num(float x) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::strtod(std::string(buf, r.ptr).c_str(), nullptr);
}
template <typename T>
json opt(const std::optional<T>& v) {
  if (!v) return nullptr;
  if constexpr (std::is_same_v<T, float>) return num(*v);
  return *v;
}

std::string dtype_json_name(DType t) {
  switch (t) {
    case DType::BF16:
      return "bfloat16";
    case DType::F16:
      return "float16";
    case DType::F32:
      return "float32";
    default:
      fail("model dtype ", dtype_name(t), " has no config.json spelling");
  }
}

json quantization_json(const QuantizationConfig& q) {
  json weights = {{"num_bits", q.num_bits}, {"type", "float"},
                  {"symmetric", true},      {"group_size", q.group_size},
                  {"strategy", "group"},    {"scale_dtype", "torch.uint8"},
                  {"dynamic", false}};
  json group = {{"format", q.format},
                {"targets", json::array({"Linear"})},
                {"weights", weights},
                {"input_activations", nullptr}};
  return {{"quant_method", q.quant_method},
          {"format", q.format},
          {"config_groups", {{"group_0", group}}},
          {"ignore", q.ignore}};
}

json text_json(const ModelConfig& c) {
  const auto& la = c.linear_attn_config;
  json t = {
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"first_k_dense_replace", c.first_k_dense_replace},
      {"moe_layer_freq", c.moe_layer_freq},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"q_lora_rank", opt(c.q_lora_rank)},
      {"kv_lora_rank", c.kv_lora_rank},
      {"qk_nope_head_dim", c.qk_nope_head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim},
      {"v_head_dim", c.v_head_dim},
      {"mla_use_nope", c.mla_use_nope},
      {"mla_use_output_gate", c.mla_use_output_gate},
      {"linear_attn_config",
       {{"num_heads", la.num_heads},
        {"head_dim", la.head_dim},
        {"short_conv_kernel_size", la.short_conv_kernel_size},
        {"gate_lower_bound", opt(la.gate_lower_bound)},
        {"use_full_rank_gate", la.use_full_rank_gate},
        {"kda_layers", la.kda_layers},
        {"full_attn_layers", la.full_attn_layers}}},
      {"num_experts", c.num_experts},
      {"num_experts_per_token", c.num_experts_per_token},
      {"num_shared_experts", c.num_shared_experts},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"routed_expert_hidden_size", opt(c.routed_expert_hidden_size)},
      {"latent_moe_use_norm", c.latent_moe_use_norm},
      {"moe_router_activation_func", c.moe_router_activation_func},
      {"moe_renormalize", c.moe_renormalize},
      {"routed_scaling_factor", num(c.routed_scaling_factor)},
      {"use_grouped_topk", c.use_grouped_topk},
      {"num_expert_group", c.num_expert_group},
      {"topk_group", c.topk_group},
      {"topk_method", c.topk_method},
      {"hidden_act", c.hidden_act},
      {"activation_situ_beta", num(c.activation_situ_beta)},
      {"activation_situ_linear_beta", opt(c.activation_situ_linear_beta)},
      {"attn_res_block_size", c.attn_res_block_size},
      {"rms_norm_eps", num(c.rms_norm_eps)},
      {"max_position_embeddings", c.max_position_embeddings},
      {"num_nextn_predict_layers", c.num_nextn_predict_layers},
  };
  if (c.has_dsa()) {
    const auto& d = c.dsa_config;
    t["dsa_config"] = {{"index_n_heads", d.index_n_heads},
                       {"index_head_dim", d.index_head_dim},
                       {"index_topk", d.index_topk},
                       {"index_rope_dim", d.index_rope_dim},
                       {"index_k_norm_type", d.index_k_norm_type}};
  }
  // The K3 release keeps quantization_config inside text_config; flat configs at the top.
  if (c.quantization_config.present)
    t["quantization_config"] = quantization_json(c.quantization_config);
  return t;
}

}  // namespace

json model_config_to_json(const ModelConfig& c) {
  json text = text_json(c);
  json top;
  if (c.nested_text_config) {
    text["model_type"] = "kimi_linear";
    top["text_config"] = std::move(text);
  } else {
    top = std::move(text);
  }
  top["architectures"] = json::array({c.architecture});
  top["model_type"] = c.model_type;
  if (c.bos_token_id >= 0) top["bos_token_id"] = c.bos_token_id;
  if (c.pad_token_id >= 0) top["pad_token_id"] = c.pad_token_id;
  if (c.eos_token_ids.size() == 1)
    top["eos_token_id"] = c.eos_token_ids[0];
  else if (!c.eos_token_ids.empty())
    top["eos_token_id"] = c.eos_token_ids;
  top["tie_word_embeddings"] = c.tie_word_embeddings;
  top["dtype"] = dtype_json_name(c.dtype);
  return top;
}

}  // namespace k3
