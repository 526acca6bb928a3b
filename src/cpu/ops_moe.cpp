// MoE reference ops (spec 3.6): the noaux_tc router (DeepSeek-V3 / K3 gate) and the gated MLP
// shared by the dense FFN, the shared experts and every routed expert.
#include "cpu/ops_moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace k3::cpu {
namespace {

void check_router_config(const WeightMatrix& gate, const RouterConfig& cfg) {
  const int E = cfg.num_experts;
  K3_CHECK(E > 0, "router: num_experts must be positive, got ", E);
  K3_CHECK(gate.rows == E, "router: gate ", gate.name, " has ", gate.rows,
           " rows, expected num_experts=", E);
  K3_CHECK(cfg.top_k >= 1 && cfg.top_k <= E, "router: top_k=", cfg.top_k,
           " must be in [1, num_experts=", E, "]");
  K3_CHECK(cfg.num_expert_group >= 1 && E % cfg.num_expert_group == 0,
           "router: num_expert_group=", cfg.num_expert_group, " must divide num_experts=", E);
  K3_CHECK(cfg.topk_group >= 1 && cfg.topk_group <= cfg.num_expert_group,
           "router: topk_group=", cfg.topk_group,
           " must be in [1, num_expert_group=", cfg.num_expert_group, "]");
  // The kept groups must hold at least top_k experts, or some picks would be masked experts.
  const int group_size = E / cfg.num_expert_group;
  K3_CHECK(cfg.topk_group * group_size >= cfg.top_k, "router: topk_group=", cfg.topk_group,
           " groups of ", group_size, " experts cannot supply top_k=", cfg.top_k);
}

// Strict total order on candidates (value descending, then index ascending), so the selection
// and its output order are unique even with tied scores.
struct Better {
  const float* v;
  bool operator()(int a, int b) const {
    if (v[a] != v[b]) return v[a] > v[b];
    return a < b;
  }
};

// noaux_tc group limiting, in place on choice[E]: a group's score is the sum of its two best
// choice scores (its best one if the group has a single expert); all experts outside the
// topk_group best groups are set to -inf so they cannot be selected.
void limit_groups(const RouterConfig& cfg, float* choice) {
  const int G = cfg.num_expert_group;
  const int gs = cfg.num_experts / G;
  std::vector<float> group_score(static_cast<size_t>(G));  // [G]
  std::vector<int> members(static_cast<size_t>(gs));       // expert ids of one group, [gs]
  for (int g = 0; g < G; ++g) {
    std::iota(members.begin(), members.end(), g * gs);
    const int top = std::min(2, gs);
    std::partial_sort(members.begin(), members.begin() + top, members.end(), Better{choice});
    float s = 0.0f;
    for (int i = 0; i < top; ++i) s += choice[members[static_cast<size_t>(i)]];
    group_score[static_cast<size_t>(g)] = s;
  }
  std::vector<int> groups(static_cast<size_t>(G));  // group ids, best first after sorting
  std::iota(groups.begin(), groups.end(), 0);
  std::partial_sort(groups.begin(), groups.begin() + cfg.topk_group, groups.end(),
                    Better{group_score.data()});
  std::vector<bool> keep(static_cast<size_t>(G), false);
  for (int i = 0; i < cfg.topk_group; ++i)
    keep[static_cast<size_t>(groups[static_cast<size_t>(i)])] = true;
  for (int e = 0; e < cfg.num_experts; ++e)
    if (!keep[static_cast<size_t>(e / gs)]) choice[e] = -std::numeric_limits<float>::infinity();
}

thread_local RouterMarginProbe* active_probe = nullptr;

}  // namespace

RouterMarginProbe::RouterMarginProbe()
    : previous_(active_probe), min_margin_(std::numeric_limits<float>::infinity()) {
  active_probe = this;
}

RouterMarginProbe::~RouterMarginProbe() {
  active_probe = previous_;
}

void RouterMarginProbe::record(float margin) {
  min_margin_ = std::min(min_margin_, margin);
  ++selections_;
}

void route(const WeightMatrix& gate, const float* bias, const float* x, const RouterConfig& cfg,
           int* idx, float* weights) {
  // gate: [E, hidden] (BF16 in K3), bias: [E] or null, x: [hidden],
  // idx: [top_k] expert ids, weights: [top_k] fp32.
  check_router_config(gate, cfg);
  const int E = cfg.num_experts;
  // The router GEMM and everything after it stay fp32 (spec 3.6): selection is discontinuous,
  // so rounding the logits would change which experts run.
  std::vector<float> scores(static_cast<size_t>(E));  // [E] sigmoid/softmax of the logits
  linear(gate, x, scores.data());
  for (int e = 0; e < E; ++e)
    K3_CHECK(std::isfinite(scores[e]), "router: non-finite logit ", scores[e], " for expert ", e);
  if (cfg.activation == RouterConfig::Activation::Sigmoid) {
    for (float& s : scores) s = sigmoid(s);
  } else {
    softmax(scores.data(), E);
  }

  // The correction bias steers load balance: it enters the choice only, never the weights.
  std::vector<float> choice(scores);  // [E]
  if (bias != nullptr) {
    for (int e = 0; e < E; ++e) {
      K3_CHECK(std::isfinite(bias[e]), "router: non-finite bias ", bias[e], " for expert ", e);
      choice[static_cast<size_t>(e)] += bias[e];
    }
  }
  if (cfg.num_expert_group > 1) limit_groups(cfg, choice.data());

  std::vector<int> order(static_cast<size_t>(E));  // expert ids, best top_k first
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + cfg.top_k, order.end(), Better{choice.data()});

  if (active_probe && cfg.top_k < E) {
    float left_out = -std::numeric_limits<float>::infinity();
    for (int i = cfg.top_k; i < E; ++i)
      left_out = std::max(left_out, choice[static_cast<size_t>(order[static_cast<size_t>(i)])]);
    active_probe->record(choice[static_cast<size_t>(order[static_cast<size_t>(cfg.top_k - 1)])] -
                         left_out);
  }

  float sum = 0.0f;
  for (int i = 0; i < cfg.top_k; ++i) {
    idx[i] = order[static_cast<size_t>(i)];
    weights[i] = scores[static_cast<size_t>(idx[i])];
    sum += weights[i];
  }
  // 1e-20 only guards a zero sum (all selected sigmoids underflowed); it is the DeepSeek value.
  const float norm = cfg.renormalize ? 1.0f / (sum + 1e-20f) : 1.0f;
  for (int i = 0; i < cfg.top_k; ++i) weights[i] = weights[i] * norm * cfg.routed_scaling_factor;
}

void glu_mlp(const WeightMatrix& gate, const WeightMatrix& up, const WeightMatrix& down,
             const GluActivation& act, const Numerics& num, const float* x, float* y) {
  // gate/up: [ffn, in], down: [out, ffn] (any WeightFormat, MXFP4 for routed experts),
  // x: [in], y: [out].
  K3_CHECK(gate.rows == up.rows && gate.cols == up.cols, "glu_mlp: gate ", gate.name, " [",
           gate.rows, ", ", gate.cols, "] and up ", up.name, " [", up.rows, ", ", up.cols,
           "] differ");
  K3_CHECK(down.cols == gate.rows, "glu_mlp: down ", down.name, " has ", down.cols,
           " cols, expected the gate width ", gate.rows);
  const size_t ffn = static_cast<size_t>(gate.rows);
  std::vector<float> g(ffn), u(ffn);  // [ffn] each
  linear(gate, x, g.data());
  linear(up, x, u.data());
  // g and u are not rounded: the GPU applies the activation in the fp32 epilogue of the fused
  // gate/up GEMM. Its output h is the bf16 input of the down GEMM, hence the rounding here.
  for (size_t i = 0; i < ffn; ++i) g[i] = act(g[i], u[i]);
  num.round(g.data(), ffn);
  linear(down, g.data(), y);
}

}  // namespace k3::cpu
