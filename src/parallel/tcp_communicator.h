// The Communicator interface (parallel/communicator.h) over a TcpBootstrap: host buffers, one
// process per rank, so multi-process CPU runs of the reference work (and CI can test them).
// all_reduce_sum gathers every rank's input and sums it in rank order on every rank, exactly
// like InProcessGroup, so both give the same bits.
#pragma once

#include "parallel/communicator.h"
#include "parallel/tcp_bootstrap.h"

namespace k3::parallel {

class TcpCommunicator final : public Communicator {
 public:
  // The bootstrap must outlive this communicator.
  explicit TcpCommunicator(TcpBootstrap& boot) : boot_(boot) {}

  int rank() const override { return boot_.rank(); }
  int size() const override { return boot_.size(); }

  void all_reduce_sum(float* data, int64_t n) override;
  void all_gather(const void* in, int64_t n, CommType t, void* out) override;
  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                    const int64_t* recv_counts, CommType t) override;
  void broadcast(void* data, int64_t n, CommType t, int root) override;
  void barrier() override { boot_.barrier(); }

  using Communicator::all_gather;
  using Communicator::all_to_all_v;
  using Communicator::broadcast;

 private:
  TcpBootstrap& boot_;
};

}  // namespace k3::parallel
