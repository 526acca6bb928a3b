#include "parallel/layout.h"

#include <cstring>

#include "core/error.h"

namespace k3::parallel {
namespace {

void check_divisible(int64_t value, int parts, const char* what, const char* by) {
  K3_CHECK(parts >= 1 && value % parts == 0, what, " = ", value, " is not divisible by ", by, " = ",
           parts);
}

size_t element_bytes(WeightFormat f) {
  return f == WeightFormat::F32 ? 4 : 2;
}

// Slice [begin, begin + count) of a per-channel fp32 vector.
std::vector<float> slice(const std::vector<float>& v, int64_t begin, int64_t count) {
  K3_CHECK(begin >= 0 && begin + count <= static_cast<int64_t>(v.size()), "slice [", begin, ", ",
           begin + count, ") outside a vector of ", v.size());
  return {v.begin() + begin, v.begin() + begin + count};
}

}  // namespace

ParallelLayout layout_of(const DeployConfig& d) {
  ParallelLayout l;
  l.tp = d.tensor_parallel_size;
  l.dp = d.data_parallel_size;
  l.ep = d.enable_expert_parallel;
  l.dcp = d.decode_context_parallel_size;
  return l;
}

void validate_layout(const ParallelLayout& l, const ModelConfig& cfg) {
  K3_CHECK(l.tp >= 1 && l.dp >= 1, "tensor_parallel_size and data_parallel_size must be >= 1, got ",
           l.tp, " and ", l.dp);
  K3_CHECK(l.dcp == 1 || l.dcp == l.tp, "decode_context_parallel_size = ", l.dcp,
           " must be 1 or tensor_parallel_size = ", l.tp,
           " (the latent cache is sharded over the TP ranks)");
  K3_CHECK(l.dcp == 1 || !cfg.dsa_config.enabled,
           "decode_context_parallel_size > 1 is not supported with DSA (the indexer's top-k needs "
           "every cached index key)");
  check_divisible(cfg.num_attention_heads, l.tp, "num_attention_heads", "tensor_parallel_size");
  if (!cfg.linear_attn_config.kda_layers.empty())
    check_divisible(cfg.linear_attn_config.num_heads, l.tp, "linear_attn_config.num_heads",
                    "tensor_parallel_size");
  check_divisible(cfg.intermediate_size, l.tp, "intermediate_size", "tensor_parallel_size");
  if (cfg.num_shared_experts > 0)
    check_divisible(cfg.shared_expert_dim(), l.tp, "shared expert width", "tensor_parallel_size");
  if (cfg.num_experts > 0) {
    if (l.ep)
      check_divisible(cfg.num_experts, l.world(), "num_experts",
                      "the expert-parallel size (tensor_parallel_size * data_parallel_size)");
    else
      check_divisible(cfg.moe_intermediate_size, l.tp, "moe_intermediate_size",
                      "tensor_parallel_size");
  }
}

WeightMatrix RankWeights::rows(const WeightMatrix& m, int64_t begin, int64_t count) const {
  if (m.empty()) return m;
  K3_CHECK(begin >= 0 && count >= 0 && begin + count <= m.rows, "row slice [", begin, ", ",
           begin + count, ") outside ", m.name, " with ", m.rows, " rows");
  WeightMatrix s = m;
  s.rows = count;
  const auto* base = static_cast<const uint8_t*>(m.data);
  if (m.format == WeightFormat::MXFP4) {
    s.data = base + begin * (m.cols / 2);
    s.scales = m.scales + begin * (m.cols / 32);
  } else {
    s.data = base + static_cast<size_t>(begin * m.cols) * element_bytes(m.format);
  }
  return s;
}

WeightMatrix RankWeights::cols(const WeightMatrix& m, int64_t begin, int64_t count) {
  if (m.empty()) return m;
  K3_CHECK(begin >= 0 && count >= 0 && begin + count <= m.cols, "column slice [", begin, ", ",
           begin + count, ") outside ", m.name, " with ", m.cols, " columns");
  WeightMatrix s;
  s.name = m.name;
  s.rows = m.rows;
  s.cols = count;
  auto& buf = owned_.emplace_back();
  if (m.format == WeightFormat::MXFP4 && begin % 32 == 0 && count % 32 == 0) {
    // Whole 32-blocks: the same packed bytes and E8M0 scales, row by row.
    s.format = WeightFormat::MXFP4;
    const int64_t pb = m.cols / 2, sb = m.cols / 32;  // bytes per row: packed, scales
    const int64_t cpb = count / 2, csb = count / 32;
    buf.resize(static_cast<size_t>(m.rows * (cpb + csb)));
    const auto* packed = static_cast<const uint8_t*>(m.data);
    for (int64_t r = 0; r < m.rows; ++r) {
      std::memcpy(buf.data() + r * cpb, packed + r * pb + begin / 2, static_cast<size_t>(cpb));
      std::memcpy(buf.data() + m.rows * cpb + r * csb, m.scales + r * sb + begin / 32,
                  static_cast<size_t>(csb));
    }
    s.data = buf.data();
    s.scales = buf.data() + m.rows * cpb;
    return s;
  }
  if (m.format == WeightFormat::MXFP4) {
    // A 32-block straddles the slice: materialize as fp32 (every E2M1 x E8M0 value is exact).
    s.format = WeightFormat::F32;
    buf.resize(static_cast<size_t>(m.rows * count) * 4);
    std::vector<float> row(static_cast<size_t>(m.cols));
    for (int64_t r = 0; r < m.rows; ++r) {
      m.row_to_float(r, row.data());
      std::memcpy(buf.data() + static_cast<size_t>(r * count) * 4, row.data() + begin,
                  static_cast<size_t>(count) * 4);
    }
  } else {
    // Same format, same bits: copy each row's column range.
    s.format = m.format;
    const size_t es = element_bytes(m.format);
    buf.resize(static_cast<size_t>(m.rows * count) * es);
    const auto* src = static_cast<const uint8_t*>(m.data);
    for (int64_t r = 0; r < m.rows; ++r)
      std::memcpy(buf.data() + static_cast<size_t>(r * count) * es,
                  src + static_cast<size_t>(r * m.cols + begin) * es,
                  static_cast<size_t>(count) * es);
  }
  s.data = buf.data();
  return s;
}

RankWeights::RankWeights(const ModelConfig& cfg, const ModelWeights& w,
                         const ParallelLayout& layout, int rank)
    : cfg_(cfg), w_(w) {
  validate_layout(layout, cfg);
  K3_CHECK(rank >= 0 && rank < layout.world(), "rank ", rank, " outside the world of ",
           layout.world());
  const int tp = layout.tp, tr = rank % tp;
  cfg_.num_attention_heads /= tp;
  cfg_.linear_attn_config.num_heads /= tp;
  // A [tp]-way split of n: this rank's part [tr * n / tp, (tr + 1) * n / tp).
  auto part = [&](int64_t n) { return std::pair<int64_t, int64_t>{tr * (n / tp), n / tp}; };

  const int E = cfg.num_experts;
  const int per_rank = layout.ep ? E / layout.world() : E;
  expert_begin_ = layout.ep ? rank * per_rank : 0;
  expert_count_ = per_rank;

  for (LayerWeights& L : w_.layers) {
    if (L.kind == LayerKind::KDA) {
      KdaWeights& k = L.kda;
      const int D = cfg.linear_attn_config.head_dim;
      const auto [h0, hn] = part(cfg.linear_attn_config.num_heads);
      const int64_t c0 = h0 * D, cn = hn * D;  // channels [c0, c0 + cn)
      k.q_proj = rows(k.q_proj, c0, cn);
      k.k_proj = rows(k.k_proj, c0, cn);
      k.v_proj = rows(k.v_proj, c0, cn);
      k.q_conv = rows(k.q_conv, c0, cn);
      k.k_conv = rows(k.k_conv, c0, cn);
      k.v_conv = rows(k.v_conv, c0, cn);
      k.f_b = rows(k.f_b, c0, cn);
      k.b_proj = rows(k.b_proj, h0, hn);
      k.g_proj = rows(k.g_proj, c0, cn);
      k.g_b = rows(k.g_b, c0, cn);
      k.o_proj = cols(k.o_proj, c0, cn);
      k.dt_bias = slice(k.dt_bias, c0, cn);
      k.a_log = slice(k.a_log, h0, hn);
    } else {
      MlaWeights& m = L.mla;
      const int64_t qhd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim;
      const int64_t kvb = cfg.qk_nope_head_dim + cfg.v_head_dim, vd = cfg.v_head_dim;
      const auto [h0, hn] = part(cfg.num_attention_heads);
      m.q_b = rows(m.q_b, h0 * qhd, hn * qhd);
      m.q_proj = rows(m.q_proj, h0 * qhd, hn * qhd);
      m.kv_b = rows(m.kv_b, h0 * kvb, hn * kvb);
      m.g_proj = rows(m.g_proj, h0 * vd, hn * vd);
      m.o_proj = cols(m.o_proj, h0 * vd, hn * vd);
    }
    if (!L.moe) {
      const auto [i0, in] = part(L.dense.gate.rows);
      L.dense.gate = rows(L.dense.gate, i0, in);
      L.dense.up = rows(L.dense.up, i0, in);
      L.dense.down = cols(L.dense.down, i0, in);
      continue;
    }
    MoeWeights& moe = L.moe_w;
    if (!moe.shared_gate.empty()) {
      const auto [s0, sn] = part(moe.shared_gate.rows);
      moe.shared_gate = rows(moe.shared_gate, s0, sn);
      moe.shared_up = rows(moe.shared_up, s0, sn);
      moe.shared_down = cols(moe.shared_down, s0, sn);
    }
    for (int e = 0; e < static_cast<int>(moe.experts.size()); ++e) {
      ExpertWeights& x = moe.experts[static_cast<size_t>(e)];
      if (layout.ep) {
        if (e < expert_begin_ || e >= expert_begin_ + expert_count_) x = ExpertWeights{};
        continue;
      }
      const auto [i0, in] = part(x.w1.rows);
      x.w1 = rows(x.w1, i0, in);
      x.w3 = rows(x.w3, i0, in);
      x.w2 = cols(x.w2, i0, in);
    }
  }
}

}  // namespace k3::parallel
