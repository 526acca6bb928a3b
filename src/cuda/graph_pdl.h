// Programmatic dependent launch for captured graphs: turns each kernel -> kernel edge of a graph
// into a programmatic edge, so the downstream kernel is scheduled while the upstream one drains
// and runs up to its pdl_wait() (weight prologues, launch latency) in the upstream's tail.
// Safe only when every kernel in the graph starts with K3_PDL_ENTRY or calls pdl_wait()
// before reading anything an earlier node wrote (pdl.cuh); every kernel in src/cuda does.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <set>

namespace k3::cuda {

// Returns the number of edges converted. Edges touching non-kernel nodes (copies, memsets,
// event records) or a node of `foreign` (kernels that do not wait for their producers, such as
// NCCL's collectives) stay full dependencies.
int make_kernel_edges_programmatic(cudaGraph_t graph,
                                   const std::set<cudaGraphNode_t>& foreign = {});

// Runs `enqueue` on `stream`; when the stream is capturing, adds every node the capture gains
// meanwhile to `foreign` (the caller's work enqueued by code that does not wait for producers).
void record_foreign_nodes(cudaStream_t stream, std::set<cudaGraphNode_t>& foreign,
                          const std::function<void()>& enqueue);

// Where foreign work enqueued deep inside an op (a cuBLAS GEMM picked by the linear tuner) goes:
// while a scope is alive on this thread, enqueue_foreign records the nodes into its set; without
// one it just runs (a capture nobody makes programmatic needs no record). The step's captures
// that get programmatic edges hold one.
class ForeignNodeScope {
 public:
  explicit ForeignNodeScope(std::set<cudaGraphNode_t>& sink);
  ~ForeignNodeScope();
  ForeignNodeScope(const ForeignNodeScope&) = delete;
  ForeignNodeScope& operator=(const ForeignNodeScope&) = delete;

 private:
  std::set<cudaGraphNode_t>* previous_;
};
void enqueue_foreign(cudaStream_t stream, const std::function<void()>& enqueue);

}  // namespace k3::cuda
