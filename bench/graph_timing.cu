#include "graph_timing.h"

#include <algorithm>
#include <vector>

#include "cuda/check.h"

namespace k3::bench {

cudaGraphExec_t capture_launches(const Enqueue& enqueue, int first, int count,
                                 cudaStream_t stream) {
  cudaGraph_t g;
  cudaGraphExec_t e;
  K3_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int c = first; c < first + count; ++c) enqueue(c, stream);
  K3_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
  K3_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  K3_CUDA_CHECK(cudaGraphDestroy(g));
  return e;
}

double graph_batched_us(const Enqueue& enqueue, int R, cudaStream_t stream, int replays) {
  enqueue(0, stream);  // eager warm-up: plans, attributes, module load
  K3_CUDA_CHECK(cudaStreamSynchronize(stream));
  const cudaGraphExec_t e = capture_launches(enqueue, 0, R, stream);
  cudaEvent_t a, b;
  K3_CUDA_CHECK(cudaEventCreate(&a));
  K3_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < replays + 3; ++i) {
    K3_CUDA_CHECK(cudaEventRecord(a, stream));
    K3_CUDA_CHECK(cudaGraphLaunch(e, stream));
    K3_CUDA_CHECK(cudaEventRecord(b, stream));
    K3_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    K3_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) t.push_back(1000.0 * ms / R);
  }
  K3_CUDA_CHECK(cudaEventDestroy(a));
  K3_CUDA_CHECK(cudaEventDestroy(b));
  K3_CUDA_CHECK(cudaGraphExecDestroy(e));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace k3::bench
