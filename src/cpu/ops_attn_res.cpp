// Attention Residuals mixing (spec 3.4), fp32 throughout.
#include "cpu/ops_attn_res.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "cpu/ops_basic.h"

namespace k3::cpu {

void attn_res_mix(const float* const* sources, int n_sources, const float* score_w, int64_t dim,
                  float eps, float* out, float* probs) {
  // sources: [n_sources] pointers to [dim] fp32; score_w: [dim] fp32; out: [dim] fp32;
  // probs: [n_sources] fp32 or null
  K3_CHECK(n_sources >= 1, "attn_res_mix: needs at least one source, got ", n_sources);
  K3_CHECK(dim > 0, "attn_res_mix: dim = ", dim);
  K3_CHECK(sources != nullptr && score_w != nullptr && out != nullptr,
           "attn_res_mix: null input/output");
  for (int j = 0; j < n_sources; ++j)
    K3_CHECK(sources[j] != nullptr, "attn_res_mix: source ", j, " is null");

  std::vector<float> p(static_cast<size_t>(n_sources));  // [n_sources] fp32: scores, then probs
  for (int j = 0; j < n_sources; ++j) {
    const float* v = sources[j];  // [dim] fp32
    float ss = 0.0f, dot = 0.0f;
    for (int64_t i = 0; i < dim; ++i) {
      ss += v[i] * v[i];
      dot += v[i] * score_w[i];
    }
    // <v * r, w> == r * <v, w> for the scalar r = rsqrt(mean(v^2) + eps).
    p[j] = dot / std::sqrt(ss / static_cast<float>(dim) + eps);
  }
  // One source is the layer-0 "no mixing" case: p = 1 exactly (softmax would give 1 too, but
  // not for a non-finite score), so out is v_0 bit for bit.
  if (n_sources == 1)
    p[0] = 1.0f;
  else
    softmax(p.data(), n_sources);
  if (probs)
    for (int j = 0; j < n_sources; ++j) probs[j] = p[j];

  // The mixture uses the RAW sources (not the normalized ones). Element-wise over i with all
  // sources read before out[i] is written, so out may alias a source.
  for (int64_t i = 0; i < dim; ++i) {
    float acc = 0.0f;
    for (int j = 0; j < n_sources; ++j) acc += p[j] * sources[j][i];
    out[i] = acc;
  }
}

}  // namespace k3::cpu
