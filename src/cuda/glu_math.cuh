// The gated activation of one element (cpu::GluActivation in fp32), shared by the GLU kernel and
// the expert GEMM that applies it while staging its input, so both round the same bits.
#pragma once

#include "cuda/device_util.cuh"
#include "cuda/glu.h"

namespace k3::cuda::detail {

__device__ __forceinline__ float glu_apply(const GluAct& act, float g, float u) {
  if (act.kind == GluAct::Kind::SiLU) return g * sigmoid_ref(g) * u;
  const float gate = act.beta * tanhf(g / act.beta) * sigmoid_ref(g);
  const float lin = act.has_linear_beta ? act.linear_beta * tanhf(u / act.linear_beta) : u;
  return gate * lin;
}

}  // namespace k3::cuda::detail
