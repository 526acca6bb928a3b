// Elementary CPU reference ops: plain fp32 loops, no rounding (callers round, see numerics.h).
#pragma once

#include <cstdint>
#include <optional>

#include "model/weight_matrix.h"

namespace k3::cpu {

// y[w.rows] = W · x[w.cols], fp32 accumulation.
void linear(const WeightMatrix& w, const float* x, float* y);
// Rows [row_begin, row_begin + row_count) of W times x: y[row_count].
void linear_rows(const WeightMatrix& w, int64_t row_begin, int64_t row_count, const float* x,
                 float* y);
// y = x / sqrt(mean(x^2) + eps) * w  (w may be null: no scale). y may alias x.
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y);
// y = (x - mean) / sqrt(var + eps) * w + b  (biased variance). y may alias x.
void layer_norm(const float* x, const float* w, const float* b, int64_t n, float eps, float* y);
// x /= sqrt(sum(x^2) + eps), in place (FLA l2norm).
void l2_normalize(float* x, int64_t n, float eps);
// In-place numerically stable softmax over n entries.
void softmax(float* x, int64_t n);

float sigmoid(float x);
float silu(float x);
float softplus(float x);  // log(1 + e^x), linear above 20 as in PyTorch

// The gated activation of every MLP: act(g) * lin(u).
//   SiLU:  silu(g) * u
//   SiTU:  [beta tanh(g/beta) sigmoid(g)] * [linear_beta tanh(u/linear_beta)]  (u unchanged if
//   unset)
struct GluActivation {
  enum class Kind { SiLU, SiTU } kind = Kind::SiLU;
  float beta = 4.0f;
  std::optional<float> linear_beta;
  float operator()(float g, float u) const;
};

}  // namespace k3::cpu
