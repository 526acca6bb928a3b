// Launch configuration for cudaLaunchKernelEx with an optional 1-D thread-block cluster (the
// row kernels and the split-K GEMM spread one row / one K range over a cluster of CTAs).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace k3::cuda::detail {

// Owns the attribute that config.attrs points to, so it is neither copyable nor movable.
class ClusterLaunch {
 public:
  // cluster_x == 0: a plain launch with no cluster attribute (1 is an explicit 1-CTA cluster).
  ClusterLaunch(dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream, unsigned cluster_x) {
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    if (cluster_x > 0) {
      attr_.id = cudaLaunchAttributeClusterDimension;
      attr_.val.clusterDim.x = cluster_x;
      attr_.val.clusterDim.y = 1;
      attr_.val.clusterDim.z = 1;
      config.attrs = &attr_;
      config.numAttrs = 1;
    }
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;

  cudaLaunchConfig_t config{};

 private:
  cudaLaunchAttribute attr_{};
};

}  // namespace k3::cuda::detail
