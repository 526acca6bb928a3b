// MoE reference ops (spec 3.6): router and the gated MLP used by dense FFN, shared and routed
// experts.
#pragma once

#include <cstdint>

#include "cpu/numerics.h"
#include "cpu/ops_basic.h"
#include "model/weight_matrix.h"

namespace k3::cpu {

struct RouterConfig {
  int num_experts = 0;
  int top_k = 0;
  int num_expert_group = 1;  // group-limited selection (noaux_tc); a no-op with 1 group
  int topk_group = 1;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
  enum class Activation { Sigmoid, Softmax } activation = Activation::Sigmoid;
};

// logits = gate · x in fp32; s = sigmoid(logits) (or softmax);
// selection: top_k of (s + bias) (bias may be null), group-limited when num_expert_group > 1
// (group score = sum of the top 2 of s + bias in the group; keep topk_group groups);
// weights: s[idx] / (sum s[idx] + 1e-20) if renormalize, times routed_scaling_factor.
// idx/weights: [top_k], ordered by descending selection score (ties: lower expert id first).
void route(const WeightMatrix& gate, const float* bias, const float* x, const RouterConfig& cfg,
           int* idx, float* weights);

// Test instrumentation: while a probe lives on this thread, route() records its selection
// margins (the top_k-th choice score minus the best one left out). Two correct implementations
// whose router inputs differ by bf16 rounding may pick different experts where a margin is
// within that noise; tests that compare them use the probe to avoid such inputs.
class RouterMarginProbe {
 public:
  RouterMarginProbe();
  ~RouterMarginProbe();
  RouterMarginProbe(const RouterMarginProbe&) = delete;
  RouterMarginProbe& operator=(const RouterMarginProbe&) = delete;
  float min_margin() const { return min_margin_; }  // +inf before any selection
  int selections() const { return selections_; }
  void record(float margin);

 private:
  RouterMarginProbe* previous_;
  float min_margin_;
  int selections_ = 0;
};

// y[down.rows] = down · act(gate · x, up · x). The activation output is rounded per `num`
// (it is a bf16 GEMM input on the GPU); y is not rounded (the caller decides).
void glu_mlp(const WeightMatrix& gate, const WeightMatrix& up, const WeightMatrix& down,
             const GluActivation& act, const Numerics& num, const float* x, float* y);

}  // namespace k3::cpu
