// Gated NoPE MLA decode (spec 3.3). Two forms of the same function:
//  - absorbed: what the GPU runs. W_uk is folded into the query and W_uv is applied after the
//    weighted sum, so attention is MQA over the 576-wide latent cache (kv_lora + rope).
//  - naive: per-head keys and values are materialised from the latent. It exists only to pin
//    the absorbed form (they are equal in exact arithmetic).
// Both accumulate in fp32 and run the softmax in fp32 with the max subtracted.
#include "cpu/ops_mla.h"

#include <algorithm>
#include <span>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "cpu/ops_basic.h"

namespace k3::cpu {
namespace {

// Checks dimensions and the kv_b shape, and returns the visible token indices in the order
// they are attended (the order only changes fp32 rounding of the sums, not the result).
std::vector<int64_t> visible_tokens(const WeightMatrix& kv_b, int64_t T, const int64_t* selected,
                                    int64_t n_selected, const MlaDims& d) {
  K3_CHECK(d.heads > 0 && d.nope > 0 && d.rope >= 0 && d.v > 0 && d.kv_lora > 0,
           "MLA: bad dims heads=", d.heads, " nope=", d.nope, " rope=", d.rope, " v=", d.v,
           " kv_lora=", d.kv_lora);
  K3_CHECK(kv_b.rows == static_cast<int64_t>(d.heads) * (d.nope + d.v) && kv_b.cols == d.kv_lora,
           "MLA: kv_b ", kv_b.name, " is [", kv_b.rows, ", ", kv_b.cols, "], expected [",
           static_cast<int64_t>(d.heads) * (d.nope + d.v), ", ", d.kv_lora, "]");
  K3_CHECK(T >= 1, "MLA decode needs at least one cached token, got T=", T);
  std::vector<int64_t> tokens;
  if (selected == nullptr) {
    tokens.resize(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) tokens[static_cast<size_t>(t)] = t;
    return tokens;
  }
  K3_CHECK(n_selected >= 1, "MLA: selected token list is empty");
  // A duplicated index would count that token twice in the softmax; DSA top-k never emits one.
  std::vector<bool> seen(static_cast<size_t>(T), false);
  tokens.assign(selected, selected + n_selected);
  for (int64_t t : tokens) {
    K3_CHECK(t >= 0 && t < T, "MLA: selected token ", t, " out of range [0, ", T, ")");
    K3_CHECK(!seen[static_cast<size_t>(t)], "MLA: selected token ", t, " appears twice");
    seen[static_cast<size_t>(t)] = true;
  }
  return tokens;
}

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void mla_absorbed_decode(const float* q_nope, const float* q_pe, const WeightMatrix& kv_b,
                         const float* cache_c, const float* cache_pe, int64_t T,
                         const int64_t* selected, int64_t n_selected, const MlaDims& d,
                         float softmax_scale, float* out, bool bf16_q_abs) {
  // q_nope: [heads][nope], q_pe: [heads][rope], kv_b: [heads*(nope+v), kv_lora],
  // cache_c: [T][kv_lora], cache_pe: [T][rope], selected: [n_selected] or null, out: [heads][v].
  const std::vector<int64_t> tokens = visible_tokens(kv_b, T, selected, n_selected, d);
  const int64_t L = d.kv_lora, R = d.rope;
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<float> w_row(static_cast<size_t>(L));  // one W_uk row, [kv_lora]
  std::vector<float> q_abs(static_cast<size_t>(L));  // q~ = W_uk[h]^T q_nope[h], [kv_lora]
  std::vector<float> p(static_cast<size_t>(n));      // scores, then probabilities, [n]
  std::vector<float> o_lat(static_cast<size_t>(L));  // o-bar = sum_t p_t c_t, [kv_lora]
  for (int h = 0; h < d.heads; ++h) {
    const int64_t uk_row0 = static_cast<int64_t>(h) * (d.nope + d.v);  // first W_uk[h] row
    const float* qn = q_nope + static_cast<int64_t>(h) * d.nope;       // [nope]
    const float* qp = q_pe + static_cast<int64_t>(h) * R;              // [rope]

    // q~[j] = sum_i W_uk[h][i][j] q_nope[i]: accumulate row by row (W_uk is stored [nope, L]).
    std::fill(q_abs.begin(), q_abs.end(), 0.0f);
    for (int64_t i = 0; i < d.nope; ++i) {
      kv_b.row_to_float(uk_row0 + i, w_row.data());
      for (int64_t j = 0; j < L; ++j)
        q_abs[static_cast<size_t>(j)] += w_row[static_cast<size_t>(j)] * qn[i];
    }
    if (bf16_q_abs) round_bf16(std::span<float>(q_abs));

    // One KV head shared by all query heads: s_t = (q~ . c_t + q_pe . pe_t) * scale.
    for (int64_t k = 0; k < n; ++k) {
      const int64_t t = tokens[static_cast<size_t>(k)];
      const float s = dot(q_abs.data(), cache_c + t * L, L) + dot(qp, cache_pe + t * R, R);
      p[static_cast<size_t>(k)] = s * softmax_scale;
    }
    softmax(p.data(), n);

    // Weighted sum in latent space; W_uv is applied once afterwards instead of per token.
    std::fill(o_lat.begin(), o_lat.end(), 0.0f);
    for (int64_t k = 0; k < n; ++k) {
      const float* c = cache_c + tokens[static_cast<size_t>(k)] * L;  // [kv_lora]
      const float pk = p[static_cast<size_t>(k)];
      for (int64_t j = 0; j < L; ++j) o_lat[static_cast<size_t>(j)] += pk * c[j];
    }
    linear_rows(kv_b, uk_row0 + d.nope, d.v, o_lat.data(), out + static_cast<int64_t>(h) * d.v);
  }
}

void mla_naive_decode(const float* q_nope, const float* q_pe, const WeightMatrix& kv_b,
                      const float* cache_c, const float* cache_pe, int64_t T,
                      const int64_t* selected, int64_t n_selected, const MlaDims& d,
                      float softmax_scale, float* out) {
  // Same shapes as mla_absorbed_decode.
  const std::vector<int64_t> tokens = visible_tokens(kv_b, T, selected, n_selected, d);
  const int64_t L = d.kv_lora, R = d.rope;
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<float> k_nope(static_cast<size_t>(d.nope));  // W_uk[h] c_t, [nope]
  std::vector<float> v_all(static_cast<size_t>(n * d.v));  // W_uv[h] c_t, [n][v]
  std::vector<float> p(static_cast<size_t>(n));            // [n]
  for (int h = 0; h < d.heads; ++h) {
    const int64_t uk_row0 = static_cast<int64_t>(h) * (d.nope + d.v);
    const float* qn = q_nope + static_cast<int64_t>(h) * d.nope;  // [nope]
    const float* qp = q_pe + static_cast<int64_t>(h) * R;         // [rope]
    for (int64_t k = 0; k < n; ++k) {
      const int64_t t = tokens[static_cast<size_t>(k)];
      const float* c = cache_c + t * L;  // [kv_lora]
      // k_t[h] = [W_uk[h] c_t ; pe_t] (pe unrotated: NoPE), v_t[h] = W_uv[h] c_t.
      linear_rows(kv_b, uk_row0, d.nope, c, k_nope.data());
      linear_rows(kv_b, uk_row0 + d.nope, d.v, c, v_all.data() + k * d.v);
      const float s = dot(qn, k_nope.data(), d.nope) + dot(qp, cache_pe + t * R, R);
      p[static_cast<size_t>(k)] = s * softmax_scale;
    }
    softmax(p.data(), n);
    float* o = out + static_cast<int64_t>(h) * d.v;  // [v]
    for (int64_t j = 0; j < d.v; ++j) o[j] = 0.0f;
    for (int64_t k = 0; k < n; ++k)
      for (int64_t j = 0; j < d.v; ++j)
        o[j] += p[static_cast<size_t>(k)] * v_all[static_cast<size_t>(k * d.v + j)];
  }
}

}  // namespace k3::cpu
