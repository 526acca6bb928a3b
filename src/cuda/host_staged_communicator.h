// HostStagedCommunicator: the DeviceCommunicator collectives staged through the host over a
// parallel::Communicator (InProcessGroup: ranks as threads of one process, which may share one
// GPU; TcpCommunicator: processes without NCCL). Each collective waits for its stream, copies
// the operand to the host, runs the host collective and copies the result back, so it is not
// graph-safe: a backbone using it runs its steps eagerly. NCCL refuses two ranks on one GPU, so
// this is how the multi-rank GPU step is tested on a single GPU.
//
// Sums are the host communicator's (rank order: every rank gets the same bits); bf16 operands
// travel and are summed as fp32 and rounded once at the end. Moves are exact.
#pragma once

#include "cuda/device_communicator.h"
#include "parallel/communicator.h"

namespace k3::cuda {

class HostStagedCommunicator final : public DeviceCommunicator {
 public:
  // host must outlive this communicator and be used by this rank only.
  explicit HostStagedCommunicator(parallel::Communicator& host) : host_(host) {}

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }

  void all_reduce_sum(void* data, int64_t n, DevType t, cudaStream_t stream) override;
  void all_gather(const void* in, int64_t n, DevType t, void* out, cudaStream_t stream) override;
  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                    const int64_t* recv_counts, DevType t, cudaStream_t stream) override;
  void broadcast(void* data, int64_t n, DevType t, int root, cudaStream_t stream) override;
  void reduce_scatter_sum(const void* in, void* out, int64_t n, DevType t,
                          cudaStream_t stream) override;
  void barrier(cudaStream_t stream) override;
  bool graph_safe() const override { return false; }

  using DeviceCommunicator::all_gather;
  using DeviceCommunicator::all_reduce_sum;

 private:
  parallel::Communicator& host_;
};

}  // namespace k3::cuda
