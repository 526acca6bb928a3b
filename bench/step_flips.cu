// The specialized path with one tuning choice flipped at a time (step_flips.h).
#include "step_flips.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>

#include "step_timing.h"

namespace k3::bench {

void time_tuning_flips(cuda::CudaBackbone& bb, const StepArgs& a, int rows, int64_t ctx,
                       double floor_ms, const std::vector<int32_t>& slots,
                       const std::vector<int32_t>& toks, cuda::DeviceBuffer<uint8_t>& flush) {
  using Tuning = cuda::SpecializedTuning;
  const Tuning def;
  struct Flip {
    std::string what;
    std::function<void(Tuning&)> apply;
  };
  const auto named = [](bool on, const char* off_text, const char* on_text) {
    return std::string(on ? off_text : on_text);
  };
  const std::vector<Flip> flips = {
      {"PDL edges off", [](Tuning& t) { t.pdl = false; }},
      {rows <= def.narrow_rows ? "wide choices at this size (narrow_rows 0)"
                               : "narrow choices at this size (narrow_rows 64)",
       [&](Tuning& t) { t.narrow_rows = rows <= def.narrow_rows ? 0 : 64; }},
      {def.l2_prefetch_bytes > 0 ? "L2 prefetch off" : "L2 prefetch on, 24 MB",
       [&](Tuning& t) {
         t.l2_prefetch_bytes = def.l2_prefetch_bytes > 0 ? 0 : cuda::kL2PrefetchTrialBytes;
       }},
      {def.l2_warm_latent_up_bytes > 0 ? "latent up not warmed" : "latent up warmed, 16 MB",
       [&](Tuning& t) {
         t.l2_warm_latent_up_bytes = def.l2_warm_latent_up_bytes > 0 ? 0 : 16u << 20;
       }},
      {named(def.latent_beside_router, "latent down after the router",
             "latent down beside the router"),
       [&](Tuning& t) { t.latent_beside_router = !def.latent_beside_router; }},
      {named(def.router_beside_latent, "router on the main stream, latent down beside",
             "router beside, latent down on the main stream"),
       [&](Tuning& t) { t.router_beside_latent = !def.router_beside_latent; }},
      {named(def.glu_in_down_proj, "GLU as its own kernel", "GLU in the down-proj"),
       [&](Tuning& t) { t.glu_in_down_proj = !def.glu_in_down_proj; }},
      {named(def.fold_residual_adds, "attention residual as a kernel",
             "attention residual in the o-proj store"),
       [&](Tuning& t) { t.fold_residual_adds = !def.fold_residual_adds; }},
      {named(def.fold_moe_residual, "MoE residual adds as kernels",
             "MoE residual adds in the latent-up store"),
       [&](Tuning& t) { t.fold_moe_residual = !def.fold_moe_residual; }},
      {named(def.join_before_combine, "shared experts joined before the latent up",
             "shared experts joined before the combine"),
       [&](Tuning& t) { t.join_before_combine = !def.join_before_combine; }},
      {named(def.combine_in_latent_up, "MoE combine as its own kernel",
             "MoE combine in the latent up GEMV"),
       [&](Tuning& t) { t.combine_in_latent_up = !def.combine_in_latent_up; }},
      {named(def.early_down_weights, "expert down-projection weights after its wait",
             "expert down-projection weights before its wait"),
       [&](Tuning& t) { t.early_down_weights = !def.early_down_weights; }},
      {named(def.group_in_router, "expert grouping as its own kernel",
             "expert grouping in the router kernel"),
       [&](Tuning& t) { t.group_in_router = !def.group_in_router; }},
      {named(def.mla_kv_beside, "MLA kv path after the query path",
             "MLA kv path beside the query path"),
       [&](Tuning& t) { t.mla_kv_beside = !def.mla_kv_beside; }},
      {named(def.router_merge_tree, "router top-k by the radix select",
             "router top-k by the warp merge tree"),
       [&](Tuning& t) { t.router_merge_tree = !def.router_merge_tree; }},
  };
  const auto timed = [&](const Tuning& t) {
    bb.set_specialized_tuning(t);
    rewind(bb, rows, ctx);
    return time_step(bb, slots, toks, cuda::StepPath::Specialized, a.replays, flush);
  };
  const auto print = [&](double ms, double base, const std::string& what) {
    std::printf("%-12s %6d %8lld %10.3f %10.3f %7.1f%%  %+6.1f%% vs %.3f (%s)\n", "spec-tuning",
                rows, static_cast<long long>(ctx), ms, floor_ms, 100.0 * floor_ms / ms,
                100.0 * (ms / base - 1.0), base, what.c_str());
  };

  Tuning combined = def;
  std::string won;
  double before = timed(def);
  for (const Flip& f : flips) {
    if (f.what.find(a.flips_matching) == std::string::npos) continue;
    Tuning t = def;
    f.apply(t);
    // Repeats: the flip's ratio to the defaults around it, per repeat; the median judges it.
    std::vector<double> flip_ms, base_ms, ratios;
    for (int r = 0; r < a.flip_repeats; ++r) {
      const double ms = timed(t), after = timed(def);
      flip_ms.push_back(ms);
      base_ms.push_back(0.5 * (before + after));
      ratios.push_back(ms / base_ms.back());
      before = after;
    }
    const double ms = median_ms(flip_ms), base = median_ms(base_ms), ratio = median_ms(ratios);
    print(ms, base, f.what);
    if (a.flip_repeats > 1)
      std::printf("%-12s %6d %8lld   %d repeats: median %+.2f%%, range %+.2f%% .. %+.2f%%\n", "",
                  rows, static_cast<long long>(ctx), a.flip_repeats, 100.0 * (ratio - 1.0),
                  100.0 * (*std::min_element(ratios.begin(), ratios.end()) - 1.0),
                  100.0 * (*std::max_element(ratios.begin(), ratios.end()) - 1.0));
    if (ratio < 0.99) {
      f.apply(combined);
      won += (won.empty() ? "" : " + ") + f.what;
    }
  }
  if (!won.empty()) {
    std::vector<double> d = {before}, c;
    for (int i = 0; i < 2; ++i) {
      c.push_back(timed(combined));
      d.push_back(timed(def));
    }
    print(median_ms(c), median_ms(d), "combined: " + won);
  }
  bb.set_specialized_tuning(def);
  rewind(bb, rows, ctx);
  std::printf("%-12s %6d %8lld %10.3f   (defaults recaptured after the flips)\n", "spec-again",
              rows, static_cast<long long>(ctx),
              time_step(bb, slots, toks, cuda::StepPath::Specialized, a.replays, flush));
}

}  // namespace k3::bench
