#include "cuda/cublas_linear.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/graph_pdl.h"
#include "cuda/pdl.cuh"
#include "cuda/skinny_gemm.cuh"

namespace k3::cuda::detail {
namespace {

// Per stream: GEMMs on two streams may run at once (the step's side stream), so they must not
// share split-K scratch. 8 MiB holds the fp32 partials of 64 rows x 7168 x 4 splits.
constexpr size_t kWorkspaceBytes = 8u << 20;

// A device's handle and its streams' workspaces; calls hold `mu` (a handle must not be used by
// two threads at once). Workspaces are never freed: a captured graph keeps their addresses.
struct DeviceCublas {
  cublasHandle_t handle = nullptr;
  std::map<cudaStream_t, void*> workspace;  // null: none could be allocated
  std::mutex mu;
};

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  K3_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
  return cap != cudaStreamCaptureStatusNone;
}

// The current device's handle, created on first use, which must come outside a graph capture
// (the tuner's eager launches); null where cuBLAS cannot be set up (the tuner then skips the
// plan). Kept for the process.
DeviceCublas* device_cublas(cudaStream_t stream) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<DeviceCublas>> handles;  // null entry: setup failed
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(dev);
  if (it != handles.end()) return it->second.get();
  K3_CHECK(!capturing(stream), "cuBLAS plan: first used inside a graph capture on device ", dev,
           " (its handle is created by an eager launch)");
  auto fresh = std::make_unique<DeviceCublas>();
  cublasStatus_t st = cublasCreate(&fresh->handle);
  // Split-K partials are summed in fp32, not in the bf16 output type (cuBLAS's default for a
  // bf16 y): that reduction missed the oracle's tolerance by 3+ ulps at 17-64 rows (H100).
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasSetMathMode(
        fresh->handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                                 CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  if (st != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cuBLAS plans off on device %d: %s\n", dev, cublasGetStatusString(st));
    if (fresh->handle) (void)cublasDestroy(fresh->handle);
    fresh.reset();
  }
  return (handles[dev] = std::move(fresh)).get();
}

// The stream's workspace (caller holds cb.mu), allocated by its first eager launch. A stream
// first seen inside a capture, or where the allocation failed, runs without one (cuBLAS then
// picks an algorithm that needs none; the same one eagerly and in the graph).
void* stream_workspace(DeviceCublas& cb, cudaStream_t stream) {
  auto it = cb.workspace.find(stream);
  if (it != cb.workspace.end()) return it->second;
  if (capturing(stream)) return nullptr;
  void* ws = nullptr;
  if (cudaMalloc(&ws, kWorkspaceBytes) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the failed allocation
    ws = nullptr;
  }
  cb.workspace.emplace(stream, ws);
  return ws;
}

// The folded epilogue after the cuBLAS GEMM wrote bf16(acc) into y: store_output on that value
// rounds exactly as the separate add launches (and as the kernels' own stores) do.
__global__ void cublas_epilogue_kernel(const __grid_constant__ SkinnyArgs a) {
  K3_PDL_ENTRY();
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(a.y);  // [m, ldy] bf16
  const int64_t total = static_cast<int64_t>(a.m) * a.n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = i / a.n * a.ldy + i % a.n;
    store_output(a, o, __bfloat162float(y[o]));
  }
}

}  // namespace

cudaError_t launch_cublas_linear(const LinearPlan& p, const SkinnyArgs& a, cudaStream_t stream) {
  K3_CHECK(
      p.cublas && p.weight == LinearWeight::BF16 && p.groups == 1 && !a.slot_expert && !a.x_glu &&
          (!a.y_fp32 || (!a.add && !a.res)) && a.m >= 1 && a.m <= p.m && a.n == p.n && a.k == p.k &&
          a.ldx <= 0x7fffffff && a.ldy <= 0x7fffffff,
      "cuBLAS plan: a dense bf16 launch without GLU input (an epilogue with bf16 y) only (plan ",
      p.str(), ", m ", a.m, ")");
  DeviceCublas* cb = device_cublas(stream);
  if (!cb) return cudaErrorNotSupported;
  std::lock_guard<std::mutex> lock(cb->mu);
  // cublasSetStream resets the workspace to cuBLAS's own pool: the stream's own after it.
  cublasStatus_t st = cublasSetStream(cb->handle, stream);
  void* ws = stream_workspace(*cb, stream);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasSetWorkspace(cb->handle, ws, ws ? kWorkspaceBytes : 0);
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view of y[M, N] = x[M, K] . W[N, K]^T: y^T[N, M] (ld ldy) = op_T(W^T[K, N],
  // ld K) . x^T[K, M] (ld ldx).
  if (st == CUBLAS_STATUS_SUCCESS)
    enqueue_foreign(stream, [&] {
      st = cublasGemmEx(cb->handle, CUBLAS_OP_T, CUBLAS_OP_N, a.n, a.m, a.k, &alpha, a.w,
                        CUDA_R_16BF, a.k, a.x, CUDA_R_16BF, static_cast<int>(a.ldx), &beta, a.y,
                        a.y_fp32 ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(a.ldy),
                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    });
  if (st != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cuBLAS plan %dx%dx%d: %s\n", a.m, a.n, a.k, cublasGetStatusString(st));
    return cudaErrorNotSupported;
  }
  if (!a.add && !a.res) return cudaGetLastError();
  const int64_t total = static_cast<int64_t>(a.m) * a.n;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 1024));
  cublas_epilogue_kernel<<<blocks, 256, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace k3::cuda::detail
