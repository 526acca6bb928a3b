#include "cuda/step_diff.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/backbone.h"
#include "cuda/linear_plan.h"
#include "model/loaded_model.h"

namespace k3::cuda {
namespace {

struct Distance {
  double rel_l2 = 0, max_abs = 0;
};

// a = specialized, b = stock (the reference of the ratio).
Distance distance(const std::vector<float>& a, const std::vector<float>& b) {
  K3_CHECK(a.size() == b.size(), "k3 diff: outputs of ", a.size(), " and ", b.size(), " values");
  double num = 0, den = 0, mx = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
    mx = std::max(mx, std::fabs(d));
  }
  // NaN anywhere must fail the diff, not vanish in std::max.
  if (std::isnan(num)) return {NAN, NAN};
  if (den == 0) return {num == 0 ? 0.0 : INFINITY, mx};
  return {std::sqrt(num / den), mx};
}

// Top-2 gap of the logits over their RMS: how far the argmax is from a tie.
double top2_rel_gap(const std::vector<float>& v) {
  double best = -INFINITY, second = -INFINITY, ss = 0;
  for (float x : v) {
    ss += static_cast<double>(x) * x;
    if (x > best) {
      second = best;
      best = x;
    } else if (x > second) {
      second = x;
    }
  }
  const double rms = std::sqrt(ss / static_cast<double>(std::max<size_t>(v.size(), 1)));
  return rms > 0 ? (best - second) / rms : 0.0;
}

const char* kind_name(LayerKind k) {
  return k == LayerKind::MLA ? "MLA" : "KDA";
}

// One row step of `path` on `slot`; the tap (when set) fills the sublayer outputs.
struct Stepper {
  CudaBackbone& gpu;
  std::vector<float> logits;  // [vocab] of the last step

  int32_t step(int32_t slot, int32_t token, StepPath path) {
    gpu.step({&slot, 1}, {&token, 1}, path);
    gpu.logits_to_host(1, logits.data());
    int32_t id = -1;
    gpu.greedy(1, &id);
    return id;
  }
};

}  // namespace

double StepDiffReport::max_sublayer_rel_l2() const {
  double m = 0;
  for (const auto& s : sublayers)
    m = std::isnan(s.max_rel_l2) ? INFINITY : std::max(m, s.max_rel_l2);
  return m;
}

double StepDiffReport::max_logits_rel_l2() const {
  double m = 0;
  for (double d : logits_rel_l2) m = std::isnan(d) ? INFINITY : std::max(m, d);
  return m;
}

bool StepDiffReport::passed() const {
  return steps > 0 && max_sublayer_rel_l2() <= tolerance && max_logits_rel_l2() <= tolerance &&
         argmax_agree == steps;
}

StepDiffReport diff_specialized_vs_stock(const LoadedModel& model, const StepDiffOptions& opt,
                                         std::ostream& out) {
  const ModelConfig& cfg = model.config;
  K3_CHECK(!opt.prompt.empty(), "k3 diff: the prompt has no tokens");
  K3_CHECK(opt.steps >= 1, "k3 diff: --steps must be >= 1, got ", opt.steps);
  K3_CHECK(opt.tolerance >= 0, "k3 diff: --tolerance must be >= 0, got ", opt.tolerance);
  for (const int32_t t : opt.prompt)
    K3_CHECK(t >= 0 && t < cfg.vocab_size, "k3 diff: prompt token ", t,
             " is outside the vocabulary [0, ", cfg.vocab_size, ")");
  const int P = static_cast<int>(opt.prompt.size());
  const int T = P + opt.steps - 1;  // the last step yields the steps-th generated token
  const int L = cfg.num_hidden_layers;

  CudaBackboneOptions bo;
  bo.max_rows = 2;
  bo.pool.slots = 2;  // 0: stock, 1: specialized
  bo.pool.page_size = 16;
  bo.pool.max_context = (static_cast<int64_t>(T) + 15) / 16 * 16;
  bo.capture_sizes = {1};
  CudaBackbone gpu(cfg, model.weights, bo);
  K3_CHECK(gpu.specialized_ready(), "k3 diff: the specialized path did not come up");
  Stepper run{gpu, std::vector<float>(static_cast<size_t>(cfg.vocab_size))};

  StepDiffReport rep;
  rep.tolerance = opt.tolerance;
  rep.prompt_tokens = P;
  rep.steps = T;
  for (int l = 0; l < L; ++l)
    for (const char* part : {"attn", "ffn"}) rep.sublayers.push_back({l, cfg.layer_kind(l), part});

  // Sublayer outputs of the current step, [layer * 2 + (ffn)] -> [1][hidden] floats.
  std::vector<std::vector<float>> cur(static_cast<size_t>(2 * L)), stock_out;
  std::vector<char> seen(static_cast<size_t>(2 * L), 0);
  gpu.set_layer_tap([&](int layer, const char* part, const std::vector<float>& o) {
    K3_CHECK(layer >= 0 && layer < L, "k3 diff: tap of layer ", layer, " of ", L);
    const size_t k = static_cast<size_t>(layer) * 2 + (std::strcmp(part, "ffn") == 0 ? 1 : 0);
    cur[k] = o;
    seen[k] = 1;
  });
  const auto check_seen = [&](const char* path) {
    for (size_t k = 0; k < seen.size(); ++k)
      K3_CHECK(seen[k], "k3 diff: the ", path, " step reported no output for layer ", k / 2, " ",
               k % 2 ? "ffn" : "attn");
    std::fill(seen.begin(), seen.end(), 0);
  };

  // Teacher-forced: both slots get the same token; after the prompt, the stock greedy token.
  std::vector<float> stock_logits;
  int32_t tok = opt.prompt[0];
  for (int i = 0; i < T; ++i) {
    const int32_t a = run.step(0, tok, StepPath::Stock);
    check_seen("stock");
    stock_out = cur;
    stock_logits = run.logits;
    const int32_t b = run.step(1, tok, StepPath::Specialized);
    check_seen("specialized");
    for (size_t k = 0; k < rep.sublayers.size(); ++k) {
      const Distance d = distance(cur[k], stock_out[k]);
      SublayerDiff& s = rep.sublayers[k];
      // A NaN, once seen, stays (std::max would drop it).
      if (!std::isnan(s.max_rel_l2) &&
          (std::isnan(d.rel_l2) || d.rel_l2 > s.max_rel_l2 || s.worst_step < 0)) {
        s.max_rel_l2 = d.rel_l2;
        s.worst_step = i;
      }
      if (!std::isnan(s.max_abs))
        s.max_abs = std::isnan(d.max_abs) ? NAN : std::max(s.max_abs, d.max_abs);
    }
    rep.logits_rel_l2.push_back(distance(run.logits, stock_logits).rel_l2);
    rep.teacher_stock.push_back(a);
    if (a == b)
      ++rep.argmax_agree;
    else
      rep.mismatches.push_back({i, a, b, top2_rel_gap(stock_logits)});
    if (opt.verbose) {
      char line[160];
      std::snprintf(line, sizeof line, "step %3d token %6d: logits rel L2 %.3e, argmax %d / %d%s\n",
                    i, tok, rep.logits_rel_l2.back(), a, b, a == b ? "" : "  MISMATCH");
      out << line;
    }
    tok = i + 1 < P ? opt.prompt[static_cast<size_t>(i + 1)] : a;
  }

  // Free-running greedy, as served: no tap (graphs), each path on its own tokens.
  gpu.set_layer_tap({});
  gpu.reset_slot(0);
  gpu.reset_slot(1);
  int32_t ta = opt.prompt[0], tb = opt.prompt[0];
  for (int i = 0; i < T; ++i) {
    const int32_t a = run.step(0, ta, StepPath::Stock);
    const int32_t b = run.step(1, tb, StepPath::Specialized);
    if (i + 1 < P) {
      ta = tb = opt.prompt[static_cast<size_t>(i + 1)];
      continue;
    }
    rep.free_stock.push_back(a);
    rep.free_specialized.push_back(b);
    if (a != b && rep.first_divergence < 0)
      rep.first_divergence = static_cast<int>(rep.free_stock.size()) - 1;
    ta = a;
    tb = b;
  }

  // The table and the summary.
  char line[200];
  std::snprintf(line, sizeof line,
                "k3 diff: specialized vs stock step, %d layers, prompt %d tokens, %d generated "
                "(%d teacher-forced steps), tolerance %.2e\n",
                L, P, opt.steps, T, opt.tolerance);
  out << line << "layer  kind  part  max rel L2   max abs      worst step\n";
  for (const auto& s : rep.sublayers) {
    const bool bad = !(s.max_rel_l2 <= opt.tolerance);
    std::snprintf(line, sizeof line, "%5d  %-4s  %-4s  %.3e    %.3e    %4d%s\n", s.layer,
                  kind_name(s.kind), s.part.c_str(), s.max_rel_l2, s.max_abs, s.worst_step,
                  bad ? "  OVER" : "");
    out << line;
  }
  double mean = 0;
  for (double d : rep.logits_rel_l2) mean += d;
  mean /= static_cast<double>(rep.logits_rel_l2.size());
  std::snprintf(line, sizeof line, "logits: max rel L2 %.3e, mean %.3e over %d steps\n",
                rep.max_logits_rel_l2(), mean, T);
  out << line;
  std::snprintf(line, sizeof line, "teacher-forced argmax: %d/%d steps agree\n", rep.argmax_agree,
                T);
  out << line;
  for (const auto& m : rep.mismatches) {
    std::snprintf(line, sizeof line,
                  "  step %d: stock %d, specialized %d (stock top-2 gap %.3e of the logit RMS)\n",
                  m.step, m.stock, m.specialized, m.rel_gap);
    out << line;
  }
  if (rep.first_divergence < 0) {
    std::snprintf(line, sizeof line, "free-running greedy: identical for %d tokens\n", opt.steps);
  } else {
    const size_t d = static_cast<size_t>(rep.first_divergence);
    std::snprintf(line, sizeof line,
                  "free-running greedy: first divergence at generated token %d of %d (stock %d, "
                  "specialized %d)\n",
                  rep.first_divergence, opt.steps, rep.free_stock[d], rep.free_specialized[d]);
  }
  out << line;
  if (opt.verbose) {
    for (const auto* v : {&rep.free_stock, &rep.free_specialized}) {
      out << (v == &rep.free_stock ? "  stock:      " : "  specialized:");
      for (int32_t id : *v) out << ' ' << id;
      out << '\n';
    }
  }
  out << (rep.passed()
              ? "result: PASS (every rel L2 within tolerance, argmax equal on every step)\n"
              : "result: FAIL\n");
  return rep;
}

bool run_step_diff(const LoadedModel& model, const cli::StepDiffArgs& args, std::ostream& out) {
  StepDiffOptions o;
  o.steps = args.steps;
  o.prompt = args.prompt;
  o.tolerance = args.tolerance;
  o.verbose = args.verbose;
  // Before any GEMM runs: the plans of this process (cli::StepDiffArgs::measured_plans).
  set_linear_tuning(args.measured_plans);
  return diff_specialized_vs_stock(model, o, out).passed();
}

}  // namespace k3::cuda
