#include "spec/drafter.h"

#include <algorithm>

#include "core/error.h"
#include "spec/draft_model.h"

namespace k3::spec {

NgramDrafter::NgramDrafter(int prompt_lookup_min, int prompt_lookup_max)
    : min_(prompt_lookup_min), max_(prompt_lookup_max) {
  K3_CHECK(min_ >= 1 && min_ <= max_, "ngram drafter: need 1 <= prompt_lookup_min (", min_,
           ") <= prompt_lookup_max (", max_, ")");
}

DraftTokens NgramDrafter::propose(std::span<const int64_t> ctx, int n) {
  DraftTokens d;
  const auto len = static_cast<int64_t>(ctx.size());
  if (n <= 0) return d;
  for (int64_t w = std::min<int64_t>(max_, len - 1); w >= min_; --w) {
    const auto suffix = ctx.subspan(static_cast<size_t>(len - w));
    // Earlier occurrences start at s < len - w; scan from the most recent one back.
    for (int64_t s = len - w - 1; s >= 0; --s) {
      if (!std::equal(suffix.begin(), suffix.end(), ctx.begin() + s)) continue;
      const int64_t from = s + w;  // < len: at least one token follows the match
      const int64_t to = std::min(len, from + n);
      d.tokens.assign(ctx.begin() + from, ctx.begin() + to);
      return d;
    }
  }
  return d;
}

std::unique_ptr<Drafter> make_drafter(const SpeculativeConfig& cfg, const DraftModel* draft,
                                      const cpu::SamplingParams& sampling) {
  if (cfg.method == "ngram")
    return std::make_unique<NgramDrafter>(cfg.prompt_lookup_min, cfg.prompt_lookup_max);
  if (cfg.method == "draft_model") {
    K3_CHECK(draft != nullptr, "speculative_config.method draft_model: the draft checkpoint (",
             cfg.model, ") is not loaded");
    return std::make_unique<DraftModelDrafter>(*draft, sampling);
  }
  fail("speculative_config.method \"", cfg.method,
       "\" is not implemented by this build (supported: ngram, draft_model)");
}

}  // namespace k3::spec
