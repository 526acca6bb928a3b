// Where the CPU reference rounds to bf16. The stock GPU path keeps every boundary tensor
// (GEMM outputs, norm outputs, the residual stream, the AttnRes bank) in bf16; the reference
// rounds at exactly those points so both compute the same function. Internals (reductions,
// softmax, the KDA recurrence, the router) stay fp32. With bf16_activations = false the
// reference is pure fp32 (used against fp32 external references).
#pragma once

#include <span>

#include "core/numeric.h"

namespace k3::cpu {

struct Numerics {
  bool bf16_activations = true;

  void round(std::span<float> v) const {
    if (bf16_activations) round_bf16(v);
  }
  void round(float* v, size_t n) const { round(std::span<float>(v, n)); }
  float round(float x) const { return bf16_activations ? round_bf16(x) : x; }
};

}  // namespace k3::cpu
