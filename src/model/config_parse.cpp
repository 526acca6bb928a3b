// config.json -> ModelConfig.
//
// Field policy (why the parser is strict): a text engine that silently ignores a field it does
// not understand can load a checkpoint it will compute wrongly. So every key is one of
//  1. read: a field of ModelConfig (HF name, or an alias transformers maps onto it: both
//     spellings present with different values is an error);
//  2. checked: a field with no ModelConfig slot whose value must agree with what the engine does
//     (rope_scaling must be null, attention_bias false, layer_types / mlp_layer_types / qk_head_dim
//     must match the derived schedule and dims, rope_theta only with NoPE MLA);
//  3. ignored on purpose: HF PretrainedConfig bookkeeping, training-only knobs and generation
//     defaults (kGenericIgnored), plus the multimodal top level of K3 (vision_config as a whole
//     subtree, media_placeholder_token_id, ...) and head_dim (HF sets it to qk_rope_head_dim);
//  4. anything else: an error naming the full path, e.g. `unknown config field "text_config.x"`.
// Absent fields: those that set a tensor shape or the layer schedule are required; behavioural
// fields default to transformers' KimiLinearConfig defaults (mla_use_nope: true only when
// qk_rope_head_dim is 0, as there).
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "model/config_fields.h"

namespace k3 {
namespace {

using namespace config_detail;

// HF PretrainedConfig bookkeeping, training-only knobs and generation defaults.
constexpr std::string_view kGenericIgnored[] = {"transformers_version",
                                                "auto_map",
                                                "_name_or_path",
                                                "_commit_hash",
                                                "_attn_implementation",
                                                "_attn_implementation_autoset",
                                                "use_cache",
                                                "initializer_range",
                                                "output_attentions",
                                                "output_hidden_states",
                                                "return_dict",
                                                "torchscript",
                                                "use_bfloat16",
                                                "tf_legacy_loss",
                                                "pruned_heads",
                                                "chunk_size_feed_forward",
                                                "is_encoder_decoder",
                                                "is_decoder",
                                                "cross_attention_hidden_size",
                                                "add_cross_attention",
                                                "tie_encoder_decoder",
                                                "finetuning_task",
                                                "id2label",
                                                "label2id",
                                                "num_labels",
                                                "tokenizer_class",
                                                "prefix",
                                                "sep_token_id",
                                                "decoder_start_token_id",
                                                "task_specific_params",
                                                "problem_type",
                                                "pretraining_tp",
                                                "attention_dropout",
                                                "output_router_logits",
                                                "router_aux_loss_coef",
                                                "aux_loss_alpha",
                                                "seq_aux",
                                                "max_length",
                                                "min_length",
                                                "do_sample",
                                                "early_stopping",
                                                "num_beams",
                                                "num_beam_groups",
                                                "diversity_penalty",
                                                "temperature",
                                                "top_k",
                                                "top_p",
                                                "typical_p",
                                                "repetition_penalty",
                                                "length_penalty",
                                                "no_repeat_ngram_size",
                                                "encoder_no_repeat_ngram_size",
                                                "bad_words_ids",
                                                "num_return_sequences",
                                                "output_scores",
                                                "return_dict_in_generate",
                                                "forced_bos_token_id",
                                                "forced_eos_token_id",
                                                "remove_invalid_values",
                                                "exponential_decay_length_penalty",
                                                "suppress_tokens",
                                                "begin_suppress_tokens",
                                                "gradient_checkpointing",
                                                "min_p"};
// K3's multimodal top level: nothing in it shapes the text model.
constexpr std::string_view kTopIgnored[] = {"vision_config", "media_placeholder_token_id",
                                            "ignore_index", "image_placeholder"};

// Fields that can only be checked against the finished config (schedule-derived lists, dims).
struct Deferred {
  std::string prefix;
  const json* layer_types = nullptr;
  const json* mlp_layer_types = nullptr;
  std::optional<int> qk_head_dim;
  bool rope_theta = false;
};

void read_linear_attn(Fields& t, ModelConfig& c) {
  const json* j = t.take("linear_attn_config");
  if (!j) field_error(t.path("linear_attn_config"), "is required");
  Fields f(*j, t.path("linear_attn_config."));
  auto& la = c.linear_attn_config;
  // transformers saves these flattened (linear_num_heads, ...) next to the nested dict.
  la.num_heads = need(agree(get<int>(f, "num_heads"), f.path("num_heads"),
                            get<int>(t, "linear_num_heads"), t.path("linear_num_heads")),
                      f.path("num_heads"));
  la.head_dim = need(agree(get<int>(f, "head_dim"), f.path("head_dim"),
                           get<int>(t, "linear_head_dim"), t.path("linear_head_dim")),
                     f.path("head_dim"));
  set_if(la.short_conv_kernel_size,
         agree(get<int>(f, "short_conv_kernel_size"), f.path("short_conv_kernel_size"),
               get<int>(t, "linear_conv_kernel_dim"), t.path("linear_conv_kernel_dim")));
  la.gate_lower_bound = get_nullable<float>(f, "gate_lower_bound");
  set_if(la.use_full_rank_gate, get<bool>(f, "use_full_rank_gate"));
  la.kda_layers = require<std::vector<int>>(f, "kda_layers");
  la.full_attn_layers = require<std::vector<int>>(f, "full_attn_layers");
  f.finish();
}

void read_moe(Fields& t, ModelConfig& c) {
  c.num_experts =
      need(get_aliased<int>(t, "num_experts", "num_local_experts"), t.path("num_experts"));
  c.num_experts_per_token =
      need(get_aliased<int>(t, "num_experts_per_token", "num_experts_per_tok"),
           t.path("num_experts_per_token"));
  c.num_shared_experts = need(get_aliased<int>(t, "num_shared_experts", "n_shared_experts"),
                              t.path("num_shared_experts"));
  c.moe_intermediate_size = require<int>(t, "moe_intermediate_size");
  c.routed_expert_hidden_size = get_nullable<int>(t, "routed_expert_hidden_size");
  set_if(c.latent_moe_use_norm, get<bool>(t, "latent_moe_use_norm"));
  set_if(c.moe_router_activation_func, get<std::string>(t, "moe_router_activation_func"));
  set_if(c.moe_renormalize, get_aliased<bool>(t, "moe_renormalize", "norm_topk_prob"));
  c.routed_scaling_factor = require<float>(t, "routed_scaling_factor");
  set_if(c.use_grouped_topk, get<bool>(t, "use_grouped_topk"));
  set_if(c.num_expert_group, get_aliased<int>(t, "num_expert_group", "n_group"));
  set_if(c.topk_group, get_nullable<int>(t, "topk_group"));
  set_if(c.topk_method, get<std::string>(t, "topk_method"));
}

void read_activation(Fields& t, ModelConfig& c) {
  set_if(c.hidden_act, get<std::string>(t, "hidden_act"));
  // Sources disagree on the SiTU defaults (HF 1.0 / 1.0, K3 4.0 / 25.0): a situ model must say.
  const bool situ = c.hidden_act == "situ";
  const json* lb = t.take("activation_situ_linear_beta");
  if (situ && !lb)
    field_error(t.path("activation_situ_linear_beta"),
                "is required when hidden_act is \"situ\" (null: no tanh on the up projection)");
  if (lb && !lb->is_null())
    c.activation_situ_linear_beta = convert<float>(*lb, t.path("activation_situ_linear_beta"));
  if (situ)
    c.activation_situ_beta = require<float>(t, "activation_situ_beta");
  else
    set_if(c.activation_situ_beta, get<float>(t, "activation_situ_beta"));
}

// Fields with no ModelConfig slot whose value must agree with what the engine computes.
void read_checked(Fields& t, Deferred& d) {
  if (auto v = get<bool>(t, "attention_bias"); v && *v)
    field_error(t.path("attention_bias"),
                "must be false: MLA projections with a bias are not supported");
  if (const json* rs = t.take("rope_scaling"); rs && !rs->is_null())
    field_error(t.path("rope_scaling"),
                "must be null: the MLA is NoPE (mla_use_nope), RoPE scaling cannot apply");
  if (const json* rp = t.take("rope_parameters"); rp && !rp->is_null()) {
    if (!rp->is_object()) type_error(t.path("rope_parameters"), "an object or null", *rp);
    if (rp->contains("rope_type") && rp->at("rope_type") != "default")
      field_error(t.path("rope_parameters.rope_type"),
                  "must be \"default\": the MLA is NoPE (mla_use_nope), RoPE scaling cannot apply");
  }
  d.rope_theta = get<float>(t, "rope_theta").has_value();
  d.layer_types = t.take("layer_types");
  d.mlp_layer_types = t.take("mlp_layer_types");
  d.qk_head_dim = get<int>(t, "qk_head_dim");
  get<int>(t, "head_dim");  // HF sets it to qk_rope_head_dim; meaningless for MLA
  get<std::vector<std::string>>(t, "architectures");  // text_config.architectures: informational
  if (auto mt = get<std::string>(t, "model_type"); mt && *mt != "kimi_linear")
    field_error(t.path("model_type"), "must be \"kimi_linear\", got \"", *mt, "\"");
}

void read_text(Fields& t, ModelConfig& c, Deferred& d) {
  c.vocab_size = require<int64_t>(t, "vocab_size");
  c.hidden_size = require<int64_t>(t, "hidden_size");
  // HF: the dense FFN width is dense_ffn_hidden, falling back to intermediate_size.
  c.intermediate_size = need(get_aliased<int64_t>(t, "intermediate_size", "dense_ffn_hidden"),
                             t.path("intermediate_size"));
  c.num_hidden_layers = require<int>(t, "num_hidden_layers");
  set_if(c.first_k_dense_replace, get<int>(t, "first_k_dense_replace"));
  set_if(c.moe_layer_freq, get<int>(t, "moe_layer_freq"));
  c.num_attention_heads = require<int>(t, "num_attention_heads");
  c.num_key_value_heads =
      get_nullable<int>(t, "num_key_value_heads").value_or(c.num_attention_heads);
  c.q_lora_rank = get_nullable<int>(t, "q_lora_rank");
  c.kv_lora_rank = require<int>(t, "kv_lora_rank");
  c.qk_nope_head_dim = require<int>(t, "qk_nope_head_dim");
  c.qk_rope_head_dim = require<int>(t, "qk_rope_head_dim");
  c.v_head_dim = require<int>(t, "v_head_dim");
  c.mla_use_nope = get<bool>(t, "mla_use_nope").value_or(c.qk_rope_head_dim == 0);
  c.mla_use_output_gate = get<bool>(t, "mla_use_output_gate").value_or(false);
  read_linear_attn(t, c);
  read_moe(t, c);
  read_activation(t, c);
  set_if(c.attn_res_block_size, get<int>(t, "attn_res_block_size"));
  set_if(c.rms_norm_eps, get<float>(t, "rms_norm_eps"));
  c.max_position_embeddings =
      need(get_aliased<int64_t>(t, "max_position_embeddings", "model_max_length"),
           t.path("max_position_embeddings"));
  set_if(c.num_nextn_predict_layers, get<int>(t, "num_nextn_predict_layers"));
  if (const json* j = t.take("dsa_config"); j && !j->is_null())
    c.dsa_config = parse_dsa_config(*j, t.path("dsa_config"));
  read_checked(t, d);
}

// Fields K3 carries at the top level and (sometimes) in text_config. Token ids: the top level
// wins (generation metadata only). dtype / tie_word_embeddings change the model: they must agree.
void read_shared(Fields& top, Fields* nested, ModelConfig& c) {
  Fields& text = nested ? *nested : top;
  // Both spellings are always read, so text_config's copy is type-checked and not "unknown".
  auto token = [&]<typename T>(const char* key, T& dst) {
    const std::optional<T> t = get<T>(text, key);
    const std::optional<T> o = nested ? get<T>(top, key) : std::nullopt;
    set_if(dst, o ? o : t);
  };
  token("bos_token_id", c.bos_token_id);
  token("pad_token_id", c.pad_token_id);
  token("eos_token_id", c.eos_token_ids);
  const auto tie_t = get<bool>(text, "tie_word_embeddings");
  const auto dtype_t = get_aliased<DType>(text, "dtype", "torch_dtype");
  if (!nested) {
    set_if(c.tie_word_embeddings, tie_t);
    set_if(c.dtype, dtype_t);
    return;
  }
  set_if(c.tie_word_embeddings, agree(get<bool>(top, "tie_word_embeddings"), "tie_word_embeddings",
                                      tie_t, text.path("tie_word_embeddings")));
  set_if(c.dtype, agree(get_aliased<DType>(top, "dtype", "torch_dtype"), "dtype", dtype_t,
                        text.path("dtype")));
}

// HF's layer_types / mlp_layer_types are redundant with the schedule; they must not contradict.
void check_deferred(const ModelConfig& c, const Deferred& d) {
  auto check_list = [&](const json* j, const char* key, auto expected) {
    if (!j || j->is_null()) return;
    const std::string path = d.prefix + key;
    const auto v = convert<std::vector<std::string>>(*j, path);
    if (static_cast<int>(v.size()) != c.num_hidden_layers)
      field_error(path, "has ", v.size(), " entries, num_hidden_layers is ", c.num_hidden_layers);
    for (int l = 0; l < c.num_hidden_layers; ++l)
      if (v[l] != expected(l))
        field_error(path, "says \"", v[l], "\" at layer ", l, ", the derived schedule says \"",
                    expected(l), "\"");
  };
  check_list(d.layer_types, "layer_types", [&](int l) -> std::string {
    return c.layer_kind(l) == LayerKind::MLA ? "full_attention" : "linear_attention";
  });
  check_list(d.mlp_layer_types, "mlp_layer_types",
             [&](int l) -> std::string { return c.is_moe_layer(l) ? "sparse" : "dense"; });
  if (d.qk_head_dim && *d.qk_head_dim != c.q_head_dim())
    field_error(d.prefix + "qk_head_dim", "= ", *d.qk_head_dim,
                " disagrees with qk_nope_head_dim + qk_rope_head_dim = ", c.q_head_dim());
}

}  // namespace

ModelConfig parse_model_config(const json& doc) {
  Fields top(doc, "");
  ModelConfig c;
  c.model_type = require<std::string>(top, "model_type");
  if (c.model_type != "kimi_k3" && c.model_type != "kimi_linear")
    field_error("model_type",
                "must be \"kimi_k3\" (nested text_config) or \"kimi_linear\" (flat), got \"",
                c.model_type, "\"");
  c.nested_text_config = c.model_type == "kimi_k3";
  if (auto arch = get<std::vector<std::string>>(top, "architectures")) {
    if (arch->size() != 1)
      field_error("architectures", "must have exactly one entry, got ", arch->size());
    c.architecture = (*arch)[0];
  } else {  // not written by every tool; the layout says which model it is
    c.architecture =
        c.nested_text_config ? "KimiK3ForConditionalGeneration" : "KimiLinearForCausalLM";
  }
  const json* tc = top.take("text_config");
  if (c.nested_text_config && !tc)
    field_error("text_config", "is required for model_type \"kimi_k3\"");
  if (!c.nested_text_config && tc)
    field_error("text_config", "is not allowed in the flat \"kimi_linear\" layout");
  std::optional<Fields> nested;
  if (tc) nested.emplace(*tc, "text_config.");
  Fields& text = nested ? *nested : top;

  Deferred d;
  d.prefix = text.prefix();
  read_text(text, c, d);
  read_shared(top, nested ? &*nested : nullptr, c);
  // quantization_config: HF puts it at the top level; the K3 release has it in text_config.
  const json* qt = text.take("quantization_config");
  const json* qo = nested ? top.take("quantization_config") : nullptr;
  if (qt && qo)
    field_error("quantization_config", "appears both at the top level and in text_config");
  if (const json* q = qt ? qt : qo; q && !q->is_null())
    c.quantization_config =
        parse_quantization_config(*q, (qt ? text.prefix() : std::string()) + "quantization_config");

  top.ignore(kGenericIgnored);
  if (nested) {
    top.ignore(kTopIgnored);
    nested->ignore(kGenericIgnored);
    nested->finish();
  }
  top.finish();
  if (d.rope_theta && !c.mla_use_nope)
    field_error(d.prefix + "rope_theta",
                "is only accepted with mla_use_nope = true (rotary MLA is not supported)");
  validate_model_config(c);
  check_deferred(c, d);
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path file =
      fs::is_directory(path, ec) ? fs::path(path) / "config.json" : fs::path(path);
  std::ifstream in(file, std::ios::binary);
  if (!in) fail("cannot read model config ", file.string(), " (missing or unreadable)");
  std::stringstream buf;
  buf << in.rdbuf();
  if (in.bad()) fail("cannot read model config ", file.string());
  json doc;
  try {
    doc = json::parse(buf.str());
  } catch (const json::exception& e) {
    fail("invalid JSON in model config ", file.string(), ": ", e.what());
  }
  try {
    return parse_model_config(doc);
  } catch (const Error& e) {
    fail(file.string(), ": ", e.what());
  }
}

}  // namespace k3
