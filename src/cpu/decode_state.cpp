#include "cpu/decode_state.h"

#include <cstring>

#include "core/error.h"
#include "core/numeric.h"

namespace k3::cpu {

StateBuffer::StateBuffer(DType dtype, size_t n) : dtype_(dtype), n_(n) {
  K3_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16,
           "decode state dtype must be F32, BF16 or F16, got ", dtype_name(dtype));
  bytes_.assign(n * dtype_size(dtype), 0);
}

void StateBuffer::load(float* out) const {
  switch (dtype_) {
    case DType::F32:
      std::memcpy(out, bytes_.data(), 4 * n_);
      return;
    case DType::BF16:
      for (size_t i = 0; i < n_; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes_.data() + 2 * i, 2);
        out[i] = bf16_to_float(h);
      }
      return;
    default:
      for (size_t i = 0; i < n_; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes_.data() + 2 * i, 2);
        out[i] = f16_to_float(h);
      }
  }
}

void StateBuffer::store(const float* in) {
  switch (dtype_) {
    case DType::F32:
      std::memcpy(bytes_.data(), in, 4 * n_);
      return;
    case DType::BF16:
      for (size_t i = 0; i < n_; ++i) {
        const uint16_t h = float_to_bf16(in[i]);
        std::memcpy(bytes_.data() + 2 * i, &h, 2);
      }
      return;
    default:
      for (size_t i = 0; i < n_; ++i) {
        const uint16_t h = float_to_f16(in[i]);
        std::memcpy(bytes_.data() + 2 * i, &h, 2);
      }
  }
}

void StateBuffer::zero() {
  std::fill(bytes_.begin(), bytes_.end(), 0);
}

void DecodeState::reset() {
  position = 0;
  for (auto& k : kda) {
    k.recurrent.zero();
    k.conv.zero();
  }
  for (auto& m : mla) {
    m.latent.clear();
    m.index_keys.clear();
    m.index_scales.clear();
  }
}

void DecodeState::truncate(int64_t new_position) {
  K3_CHECK(new_position >= 0 && new_position <= position, "truncate to ", new_position,
           " outside the context [0, ", position, "]");
  if (new_position == position) return;
  // Every MLA cache vector holds the same number of values per token, so its per-token width
  // follows from its size; this keeps truncation independent of the cache's layout.
  const auto cut = [&](auto& v) {
    K3_CHECK(v.size() % static_cast<size_t>(position) == 0,
             "decode state: a cache does not hold whole tokens");
    v.resize(v.size() / static_cast<size_t>(position) * static_cast<size_t>(new_position));
  };
  for (auto& m : mla) {
    cut(m.latent);
    cut(m.index_keys);
    cut(m.index_scales);
  }
  position = new_position;
}

float round_to(DType t, float v) {
  switch (t) {
    case DType::F32:
      return v;
    case DType::BF16:
      return round_bf16(v);
    case DType::F16:
      return f16_to_float(float_to_f16(v));
    default:
      fail("decode state dtype must be F32, BF16 or F16, got ", dtype_name(t));
  }
}

DecodeState make_decode_state(const ModelConfig& cfg, const StateDtypes& dt) {
  DecodeState s;
  const size_t layers = static_cast<size_t>(cfg.num_hidden_layers);
  s.kda.resize(layers);
  s.mla.resize(layers);
  const auto& la = cfg.linear_attn_config;
  const size_t D = static_cast<size_t>(la.head_dim);
  const size_t P = static_cast<size_t>(cfg.kda_proj_dim());
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    if (cfg.layer_kind(l) != LayerKind::KDA) {
      latent_entry_bytes(dt.latent_format, cfg.kv_lora_rank, cfg.qk_rope_head_dim);  // validates
      s.mla[static_cast<size_t>(l)].latent_format = dt.latent_format;
      continue;
    }
    auto& k = s.kda[static_cast<size_t>(l)];
    k.recurrent = StateBuffer(dt.recurrent, static_cast<size_t>(la.num_heads) * D * D);
    k.conv = StateBuffer(dt.conv, 3 * P * static_cast<size_t>(la.short_conv_kernel_size - 1));
  }
  return s;
}

}  // namespace k3::cpu
