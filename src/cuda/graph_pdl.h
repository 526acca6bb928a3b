// Programmatic dependent launch for captured graphs: turns each kernel -> kernel edge of a graph
// into a programmatic edge, so the downstream kernel is scheduled while the upstream one drains
// and runs up to its pdl_wait() (weight prologues, launch latency) in the upstream's tail.
// Safe only when every kernel in the graph starts with K3_PDL_ENTRY or calls pdl_wait()
// before reading anything an earlier node wrote (pdl.cuh); every kernel in src/cuda does.
#pragma once

#include <cuda_runtime.h>

#include <set>

namespace k3::cuda {

// Returns the number of edges converted. Edges touching non-kernel nodes (copies, memsets,
// event records) or a node of `foreign` (kernels that do not wait for their producers, such as
// NCCL's collectives) stay full dependencies.
int make_kernel_edges_programmatic(cudaGraph_t graph,
                                   const std::set<cudaGraphNode_t>& foreign = {});

}  // namespace k3::cuda
