// The skinny decode GEMM's launch arguments (skinny_gemm.cuh, the GEMVs, the fallback and
// cuBLAS launches share them), its phase stamps and its output rounding.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/glu_math.cuh"
#include "cuda/linear_plan.h"

namespace k3::cuda::detail {

struct SkinnyArgs {
  // Dense weight: w [N, K] in the format, ws its scales (MXFP4) or null.
  const void* w = nullptr;
  const uint8_t* ws = nullptr;
  // Grouped (MoE): slot s multiplies rows [slot_offsets[s], slot_offsets[s+1]) by expert
  // slot_expert[s] (< 0: skip), whose matrices are w_table[e] / ws_table[e]; all device arrays.
  const void* const* w_table = nullptr;
  const uint8_t* const* ws_table = nullptr;
  const int32_t* slot_expert = nullptr;   // [groups]
  const int32_t* slot_offsets = nullptr;  // [groups + 1]
  const int32_t* row_index = nullptr;     // [rows]: x row of each gathered row, or null (same)
  int n_slots = 0;                        // groups (the CTAs' y rows take turns over them)
  // Grouped: the slot arrays were complete before the previous kernel began its work (an earlier
  // grouped launch of this grouping, which lets its dependents start only after its own wait),
  // so they are read, and the first weights requested, before waiting on that kernel.
  int slots_ready = 0;
  const __nv_bfloat16* x = nullptr;  // [*, ldx] bf16
  int64_t ldx = 0;
  // Instead of x (tiled kernel only): x = bf16(glu(g, u)) computed while staging, g at
  // x_glu[row * ld_glu + k] and u glu_up elements further (fp32, 16-byte aligned rows).
  const float* x_glu = nullptr;
  int64_t ld_glu = 0, glu_up = 0;
  GluAct glu;
  // Instead of x (bf16 GEMV only, linear_bf16_combined): x row t = the MoE combine (+ latent
  // RMSNorm) of expert outputs, computed as moe_combine computes it (moe_combine.cuh):
  // combine_y [*, k] bf16, combine_pos [m * combine_k] int32 or null, combine_w
  // [m * combine_k] fp32, combine_norm [k] fp32 or null.
  const __nv_bfloat16* combine_y = nullptr;
  const int32_t* combine_pos = nullptr;
  const float* combine_w = nullptr;
  const float* combine_norm = nullptr;
  float combine_eps = 0.0f;
  int combine_k = 0;
  void* y = nullptr;  // [*, ldy] bf16 or fp32
  int64_t ldy = 0;
  int y_fp32 = 0;
  // bf16 y only, both optional (LinearEpilogue): y = bf16(bf16(acc) + add[.]); then
  // res[.] = res_copy ? y : bf16(res[.] + y), in place. add / res: [*, ldy] bf16 like y.
  const __nv_bfloat16* add = nullptr;
  __nv_bfloat16* res = nullptr;
  int res_copy = 0;
  int m = 0, n = 0, k = 0;  // m: token rows (dense) / bound per slot (grouped)
  int wn = 1, wk = 1, ck = 1, stages = 4, chunks = 0, x_pitch = 0, x_bytes = 0;
  // Profiling (dense launches only): [grid_x][kSkinnyStamps] int64 phase stamps, or null.
  long long* stamps = nullptr;
  // The alternative forms (kernels instantiated apart, linear_launch.cuh).
  int x_async = 0;      // x through cp.async where the format allows (skinny_x_async())
  int fast_reduce = 0;  // LinearPlan::fast_reduce (skinny_reduce.cuh)
};

// Stamp `which` of this CTA (SkinnyStamp, linear_plan.h): clock64, or %globaltimer for the two
// global ones. Thread 0 only; the branch is uniform and taken only by profiling launches.
__device__ __forceinline__ void stamp(const SkinnyArgs& a, int which) {
  if (!a.stamps || threadIdx.x != 0) return;
  long long t;
  if (which == kStampGlobalEntry || which == kStampGlobalEnd)
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  else
    t = clock64();
  a.stamps[static_cast<int64_t>(blockIdx.x) * kSkinnyStamps + which] = t;
}

// Output element o of y (and the epilogue's res): the accumulator rounded as the unfused ops
// round it (the GEMM's bf16 output, then each add in fp32 rounded to bf16).
__device__ __forceinline__ void store_output(const SkinnyArgs& a, int64_t o, float v) {
  if (a.y_fp32) {
    static_cast<float*>(a.y)[o] = v;
    return;
  }
  __nv_bfloat16 y = __float2bfloat16_rn(v);
  if (a.add) y = __float2bfloat16_rn(__bfloat162float(y) + __bfloat162float(a.add[o]));
  static_cast<__nv_bfloat16*>(a.y)[o] = y;
  if (a.res)
    a.res[o] =
        a.res_copy ? y : __float2bfloat16_rn(__bfloat162float(a.res[o]) + __bfloat162float(y));
}

}  // namespace k3::cuda::detail
