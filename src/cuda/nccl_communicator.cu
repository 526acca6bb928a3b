// NcclCommunicator: thin, checked wrappers over NCCL's stream-ordered collectives. Nothing here
// allocates or waits on the host after construction, so the calls can be captured in graphs.
#include "cuda/nccl_communicator.h"

#include <cstdlib>
#include <string>

#include "cuda/check.h"

namespace k3::cuda {

namespace {

ncclDataType_t nccl_type(DevType t) {
  switch (t) {
    case DevType::F32:
      return ncclFloat32;
    case DevType::BF16:
      return ncclBfloat16;
    case DevType::I32:
      return ncclInt32;
    case DevType::I64:
      return ncclInt64;
  }
  fail("NCCL: unknown element type");
}

size_t checked_count(int64_t n, const char* op) {
  K3_CHECK(n >= 0, op, ": negative element count ", n);
  return static_cast<size_t>(n);
}

int env_local_rank() {
  for (const char* name : {"K3_LOCAL_RANK", "LOCAL_RANK"}) {
    const char* v = std::getenv(name);
    if (!v || !*v) continue;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    K3_CHECK(end && *end == '\0' && x >= 0, name, "='", v, "' is not a valid local rank");
    return static_cast<int>(x);
  }
  return -1;
}

}  // namespace

void disable_nvls_unless_set() {
  (void)::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
}

int select_local_device(int rank, int local_rank) {
  int count = 0;
  K3_CUDA_CHECK(cudaGetDeviceCount(&count));
  K3_CHECK(count > 0, "NCCL: no CUDA device visible");
  if (local_rank < 0) local_rank = env_local_rank();
  if (local_rank < 0) local_rank = rank % count;
  K3_CHECK(local_rank < count, "NCCL: local rank ", local_rank, " but only ", count,
           " CUDA device(s) visible (check K3_LOCAL_RANK / CUDA_VISIBLE_DEVICES)");
  return local_rank;
}

NcclCommunicator::NcclCommunicator(parallel::TcpBootstrap& boot, int local_rank)
    : rank_(boot.rank()), size_(boot.size()) {
  disable_nvls_unless_set();  // before this process's first NCCL call
  ncclUniqueId id{};
  try {
    device_ = select_local_device(rank_, local_rank >= 0 ? local_rank : boot.local_rank());
    K3_CUDA_CHECK(cudaSetDevice(device_));
    if (rank_ == 0) K3_NCCL_CHECK(ncclGetUniqueId(&id));
  } catch (...) {
    boot.abort();  // the other ranks fail in the broadcast instead of waiting for the id
    throw;
  }
  boot.broadcast_bytes(&id, sizeof id, 0);
  K3_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
  barrier_scratch_ = DeviceBuffer<float>(1);
  barrier_scratch_.fill_bytes(0);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int device) : device_(device), comm_(comm) {
  K3_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
  K3_NCCL_CHECK(ncclCommCount(comm_, &size_));
  barrier_scratch_ = DeviceBuffer<float>(1);
  barrier_scratch_.fill_bytes(0);
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::split(int color, int key) const {
  K3_CHECK(color >= 0, "NCCL split: color must be >= 0, got ", color);
  ncclComm_t sub = nullptr;
  K3_NCCL_CHECK(ncclCommSplit(comm_, color, key, &sub, nullptr));
  K3_CHECK(sub != nullptr, "NCCL split: no communicator for color ", color);
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(sub, device_));
}

NcclCommunicator::~NcclCommunicator() {
  // A destructor must not throw; a failing destroy is left unreported.
  if (comm_) (void)ncclCommDestroy(comm_);
}

void NcclCommunicator::all_reduce_sum(void* data, int64_t n, DevType t, cudaStream_t stream) {
  const size_t count = checked_count(n, "all_reduce_sum");
  if (count == 0) return;  // every rank passes the same n, so every rank skips
  K3_NCCL_CHECK(ncclAllReduce(data, data, count, nccl_type(t), ncclSum, comm_, stream));
}

void NcclCommunicator::all_gather(const void* in, int64_t n, DevType t, void* out,
                                  cudaStream_t stream) {
  const size_t count = checked_count(n, "all_gather");
  if (count == 0) return;
  K3_NCCL_CHECK(ncclAllGather(in, out, count, nccl_type(t), comm_, stream));
}

void NcclCommunicator::all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                                    const int64_t* recv_counts, DevType t, cudaStream_t stream) {
  const size_t es = dev_type_size(t);
  const ncclDataType_t type = nccl_type(t);
  for (int p = 0; p < size_; ++p) {
    (void)checked_count(send_counts[p], "all_to_all_v");
    (void)checked_count(recv_counts[p], "all_to_all_v");
  }
  // One group: NCCL matches every send with the peer's recv, so no ordering deadlock. A pair
  // with zero elements is skipped on both sides (the counts agree).
  K3_NCCL_CHECK(ncclGroupStart());
  ncclResult_t first = ncclSuccess;
  size_t send_off = 0, recv_off = 0;  // bytes
  for (int p = 0; p < size_ && first == ncclSuccess; ++p) {
    const size_t sc = static_cast<size_t>(send_counts[p]);
    const size_t rc = static_cast<size_t>(recv_counts[p]);
    if (sc)
      first = ncclSend(static_cast<const uint8_t*>(send) + send_off, sc, type, p, comm_, stream);
    if (rc && first == ncclSuccess)
      first = ncclRecv(static_cast<uint8_t*>(recv) + recv_off, rc, type, p, comm_, stream);
    send_off += sc * es;
    recv_off += rc * es;
  }
  const ncclResult_t end = ncclGroupEnd();  // always close the group, even after an error
  K3_NCCL_CHECK(first);
  K3_NCCL_CHECK(end);
}

void NcclCommunicator::broadcast(void* data, int64_t n, DevType t, int root, cudaStream_t stream) {
  K3_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " outside the group of ", size_);
  const size_t count = checked_count(n, "broadcast");
  if (count == 0) return;
  K3_NCCL_CHECK(ncclBroadcast(data, data, count, nccl_type(t), root, comm_, stream));
}

void NcclCommunicator::reduce_scatter_sum(const void* in, void* out, int64_t n, DevType t,
                                          cudaStream_t stream) {
  const size_t count = checked_count(n, "reduce_scatter_sum");
  if (count == 0) return;
  K3_NCCL_CHECK(ncclReduceScatter(in, out, count, nccl_type(t), ncclSum, comm_, stream));
}

void NcclCommunicator::barrier(cudaStream_t stream) {
  // NCCL has no barrier; a one-element all-reduce completes on no rank before all joined.
  K3_NCCL_CHECK(ncclAllReduce(barrier_scratch_.data(), barrier_scratch_.data(), 1, ncclFloat32,
                              ncclSum, comm_, stream));
}

}  // namespace k3::cuda
