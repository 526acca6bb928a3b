// The gated activation of every MLP on the GPU, elementwise over bf16 rows:
//   SiLU: h = bf16(silu(g) * u)
//   SiTU: h = bf16([beta tanh(g/beta) sigmoid(g)] * [linear_beta tanh(u/linear_beta)])
//         (u unchanged when linear_beta is unset)
// fp32 math; matches cpu::GluActivation on the same inputs then bf16 rounding.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

struct GluAct {
  enum class Kind { SiLU, SiTU } kind = Kind::SiLU;
  float beta = 4.0f;  // SiTU gate cap, > 0
  bool has_linear_beta = false;
  float linear_beta = 0.0f;  // SiTU up cap, > 0 when set
};

// g: [rows, width] bf16, row stride g_stride; u: [rows, width] bf16, row stride u_stride
// h: [rows, width] bf16, row stride h_stride (may alias g or u with the same stride)
// (all device). One thread per 8 elements; no allocation, no host sync.
void glu(const GluAct& act, const __nv_bfloat16* g, int64_t g_stride, const __nv_bfloat16* u,
         int64_t u_stride, int64_t rows, int64_t width, __nv_bfloat16* h, int64_t h_stride,
         cudaStream_t stream);

// The same on fp32 g and u (the gate / up GEMM outputs kept in fp32, as the CPU reference's
// glu_mlp applies the activation before any rounding); h is bf16. Strides in elements.
void glu(const GluAct& act, const float* g, int64_t g_stride, const float* u, int64_t u_stride,
         int64_t rows, int64_t width, __nv_bfloat16* h, int64_t h_stride, cudaStream_t stream);

}  // namespace k3::cuda
