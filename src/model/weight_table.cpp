#include "model/weight_table.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "core/error.h"
#include "io/safetensors.h"

namespace k3 {

std::string_view weight_kind_name(WeightKind k) {
  switch (k) {
    case WeightKind::Embedding:
      return "embedding";
    case WeightKind::LmHead:
      return "lm_head";
    case WeightKind::Norm:
      return "norms";
    case WeightKind::AttnRes:
      return "attn_res";
    case WeightKind::KdaProj:
      return "kda_proj";
    case WeightKind::KdaParam:
      return "kda_params";
    case WeightKind::MlaProj:
      return "mla_proj";
    case WeightKind::DsaIndexer:
      return "dsa_indexer";
    case WeightKind::Router:
      return "router";
    case WeightKind::LatentProj:
      return "latent_proj";
    case WeightKind::SharedExpert:
      return "shared_experts";
    case WeightKind::DenseFfn:
      return "dense_ffn";
    case WeightKind::RoutedExpert:
      return "routed_experts";
  }
  return "?";
}

namespace {

constexpr DType BF16 = DType::BF16;
constexpr DType F32 = DType::F32;
constexpr DType U8 = DType::U8;

// Builds the table; `add` keeps call sites one line per tensor.
class TableBuilder {
 public:
  explicit TableBuilder(const ModelConfig& c) : c_(c) {}

  void add(std::string name, std::vector<DType> dtypes, std::vector<Shape> shapes, WeightKind kind,
           int layer = -1, int expert = -1) {
    out.push_back({{std::move(name)}, std::move(dtypes), std::move(shapes), kind, layer, expert});
  }
  void add_alias(const std::string& alias) { out.back().names.push_back(alias); }
  // Activation-side weights are stored in the model dtype; bf16 is what K3 ships.
  std::vector<DType> act() const { return {c_.dtype == F32 ? F32 : BF16}; }
  // Small fp32-by-design parameters (conv, A_log, dt_bias); bf16 copies exist in some exports.
  static std::vector<DType> f32_or_bf16() { return {F32, BF16}; }

  std::vector<WeightEntry> out;

 private:
  const ModelConfig& c_;
};

void add_attn_res(TableBuilder& t, const std::string& p, const std::string& stem, int64_t H,
                  int layer) {
  t.add(p + stem + "_norm.weight", t.act(), {{H}}, WeightKind::AttnRes, layer);
  t.add(p + stem + "_proj.weight", t.act(), {{1, H}, {H}}, WeightKind::AttnRes, layer);
}

void add_kda(TableBuilder& t, const ModelConfig& c, const std::string& a, int l) {
  const int64_t H = c.hidden_size, P = c.kda_proj_dim(), D = c.linear_attn_config.head_dim;
  const int64_t heads = c.linear_attn_config.num_heads,
                K = c.linear_attn_config.short_conv_kernel_size;
  for (const char* x : {"q", "k", "v"}) {
    t.add(a + x + "_proj.weight", t.act(), {{P, H}}, WeightKind::KdaProj, l);
    t.add(a + x + "_conv1d.weight", t.f32_or_bf16(), {{P, 1, K}, {P, K}}, WeightKind::KdaParam, l);
  }
  t.add(a + "f_a_proj.weight", t.act(), {{D, H}}, WeightKind::KdaProj, l);
  t.add(a + "f_b_proj.weight", t.act(), {{P, D}}, WeightKind::KdaProj, l);
  t.add(a + "dt_bias", t.f32_or_bf16(), {{P}, {heads, D}}, WeightKind::KdaParam, l);
  // K3 stores A_log padded to head_dim entries ([128] for 96 heads); Kimi-Linear as [1,1,H,1].
  std::vector<Shape> a_log = {{std::max(heads, D)}, {heads}, {1, 1, heads, 1}};
  if (!c.nested_text_config) std::swap(a_log[0], a_log[2]);
  t.add(a + "A_log", t.f32_or_bf16(), a_log, WeightKind::KdaParam, l);
  t.add(a + "b_proj.weight", t.act(), {{heads, H}}, WeightKind::KdaProj, l);
  if (c.linear_attn_config.use_full_rank_gate) {
    t.add(a + "g_proj.weight", t.act(), {{P, H}}, WeightKind::KdaProj, l);
  } else {
    t.add(a + "g_a_proj.weight", t.act(), {{D, H}}, WeightKind::KdaProj, l);
    t.add(a + "g_b_proj.weight", t.act(), {{P, D}}, WeightKind::KdaProj, l);
  }
  t.add(a + "o_norm.weight", {BF16, F32}, {{D}}, WeightKind::Norm, l);
  t.add(a + "o_proj.weight", t.act(), {{H, P}}, WeightKind::KdaProj, l);
}

void add_mla(TableBuilder& t, const ModelConfig& c, const std::string& a, int l) {
  const int64_t H = c.hidden_size, heads = c.num_attention_heads, qhd = c.q_head_dim();
  const int64_t kvl = c.kv_lora_rank, rope = c.qk_rope_head_dim;
  if (c.q_lora_rank) {
    const int64_t ql = *c.q_lora_rank;
    t.add(a + "q_a_proj.weight", t.act(), {{ql, H}}, WeightKind::MlaProj, l);
    t.add(a + "q_a_layernorm.weight", t.act(), {{ql}}, WeightKind::Norm, l);
    t.add(a + "q_b_proj.weight", t.act(), {{heads * qhd, ql}}, WeightKind::MlaProj, l);
  } else {
    t.add(a + "q_proj.weight", t.act(), {{heads * qhd, H}}, WeightKind::MlaProj, l);
  }
  t.add(a + "kv_a_proj_with_mqa.weight", t.act(), {{kvl + rope, H}}, WeightKind::MlaProj, l);
  t.add(a + "kv_a_layernorm.weight", t.act(), {{kvl}}, WeightKind::Norm, l);
  t.add(a + "kv_b_proj.weight", t.act(), {{heads * (c.qk_nope_head_dim + c.v_head_dim), kvl}},
        WeightKind::MlaProj, l);
  if (c.mla_use_output_gate)
    t.add(a + "g_proj.weight", t.act(), {{heads * c.v_head_dim, H}}, WeightKind::MlaProj, l);
  t.add(a + "o_proj.weight", t.act(), {{H, heads * c.v_head_dim}}, WeightKind::MlaProj, l);
  if (c.has_dsa()) {
    const auto& d = c.dsa_config;
    K3_CHECK(c.q_lora_rank, "dsa_config needs q_lora_rank: the indexer reads the q latent");
    const std::string x = a + "indexer.";
    // An FP8 wq_b is accepted here so the deployment layer can refuse it with its reason.
    t.add(x + "wq_b.weight", {BF16, DType::F8_E4M3},
          {{int64_t(d.index_n_heads) * d.index_head_dim, *c.q_lora_rank}}, WeightKind::DsaIndexer,
          l);
    t.add(x + "wk.weight", t.act(), {{d.index_head_dim, H}}, WeightKind::DsaIndexer, l);
    t.add(x + "k_norm.weight", {BF16, F32}, {{d.index_head_dim}}, WeightKind::DsaIndexer, l);
    if (d.index_k_norm_type == "layernorm")
      t.add(x + "k_norm.bias", {BF16, F32}, {{d.index_head_dim}}, WeightKind::DsaIndexer, l);
    t.add(x + "weights_proj.weight", t.act(), {{d.index_n_heads, H}}, WeightKind::DsaIndexer, l);
  }
}

void add_dense_ffn(TableBuilder& t, const ModelConfig& c, const std::string& p, int l) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  // transformers' kimi_linear saves the dense layer as block_sparse_moe.{gate,up,down}_proj.
  for (const char* x : {"gate", "up"}) {
    t.add(p + "mlp." + x + "_proj.weight", t.act(), {{I, H}}, WeightKind::DenseFfn, l);
    t.add_alias(p + "block_sparse_moe." + x + "_proj.weight");
  }
  t.add(p + "mlp.down_proj.weight", t.act(), {{H, I}}, WeightKind::DenseFfn, l);
  t.add_alias(p + "block_sparse_moe.down_proj.weight");
}

void add_moe(TableBuilder& t, const ModelConfig& c, const std::string& p, int l) {
  const int64_t H = c.hidden_size, E = c.num_experts, L = c.expert_io_dim();
  const int64_t I = c.moe_intermediate_size, S = c.shared_expert_dim();
  const std::string m = p + "block_sparse_moe.";
  t.add(m + "gate.weight", t.act(), {{E, H}}, WeightKind::Router, l);
  if (c.topk_method == "noaux_tc")
    t.add(m + "gate.e_score_correction_bias", {BF16, F32}, {{E}}, WeightKind::Router, l);
  if (c.routed_expert_hidden_size) {
    t.add(m + "routed_expert_down_proj.weight", t.act(), {{L, H}}, WeightKind::LatentProj, l);
    if (c.latent_moe_use_norm)
      t.add(m + "routed_expert_norm.weight", t.act(), {{L}}, WeightKind::Norm, l);
    t.add(m + "routed_expert_up_proj.weight", t.act(), {{H, L}}, WeightKind::LatentProj, l);
  }
  if (S > 0) {
    t.add(m + "shared_experts.gate_proj.weight", t.act(), {{S, H}}, WeightKind::SharedExpert, l);
    t.add(m + "shared_experts.up_proj.weight", t.act(), {{S, H}}, WeightKind::SharedExpert, l);
    t.add(m + "shared_experts.down_proj.weight", t.act(), {{H, S}}, WeightKind::SharedExpert, l);
  }
  for (int e = 0; e < c.num_experts; ++e) {
    const std::string x = m + "experts." + std::to_string(e) + ".";
    // w1 (gate) / w3 (up): [I, L]; w2 (down): [L, I].
    const std::pair<const char*, std::pair<int64_t, int64_t>> mats[] = {
        {"w1", {I, L}}, {"w3", {I, L}}, {"w2", {L, I}}};
    for (const auto& [w, rc] : mats) {
      const auto [rows, cols] = rc;
      if (c.experts_mxfp4()) {
        t.add(x + w + ".weight_packed", {U8}, {{rows, cols / 2}}, WeightKind::RoutedExpert, l, e);
        t.add(x + w + ".weight_scale", {U8}, {{rows, cols / 32}}, WeightKind::RoutedExpert, l, e);
      } else {
        t.add(x + w + ".weight", t.act(), {{rows, cols}}, WeightKind::RoutedExpert, l, e);
      }
    }
  }
}

std::string describe(const WeightEntry& e) {
  std::ostringstream os;
  for (size_t i = 0; i < e.dtypes.size(); ++i) os << (i ? "|" : "") << dtype_name(e.dtypes[i]);
  os << ' ';
  for (size_t i = 0; i < e.shapes.size(); ++i) os << (i ? " or " : "") << shape_str(e.shapes[i]);
  return os.str();
}

}  // namespace

std::vector<WeightEntry> weight_table(const ModelConfig& c) {
  TableBuilder t(c);
  const std::string pre = c.tensor_prefix();
  const int64_t H = c.hidden_size, V = c.vocab_size;
  if (c.experts_mxfp4()) {
    K3_CHECK(c.expert_io_dim() % 32 == 0 && c.moe_intermediate_size % 32 == 0,
             "MXFP4 experts need routed_expert_hidden_size and moe_intermediate_size divisible by "
             "32 (group size), got ",
             c.expert_io_dim(), " and ", c.moe_intermediate_size);
  }
  t.add(pre + "embed_tokens.weight", t.act(), {{V, H}}, WeightKind::Embedding);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = pre + "layers." + std::to_string(l) + ".";
    t.add(p + "input_layernorm.weight", t.act(), {{H}}, WeightKind::Norm, l);
    t.add(p + "post_attention_layernorm.weight", t.act(), {{H}}, WeightKind::Norm, l);
    if (c.has_attn_res()) {
      add_attn_res(t, p, "self_attention_res", H, l);
      add_attn_res(t, p, "mlp_res", H, l);
    }
    if (c.layer_kind(l) == LayerKind::KDA)
      add_kda(t, c, p + "self_attn.", l);
    else
      add_mla(t, c, p + "self_attn.", l);
    if (c.is_moe_layer(l))
      add_moe(t, c, p, l);
    else
      add_dense_ffn(t, c, p, l);
  }
  t.add(pre + "norm.weight", t.act(), {{H}}, WeightKind::Norm);
  if (c.has_attn_res()) add_attn_res(t, pre, "output_attn_res", H, -1);
  if (!c.tie_word_embeddings) t.add(c.lm_head_name(), t.act(), {{V, H}}, WeightKind::LmHead);
  return std::move(t.out);
}

const TensorView* find_weight(const Checkpoint& ckpt, const WeightEntry& e) {
  for (const auto& n : e.names)
    if (const TensorView* v = ckpt.find(n)) return v;
  return nullptr;
}

WeightCheck check_weights(const Checkpoint& ckpt, const std::vector<WeightEntry>& table) {
  WeightCheck r;
  std::set<std::string> known;
  for (const auto& e : table) {
    for (const auto& n : e.names) known.insert(n);
    const TensorView* v = find_weight(ckpt, e);
    if (!v) {
      r.missing.push_back(e.names[0] + " (expected " + describe(e) + ")");
      continue;
    }
    const bool dtype_ok = std::find(e.dtypes.begin(), e.dtypes.end(), v->dtype) != e.dtypes.end();
    const bool shape_ok = std::find(e.shapes.begin(), e.shapes.end(), v->shape) != e.shapes.end();
    if (!dtype_ok || !shape_ok) {
      r.mismatched.push_back(v->name + ": got " + std::string(dtype_name(v->dtype)) + " " +
                             shape_str(v->shape) + ", expected " + describe(e));
      continue;
    }
    r.bytes_by_kind[e.kind] += v->nbytes;
    r.total_bytes += v->nbytes;
  }
  for (const auto& n : ckpt.names())
    if (!known.count(n)) r.unknown.push_back(n);
  return r;
}

void require_weights(const Checkpoint& ckpt, const std::vector<WeightEntry>& table) {
  const WeightCheck r = check_weights(ckpt, table);
  if (r.ok()) return;
  std::ostringstream os;
  os << "checkpoint " << ckpt.dir() << " does not match its config: " << r.missing.size()
     << " missing, " << r.mismatched.size() << " mismatched tensor(s)";
  constexpr size_t kMaxListed = 50;  // a wrong-model checkpoint would otherwise list 80k lines
  size_t listed = 0;
  for (const auto& m : r.missing)
    if (listed++ < kMaxListed) os << "\n  missing: " << m;
  for (const auto& m : r.mismatched)
    if (listed++ < kMaxListed) os << "\n  mismatched: " << m;
  if (listed > kMaxListed) os << "\n  ... and " << (listed - kMaxListed) << " more";
  fail(os.str());
}

}  // namespace k3
