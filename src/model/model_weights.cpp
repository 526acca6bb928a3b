#include "model/model_weights.h"

#include <unordered_map>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/weight_table.h"

namespace k3 {
namespace {

// Resolves canonical names to the checkpoint tensor actually present (aliases included).
class Binder {
 public:
  Binder(const std::vector<WeightEntry>& table, const Checkpoint& ckpt) : ckpt_(ckpt) {
    for (const auto& e : table) {
      if (const TensorView* v = find_weight(ckpt, e)) by_name_[e.names[0]] = v;
    }
  }
  bool has(const std::string& n) const { return by_name_.count(n) != 0; }
  const TensorView& tensor(const std::string& n) const {
    auto it = by_name_.find(n);
    K3_CHECK(it != by_name_.end(), "tensor ", n, " not found in checkpoint ", ckpt_.dir());
    return *it->second;
  }
  WeightMatrix matrix(const std::string& n) const { return WeightMatrix::from_tensor(tensor(n)); }
  WeightMatrix matrix_if(const std::string& n) const { return has(n) ? matrix(n) : WeightMatrix{}; }
  std::vector<float> vec(const std::string& n) const { return tensor(n).to_float(); }
  std::vector<float> vec_if(const std::string& n) const {
    return has(n) ? vec(n) : std::vector<float>{};
  }
  WeightMatrix mxfp4(const std::string& stem) const {
    return WeightMatrix::from_mxfp4(tensor(stem + ".weight_packed"),
                                    tensor(stem + ".weight_scale"));
  }

 private:
  const Checkpoint& ckpt_;
  std::unordered_map<std::string, const TensorView*> by_name_;
};

std::vector<float> attn_res_score(const Binder& b, const std::string& stem) {
  std::vector<float> w = b.vec(stem + "_norm.weight");
  const std::vector<float> p = b.vec(stem + "_proj.weight");
  for (size_t i = 0; i < w.size(); ++i) w[i] *= p[i];
  return w;
}

KdaWeights bind_kda(const ModelConfig& c, const Binder& b, const std::string& a) {
  KdaWeights k;
  k.q_proj = b.matrix(a + "q_proj.weight");
  k.k_proj = b.matrix(a + "k_proj.weight");
  k.v_proj = b.matrix(a + "v_proj.weight");
  k.q_conv = b.matrix(a + "q_conv1d.weight");
  k.k_conv = b.matrix(a + "k_conv1d.weight");
  k.v_conv = b.matrix(a + "v_conv1d.weight");
  k.f_a = b.matrix(a + "f_a_proj.weight");
  k.f_b = b.matrix(a + "f_b_proj.weight");
  k.b_proj = b.matrix(a + "b_proj.weight");
  k.g_proj = b.matrix_if(a + "g_proj.weight");
  k.g_a = b.matrix_if(a + "g_a_proj.weight");
  k.g_b = b.matrix_if(a + "g_b_proj.weight");
  k.o_proj = b.matrix(a + "o_proj.weight");
  k.dt_bias = b.vec(a + "dt_bias");
  k.o_norm = b.vec(a + "o_norm.weight");
  std::vector<float> a_log = b.vec(a + "A_log");
  const size_t heads = static_cast<size_t>(c.linear_attn_config.num_heads);
  // The published K3 pads A_log to head_dim entries; padding must be zero (as Megatron-Bridge
  // checks) or the checkpoint is not what we think it is.
  for (size_t i = heads; i < a_log.size(); ++i)
    K3_CHECK(a_log[i] == 0.0f, "tensor ", a, "A_log: padding entry ", i, " (beyond num_heads ",
             heads, ") is ", a_log[i], ", expected 0");
  a_log.resize(heads);
  k.a_log = std::move(a_log);
  return k;
}

MlaWeights bind_mla(const ModelConfig& c, const Binder& b, const std::string& a) {
  MlaWeights m;
  m.q_a = b.matrix_if(a + "q_a_proj.weight");
  m.q_b = b.matrix_if(a + "q_b_proj.weight");
  m.q_proj = b.matrix_if(a + "q_proj.weight");
  m.q_a_norm = b.vec_if(a + "q_a_layernorm.weight");
  m.kv_a = b.matrix(a + "kv_a_proj_with_mqa.weight");
  m.kv_a_norm = b.vec(a + "kv_a_layernorm.weight");
  m.kv_b = b.matrix(a + "kv_b_proj.weight");
  m.g_proj = b.matrix_if(a + "g_proj.weight");
  m.o_proj = b.matrix(a + "o_proj.weight");
  if (c.has_dsa()) {
    const std::string x = a + "indexer.";
    const TensorView& wq = b.tensor(x + "wq_b.weight");
    K3_CHECK(wq.dtype != DType::F8_E4M3, "tensor ", wq.name,
             " is an FP8 indexer query weight; the engine runs the indexer from bf16 weights");
    DsaIndexerWeights d;
    d.wq_b = WeightMatrix::from_tensor(wq);
    d.wk = b.matrix(x + "wk.weight");
    d.weights_proj = b.matrix(x + "weights_proj.weight");
    d.k_norm_w = b.vec(x + "k_norm.weight");
    d.k_norm_b = b.vec_if(x + "k_norm.bias");
    m.indexer = std::move(d);
  }
  return m;
}

MoeWeights bind_moe(const ModelConfig& c, const Binder& b, const std::string& m) {
  MoeWeights w;
  w.gate = b.matrix(m + "gate.weight");
  w.score_bias = b.vec_if(m + "gate.e_score_correction_bias");
  w.latent_down = b.matrix_if(m + "routed_expert_down_proj.weight");
  w.latent_up = b.matrix_if(m + "routed_expert_up_proj.weight");
  w.latent_norm = b.vec_if(m + "routed_expert_norm.weight");
  w.shared_gate = b.matrix_if(m + "shared_experts.gate_proj.weight");
  w.shared_up = b.matrix_if(m + "shared_experts.up_proj.weight");
  w.shared_down = b.matrix_if(m + "shared_experts.down_proj.weight");
  w.experts.resize(static_cast<size_t>(c.num_experts));
  for (int e = 0; e < c.num_experts; ++e) {
    const std::string x = m + "experts." + std::to_string(e) + ".";
    ExpertWeights& ew = w.experts[static_cast<size_t>(e)];
    if (c.experts_mxfp4()) {
      ew.w1 = b.mxfp4(x + "w1");
      ew.w3 = b.mxfp4(x + "w3");
      ew.w2 = b.mxfp4(x + "w2");
    } else {
      ew.w1 = b.matrix(x + "w1.weight");
      ew.w3 = b.matrix(x + "w3.weight");
      ew.w2 = b.matrix(x + "w2.weight");
    }
  }
  return w;
}

}  // namespace

ModelWeights bind_weights(const ModelConfig& c, const Checkpoint& ckpt) {
  const std::vector<WeightEntry> table = weight_table(c);
  require_weights(ckpt, table);
  const Binder b(table, ckpt);
  const std::string pre = c.tensor_prefix();
  ModelWeights w;
  w.embed = b.matrix(pre + "embed_tokens.weight");
  w.lm_head = c.tie_word_embeddings ? w.embed : b.matrix(c.lm_head_name());
  w.final_norm = b.vec(pre + "norm.weight");
  if (c.has_attn_res()) w.output_attn_res = attn_res_score(b, pre + "output_attn_res");
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& L = w.layers[static_cast<size_t>(l)];
    const std::string p = pre + "layers." + std::to_string(l) + ".";
    L.kind = c.layer_kind(l);
    L.moe = c.is_moe_layer(l);
    L.input_norm = b.vec(p + "input_layernorm.weight");
    L.post_attn_norm = b.vec(p + "post_attention_layernorm.weight");
    if (c.has_attn_res()) {
      L.attn_res_attn = attn_res_score(b, p + "self_attention_res");
      L.attn_res_mlp = attn_res_score(b, p + "mlp_res");
    }
    if (L.kind == LayerKind::KDA)
      L.kda = bind_kda(c, b, p + "self_attn.");
    else
      L.mla = bind_mla(c, b, p + "self_attn.");
    if (L.moe) {
      L.moe_w = bind_moe(c, b, p + "block_sparse_moe.");
    } else {
      L.dense.gate = b.matrix(p + "mlp.gate_proj.weight");
      L.dense.up = b.matrix(p + "mlp.up_proj.weight");
      L.dense.down = b.matrix(p + "mlp.down_proj.weight");
    }
  }
  return w;
}

}  // namespace k3
