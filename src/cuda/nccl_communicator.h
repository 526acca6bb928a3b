// NcclCommunicator: DeviceCommunicator over NCCL, one process per GPU, bootstrapped over TCP
// (parallel/tcp_bootstrap.h): rank 0 creates the ncclUniqueId, the bootstrap broadcasts it,
// every rank calls ncclCommInitRank. Only built when CMake finds NCCL (K3_HAVE_NCCL).
//
// NVLink multicast (NVLS) stays off: before its first NCCL call the constructor sets
// NCCL_NVLS_ENABLE=0 unless the user already set it (NCCL reads its environment once per
// process, so this must happen before any other NCCL use in the process).
//
// Determinism: NCCL gives every rank the same all-reduce result for a given algorithm and
// protocol (ring / tree chunks are reduced identically everywhere), but the summation order is
// not rank order and depends on the algorithm, the chunking and the message size, so results
// differ in the last bits from the CPU reference (parallel::InProcessGroup); tests compare with
// a tolerance. bf16 all-reduces are reduced in bf16 hop by hop (one rounding per partial sum).
// all_gather / all_to_all_v / broadcast move bits and are exact.
#pragma once

#include <nccl.h>

#include <memory>
#include <vector>

#include "core/error.h"
#include "cuda/device_buffer.h"
#include "cuda/device_communicator.h"
#include "cuda/rank_group.h"
#include "parallel/tcp_bootstrap.h"

// Every NCCL call: a failure raises k3::Error with the call, NCCL's error string and its last
// error message (which usually names the cause).
#define K3_NCCL_CHECK(call)                                                                        \
  do {                                                                                             \
    const ncclResult_t k3_nccl_err_ = (call);                                                      \
    if (k3_nccl_err_ != ncclSuccess)                                                               \
      ::k3::fail("NCCL error ", ncclGetErrorString(k3_nccl_err_), " (", ncclGetLastError(nullptr), \
                 ") in ", #call, " at ", __FILE__, ":", __LINE__);                                 \
  } while (0)

namespace k3::cuda {

// Sets NCCL_NVLS_ENABLE=0 unless it is set already.
void disable_nvls_unless_set();

// The GPU of this process: local_rank when >= 0, else K3_LOCAL_RANK / LOCAL_RANK, else
// rank % (visible device count). Fails when it is not a visible device.
int select_local_device(int rank, int local_rank);

class NcclCommunicator final : public DeviceCommunicator {
 public:
  // Collective over every rank of `boot`: selects and sets this process's device
  // (select_local_device(rank, local_rank >= 0 ? local_rank : boot.local_rank())), then builds
  // the NCCL communicator. The bootstrap is only used here.
  explicit NcclCommunicator(parallel::TcpBootstrap& boot, int local_rank = -1);
  // A sub-communicator (ncclCommSplit): ranks passing the same color form one group, ordered
  // by key. Collective over every rank of this communicator.
  std::unique_ptr<NcclCommunicator> split(int color, int key) const;
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }
  ncclComm_t raw() const { return comm_; }

  void all_reduce_sum(void* data, int64_t n, DevType t, cudaStream_t stream) override;
  void all_gather(const void* in, int64_t n, DevType t, void* out, cudaStream_t stream) override;
  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                    const int64_t* recv_counts, DevType t, cudaStream_t stream) override;
  void broadcast(void* data, int64_t n, DevType t, int root, cudaStream_t stream) override;
  void reduce_scatter_sum(const void* in, void* out, int64_t n, DevType t,
                          cudaStream_t stream) override;
  void barrier(cudaStream_t stream) override;
  bool graph_safe() const override { return true; }

  using DeviceCommunicator::all_gather;
  using DeviceCommunicator::all_reduce_sum;

 private:
  NcclCommunicator(ncclComm_t comm, int device);  // adopts a split communicator

  int rank_ = 0, size_ = 1, device_ = 0;
  ncclComm_t comm_ = nullptr;
  DeviceBuffer<float> barrier_scratch_;  // [1] fp32: the barrier's all-reduce operand
};

// The communicators of this process's rank of `layout` (a NcclRankCommsFactory): the world
// over every process of boot, and its replica's tp group split from it.
RankComms make_nccl_rank_comms(parallel::TcpBootstrap& boot,
                               const parallel::ParallelLayout& layout);

}  // namespace k3::cuda
