#include "cuda/graph_pdl.h"

#include <algorithm>
#include <vector>

#include "cuda/check.h"

namespace k3::cuda {
namespace {

thread_local std::set<cudaGraphNode_t>* foreign_sink = nullptr;

std::vector<cudaGraphNode_t> sorted_nodes(cudaGraph_t graph) {
  size_t n = 0;
  K3_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> v(n);
  if (n > 0) K3_CUDA_CHECK(cudaGraphGetNodes(graph, v.data(), &n));
  v.resize(n);
  std::sort(v.begin(), v.end());
  return v;
}

bool is_kernel(cudaGraphNode_t n) {
  cudaGraphNodeType t{};
  K3_CUDA_CHECK(cudaGraphNodeGetType(n, &t));
  return t == cudaGraphNodeTypeKernel;
}

}  // namespace

int make_kernel_edges_programmatic(cudaGraph_t graph, const std::set<cudaGraphNode_t>& foreign) {
  size_t n = 0;
  K3_CUDA_CHECK(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &n));
  if (n == 0) return 0;
  std::vector<cudaGraphNode_t> from(n), to(n);
  std::vector<cudaGraphEdgeData> data(n);
  K3_CUDA_CHECK(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &n));
  std::vector<cudaGraphNode_t> cf, ct;
  std::vector<cudaGraphEdgeData> old_data, new_data;
  for (size_t i = 0; i < n; ++i) {
    if (data[i].type != cudaGraphDependencyTypeDefault || !is_kernel(from[i]) ||
        !is_kernel(to[i]) || foreign.count(from[i]) || foreign.count(to[i]))
      continue;
    cf.push_back(from[i]);
    ct.push_back(to[i]);
    old_data.push_back(data[i]);
    cudaGraphEdgeData e{};
    e.from_port = cudaGraphKernelNodePortProgrammatic;
    e.to_port = 0;
    e.type = cudaGraphDependencyTypeProgrammatic;
    new_data.push_back(e);
  }
  if (cf.empty()) return 0;
  K3_CUDA_CHECK(
      cudaGraphRemoveDependencies(graph, cf.data(), ct.data(), old_data.data(), cf.size()));
  K3_CUDA_CHECK(cudaGraphAddDependencies(graph, cf.data(), ct.data(), new_data.data(), cf.size()));
  return static_cast<int>(cf.size());
}

void record_foreign_nodes(cudaStream_t stream, std::set<cudaGraphNode_t>& foreign,
                          const std::function<void()>& enqueue) {
  cudaStreamCaptureStatus status{};
  cudaGraph_t graph = nullptr;
  K3_CUDA_CHECK(
      cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, nullptr, nullptr, nullptr));
  if (status != cudaStreamCaptureStatusActive) {
    enqueue();
    return;
  }
  const std::vector<cudaGraphNode_t> before = sorted_nodes(graph);
  enqueue();
  for (cudaGraphNode_t node : sorted_nodes(graph))
    if (!std::binary_search(before.begin(), before.end(), node)) foreign.insert(node);
}

ForeignNodeScope::ForeignNodeScope(std::set<cudaGraphNode_t>& sink) : previous_(foreign_sink) {
  foreign_sink = &sink;
}

ForeignNodeScope::~ForeignNodeScope() {
  foreign_sink = previous_;
}

void enqueue_foreign(cudaStream_t stream, const std::function<void()>& enqueue) {
  if (foreign_sink)
    record_foreign_nodes(stream, *foreign_sink, enqueue);
  else
    enqueue();
}

}  // namespace k3::cuda
