#include "cpu/backbone.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cpu/layers.h"
#include "cpu/ops_attn_res.h"
#include "cpu/ops_basic.h"

namespace k3::cpu {
namespace {

// The AttnRes bank of one token: banked block sums plus the running partial sum P.
class ResidualBank {
 public:
  explicit ResidualBank(size_t hidden) : hidden_(hidden) {}
  bool empty() const { return blocks_.empty(); }
  void push(const std::vector<float>& v) { blocks_.push_back(v); }
  // Mix(R u {P}; w) (spec 3.4), rounded like every boundary tensor.
  void mix(const std::vector<float>& P, const std::vector<float>& w, float eps, const Numerics& num,
           float* out) const {
    std::vector<const float*> src;
    for (const auto& b : blocks_) src.push_back(b.data());
    src.push_back(P.data());
    attn_res_mix(src.data(), static_cast<int>(src.size()), w.data(), static_cast<int64_t>(hidden_),
                 eps, out);
    num.round(out, hidden_);
  }

 private:
  size_t hidden_;
  std::vector<std::vector<float>> blocks_;
};

}  // namespace

CpuBackbone::CpuBackbone(const ModelConfig& cfg, const ModelWeights& w, StateDtypes dt,
                         Numerics num, int64_t max_context)
    : cfg_(cfg),
      w_(w),
      dtypes_(dt),
      num_(num),
      max_context_(max_context > 0 ? max_context : cfg.max_position_embeddings) {}

DecodeState CpuBackbone::new_state() const {
  return make_decode_state(cfg_, dtypes_);
}

void CpuBackbone::step(DecodeState& st, int64_t token, float* logits,
                       const LayerObserver& observe) const {
  run_step(st, token, nullptr, logits, nullptr, observe);
}

void CpuBackbone::step_hidden(DecodeState& st, int64_t token, float* logits, float* hidden_out,
                              const float* input) const {
  run_step(st, token, input, logits, hidden_out, {});
}

void CpuBackbone::run_step(DecodeState& st, int64_t token, const float* input, float* logits,
                           float* hidden_out, const LayerObserver& observe) const {
  K3_CHECK(input || (token >= 0 && token < cfg_.vocab_size), "token id ", token,
           " is outside the vocabulary [0, ", cfg_.vocab_size, ")");
  K3_CHECK(st.position < max_context_, "context length ", max_context_, " exceeded");
  K3_CHECK(static_cast<int>(st.kda.size()) == cfg_.num_hidden_layers,
           "decode state was made for another model");
  const size_t H = static_cast<size_t>(cfg_.hidden_size);
  const float eps = cfg_.rms_norm_eps;

  std::vector<float> P(H), h(H), x(H), sub(H);
  if (input)
    P.assign(input, input + H);
  else
    w_.embed.row_to_float(token, P.data());
  ResidualBank bank(H);

  for (int l = 0; l < cfg_.num_hidden_layers; ++l) {
    const LayerWeights& L = w_.layers[static_cast<size_t>(l)];
    // Attention side: mix the bank (AttnRes) or take the residual stream.
    bool restart = false;
    if (cfg_.has_attn_res() && !bank.empty())
      bank.mix(P, L.attn_res_attn, eps, num_, h.data());
    else
      h = P;
    if (cfg_.is_attn_res_write_layer(l)) {
      bank.push(P);  // the raw partial sum, not the mixed h
      restart = true;
    }
    rms_norm(h.data(), L.input_norm.data(), cfg_.hidden_size, eps, x.data());
    num_.round(x);
    if (L.kind == LayerKind::KDA)
      kda_attention(cfg_, L.kda, num_, st.kda[static_cast<size_t>(l)], x.data(), sub.data());
    else
      mla_attention(cfg_, L.mla, num_, st.mla[static_cast<size_t>(l)], x.data(), sub.data());
    if (observe) observe(l, "attn", sub.data());
    for (size_t i = 0; i < H; ++i) P[i] = restart ? sub[i] : num_.round(P[i] + sub[i]);

    // MLP side.
    if (cfg_.has_attn_res())
      bank.mix(P, L.attn_res_mlp, eps, num_, h.data());
    else
      h = P;
    rms_norm(h.data(), L.post_attn_norm.data(), cfg_.hidden_size, eps, x.data());
    num_.round(x);
    if (L.moe)
      moe_ffn(cfg_, L.moe_w, num_, x.data(), sub.data());
    else
      dense_ffn(cfg_, L.dense, num_, x.data(), sub.data());
    if (observe) observe(l, "ffn", sub.data());
    for (size_t i = 0; i < H; ++i) P[i] = num_.round(P[i] + sub[i]);
  }

  if (cfg_.has_attn_res())
    bank.mix(P, w_.output_attn_res, eps, num_, h.data());
  else
    h = P;
  rms_norm(h.data(), w_.final_norm.data(), cfg_.hidden_size, eps, x.data());
  num_.round(x);
  if (hidden_out) std::copy(x.begin(), x.end(), hidden_out);
  linear(w_.lm_head, x.data(), logits);
  ++st.position;
}

std::vector<float> CpuBackbone::prefill(DecodeState& st, const std::vector<int64_t>& tokens) const {
  K3_CHECK(!tokens.empty(), "prefill needs at least one token");
  std::vector<float> logits(static_cast<size_t>(cfg_.vocab_size));
  for (int64_t t : tokens) step(st, t, logits.data());
  return logits;
}

}  // namespace k3::cpu
