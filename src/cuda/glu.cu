// GLU activation: a flat grid of threads, each owning 8 consecutive elements of one row
// (16-byte loads and stores when aligned).
#include "cuda/glu.h"

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/glu_math.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

using detail::aligned16;

__device__ __forceinline__ void load8(const __nv_bfloat16* p, bool v8, int n, float (&out)[8]) {
  detail::load_bf16x8(p, v8, n, out);
}
__device__ __forceinline__ void load8(const float* p, bool, int n, float (&out)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) out[k] = k < n ? p[k] : 0.0f;
}

template <GluAct::Kind kKind, typename T>
__global__ void __launch_bounds__(256)
    glu_kernel(GluAct act, const T* g, int64_t g_stride, const T* u, int64_t u_stride, int64_t rows,
               int64_t width, __nv_bfloat16* h, int64_t h_stride, bool vec) {
  K3_PDL_ENTRY();
  // g, u: [rows, width] T (bf16 or fp32); h: [rows, width] bf16; with their row strides
  const int64_t per_row = (width + 7) / 8;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= rows * per_row) return;
  const int64_t r = t / per_row, c0 = (t % per_row) * 8;
  const int n_valid = static_cast<int>(min(static_cast<int64_t>(8), width - c0));
  const bool v8 = vec && n_valid == 8;
  float gv[8], uv[8], o[8];
  load8(g + r * g_stride + c0, v8, n_valid, gv);
  load8(u + r * u_stride + c0, v8, n_valid, uv);
  act.kind = kKind;  // a compile-time kind: the branch in glu_apply folds away
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = detail::glu_apply(act, gv[k], uv[k]);
  detail::store_bf16x8(h + r * h_stride + c0, v8, n_valid, o);
}

template <typename T>
void glu_impl(const GluAct& act, const T* g, int64_t g_stride, const T* u, int64_t u_stride,
              int64_t rows, int64_t width, __nv_bfloat16* h, int64_t h_stride,
              cudaStream_t stream) {
  K3_CHECK(rows >= 0 && width > 0, "cuda::glu: rows ", rows, ", width ", width);
  K3_CHECK(g_stride >= width && u_stride >= width && h_stride >= width, "cuda::glu: strides ",
           g_stride, "/", u_stride, "/", h_stride, " below width ", width);
  if (act.kind == GluAct::Kind::SiTU) {
    K3_CHECK(act.beta > 0.0f, "SiTU: beta must be positive, got ", act.beta);
    K3_CHECK(!act.has_linear_beta || act.linear_beta > 0.0f,
             "SiTU: linear_beta must be positive, got ", act.linear_beta);
  }
  const int64_t threads_total = rows * ((width + 7) / 8);
  if (threads_total == 0) return;
  const bool vec = g_stride % 8 == 0 && u_stride % 8 == 0 && h_stride % 8 == 0 && aligned16(g) &&
                   aligned16(u) && aligned16(h);
  const int threads = 256;
  const int64_t blocks = (threads_total + threads - 1) / threads;
  K3_CHECK(blocks <= 0x7fffffff, "cuda::glu: too large: ", rows, " x ", width);
  if (act.kind == GluAct::Kind::SiLU)
    glu_kernel<GluAct::Kind::SiLU, T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        act, g, g_stride, u, u_stride, rows, width, h, h_stride, vec);
  else
    glu_kernel<GluAct::Kind::SiTU, T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        act, g, g_stride, u, u_stride, rows, width, h, h_stride, vec);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace

void glu(const GluAct& act, const __nv_bfloat16* g, int64_t g_stride, const __nv_bfloat16* u,
         int64_t u_stride, int64_t rows, int64_t width, __nv_bfloat16* h, int64_t h_stride,
         cudaStream_t stream) {
  glu_impl(act, g, g_stride, u, u_stride, rows, width, h, h_stride, stream);
}

void glu(const GluAct& act, const float* g, int64_t g_stride, const float* u, int64_t u_stride,
         int64_t rows, int64_t width, __nv_bfloat16* h, int64_t h_stride, cudaStream_t stream) {
  glu_impl(act, g, g_stride, u, u_stride, rows, width, h, h_stride, stream);
}

}  // namespace k3::cuda
