// Elementary CPU reference ops. Plain fp32 loops written for clarity: these are the oracle the
// CUDA kernels are tested against, so every op validates its sizes and never rounds to bf16.
#include "cpu/ops_basic.h"

#include <cmath>
#include <vector>

#include "core/error.h"

namespace k3::cpu {
namespace {

// Shared by linear / linear_rows: everything that would make row_to_float read out of bounds.
void check_weight(const WeightMatrix& w) {
  K3_CHECK(!w.empty(), "linear: weight ", w.name, " has no data");
  K3_CHECK(w.rows > 0 && w.cols > 0, "linear: weight ", w.name, " has shape [", w.rows, ", ",
           w.cols, "]");
  if (w.format == WeightFormat::MXFP4) {
    K3_CHECK(w.scales != nullptr, "linear: MXFP4 weight ", w.name, " has no scales");
    K3_CHECK(w.cols % 32 == 0, "linear: MXFP4 weight ", w.name, " needs cols % 32 == 0, got ",
             w.cols);
  }
}

}  // namespace

void linear(const WeightMatrix& w, const float* x, float* y) {
  // x: [w.cols] fp32, y: [w.rows] fp32
  linear_rows(w, 0, w.rows, x, y);
}

void linear_rows(const WeightMatrix& w, int64_t row_begin, int64_t row_count, const float* x,
                 float* y) {
  // x: [w.cols] fp32, y: [row_count] fp32
  check_weight(w);
  K3_CHECK(x != nullptr && y != nullptr, "linear: null input/output for ", w.name);
  K3_CHECK(row_begin >= 0 && row_count >= 0 && row_begin + row_count <= w.rows, "linear: rows [",
           row_begin, ", ", row_begin + row_count, ") outside weight ", w.name, " with ", w.rows,
           " rows");
  // One decoded row at a time: works the same for every storage format (MXFP4 included) and
  // keeps the scratch at [cols] floats.
  std::vector<float> row(static_cast<size_t>(w.cols));  // [cols] fp32
  for (int64_t r = 0; r < row_count; ++r) {
    w.row_to_float(row_begin + r, row.data());
    float acc = 0.0f;
    for (int64_t c = 0; c < w.cols; ++c) acc += row[c] * x[c];
    y[r] = acc;
  }
}

void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  // x, y: [n] fp32 (may alias); w: [n] fp32 or null
  K3_CHECK(n > 0, "rms_norm: n = ", n);
  K3_CHECK(x != nullptr && y != nullptr, "rms_norm: null input/output");
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  // The scale is fixed before anything is written, so y == x is safe.
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w ? x[i] * inv * w[i] : x[i] * inv;
}

void layer_norm(const float* x, const float* w, const float* b, int64_t n, float eps, float* y) {
  // x, y: [n] fp32 (may alias); w, b: [n] fp32 or null (1 / 0)
  K3_CHECK(n > 0, "layer_norm: n = ", n);
  K3_CHECK(x != nullptr && y != nullptr, "layer_norm: null input/output");
  // Two passes (mean, then centred squares) rather than E[x^2] - E[x]^2, which cancels badly.
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const float mean = sum / static_cast<float>(n);
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);  // biased variance
  for (int64_t i = 0; i < n; ++i) {
    const float v = (x[i] - mean) * inv;
    y[i] = (w ? v * w[i] : v) + (b ? b[i] : 0.0f);
  }
}

void l2_normalize(float* x, int64_t n, float eps) {
  // x: [n] fp32, in place
  K3_CHECK(n > 0, "l2_normalize: n = ", n);
  K3_CHECK(x != nullptr, "l2_normalize: null input");
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  // FLA l2norm: eps inside the square root.
  const float inv = 1.0f / std::sqrt(ss + eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void softmax(float* x, int64_t n) {
  // x: [n] fp32, in place
  K3_CHECK(n > 0, "softmax: n = ", n);
  K3_CHECK(x != nullptr, "softmax: null input");
  // Subtracting the max keeps every exp in (0, 1] and the sum in [1, n]: no overflow.
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::fmax(m, x[i]);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

float sigmoid(float x) {
  // Only ever exponentiate a non-positive number, so neither branch overflows.
  if (x >= 0.0f) return 1.0f / (1.0f + std::exp(-x));
  const float e = std::exp(x);
  return e / (1.0f + e);
}

float silu(float x) {
  return x * sigmoid(x);
}

float softplus(float x) {
  // PyTorch's default (beta 1, threshold 20): linear above the threshold, where
  // log1p(exp(x)) == x in fp32 anyway and exp would start to lose range.
  if (x > 20.0f) return x;
  return std::log1p(std::exp(x));
}

float GluActivation::operator()(float g, float u) const {
  switch (kind) {
    case Kind::SiLU:
      return silu(g) * u;
    case Kind::SiTU: {
      K3_CHECK(beta > 0.0f, "SiTU: beta must be positive, got ", beta);
      // A SiLU-shaped gate whose magnitude is soft-capped at beta (spec 3.7).
      const float gate = beta * std::tanh(g / beta) * sigmoid(g);
      if (!linear_beta) return gate * u;
      const float lb = *linear_beta;
      K3_CHECK(lb > 0.0f, "SiTU: linear_beta must be positive, got ", lb);
      return gate * (lb * std::tanh(u / lb));
    }
  }
  fail("internal: bad GluActivation kind");
}

}  // namespace k3::cpu
