// The skinny decode GEMM with a bf16 weight: y[M, N] = x[M, K] . W[N, K]^T, bf16 x, fp32
// accumulation, bf16 or fp32 y. Memory-bound on W for M <= 64 (bytes N*K*2 + M*K*2 + M*N*{2,4});
// tiling and plans in linear_plan.h. Deterministic: the same inputs give the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/linear_plan.h"

namespace k3::cuda {

// x: [M, K] bf16, row stride ldx elements (device)
// w: [N, K] bf16, row-major as in the checkpoint (device)
// y: [M, N] bf16 (y_fp32 false) or fp32 (true), row stride ldy elements (device); must not
//    overlap x or w
// Any M >= 1 (blocks of 64 rows per launch), any N and K. The tiled kernel needs K % 8 == 0,
// ldx % 8 == 0 and 16-byte aligned x and w; anything else takes a slow generic kernel.
// No allocation, no host sync: capturable in a CUDA graph once a first call (or
// plan_linear_bf16) has set the kernel attributes up.
void linear_bf16(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int64_t M, int64_t N,
                 int64_t K, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream);

// Residual adds folded into the GEMM's store (bf16 y only), rounding as the separate adds do:
//   y = bf16(bf16(x . W^T) + add)          when add (else the GEMM's output)
//   res = res_copy ? y : bf16(res + y)     when res (updated in place)
// add, res: [M, N] with y's row stride ldy (device); neither may overlap y, x or w.
struct LinearEpilogue {
  const __nv_bfloat16* add = nullptr;
  __nv_bfloat16* res = nullptr;
  bool res_copy = false;
  bool empty() const { return !add && !res; }
};
void linear_bf16(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int64_t M, int64_t N,
                 int64_t K, __nv_bfloat16* y, int64_t ldy, const LinearEpilogue& epi,
                 cudaStream_t stream);

// The input of a bf16 linear as the MoE combine (+ latent RMSNorm) of expert outputs, with
// moe_combine's arguments and bits (step_ops.h): x row t = bf16(rms_norm(sum_j weights[t, j] *
// y[y_pos[t * top_k + j]])). y: [*, K] bf16; y_pos: [M * top_k] int32 or null (row
// t * top_k + j); weights: [M, top_k] fp32; norm_w: [K] fp32 or null.
struct CombinedInput {
  const __nv_bfloat16* y = nullptr;
  const int32_t* y_pos = nullptr;
  const float* weights = nullptr;
  int top_k = 0;
  const float* norm_w = nullptr;
  float eps = 0.0f;
};
// y = combine(c) . W^T with the epilogue, as moe_combine into x followed by linear_bf16 on x,
// in one launch: where the shape's plan (the plan of linear_bf16 on x, tuned on x if it was
// not yet) is the GEMV and c fits it, launches that and returns true; else launches nothing and
// returns false (the caller runs the two). The same bits either way. x: [M, K] bf16, the
// unfused path's input buffer (read only for tuning).
bool linear_bf16_combined(const CombinedInput& c, const __nv_bfloat16* x, const __nv_bfloat16* w,
                          int64_t M, int64_t N, int64_t K, __nv_bfloat16* y, int64_t ldy,
                          const LinearEpilogue& epi, cudaStream_t stream);
// One such launch under an explicit GEMV plan (p.gemv(), p.m >= M; tests), bf16 y, no epilogue.
void linear_bf16_combined(const LinearPlan& p, const CombinedInput& c, const __nv_bfloat16* w,
                          int64_t M, __nv_bfloat16* y, int64_t ldy, cudaStream_t stream);

// The plan linear_bf16 uses for one launch of m <= 64 rows (cached).
LinearPlan plan_linear_bf16(int m, int64_t n, int64_t k);
// Every tiled plan, best model estimate first (bench and tests).
std::vector<LinearPlan> linear_bf16_candidates(int m, int64_t n, int64_t k);
// One launch under an explicit plan (p.m >= M, p.n == N, p.k == K; M <= 64); p.fallback
// forces the generic kernel.
// stamps: null, or the kernel's phase stamps as linear_mxfp4's (profiling, a tiled plan).
void linear_bf16(const LinearPlan& p, const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w,
                 int64_t M, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream,
                 long long* stamps = nullptr);

}  // namespace k3::cuda
