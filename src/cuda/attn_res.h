// Attention Residuals mixing on the GPU (spec 3.4), per row r:
//   s_j = <v_j * rsqrt(mean(v_j^2) + eps), w>,  p = softmax(s),  out = bf16(sum_j p_j v_j)
// over n_sources <= 16 bf16 vectors, fp32 math. Matches cpu::attn_res_mix on the same
// (bf16-valued) sources followed by bf16 rounding; one source gives out = v_0 exactly.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

struct AttnResSources {
  static constexpr int kMax = 16;
  // Source j: [rows, hidden] bf16 (device), row stride `row_stride` elements (shared by all).
  const __nv_bfloat16* src[kMax] = {};
};

// sources: n_sources device pointers, each [rows, hidden] bf16 with row stride row_stride
// score_w: [hidden] fp32 (device): norm.weight * proj.weight
// out: [rows, hidden] bf16, row stride out_stride (device); may alias a source with the same
//      row stride (every element is read before it is written, by the same thread)
// probs: [rows, n_sources] fp32 (device) or null
// A cluster of up to 8 CTAs per row splits hidden; the per-source sums meet through
// distributed shared memory in a fixed order (deterministic). No allocation, no host sync.
void attn_res_mix(const AttnResSources& sources, int n_sources, int64_t row_stride,
                  const float* score_w, int64_t rows, int64_t hidden, float eps, __nv_bfloat16* out,
                  int64_t out_stride, float* probs, cudaStream_t stream);

// The same over a contiguous bank: source j row r at bank + j * source_stride + r * row_stride.
// bank: [n_sources][rows][hidden] bf16 (device; source_stride >= rows * row_stride)
void attn_res_mix(const __nv_bfloat16* bank, int n_sources, int64_t source_stride,
                  int64_t row_stride, const float* score_w, int64_t rows, int64_t hidden, float eps,
                  __nv_bfloat16* out, int64_t out_stride, float* probs, cudaStream_t stream);

namespace detail {

// The cluster shape both AttnRes kernels use (attn_res_mix and attn_res_mix_norm; the bits of
// their sums depend on it): `cluster` CTAs of `threads` threads per row, one 8-element vector
// per thread. Fails for hidden above 32768.
struct AttnResShape {
  int cluster = 1;
  int threads = 32;
};
AttnResShape attn_res_shape(int64_t hidden);

// Checks n_sources (1..kMax) and every source pointer (errors name `op`); true when all the
// sources are 16-byte aligned.
bool attn_res_sources_aligned(const AttnResSources& s, int n_sources, const char* op);
// The sources of a contiguous bank (see attn_res_mix), checked likewise.
AttnResSources attn_res_bank(const __nv_bfloat16* bank, int n_sources, int64_t source_stride,
                             int64_t rows, int64_t row_stride, const char* op);

}  // namespace detail

}  // namespace k3::cuda
