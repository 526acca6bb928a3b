// TcpCommunicator: element counts become byte counts for the bootstrap's collectives.
#include "parallel/tcp_communicator.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace k3::parallel {

namespace {
size_t checked_bytes(int64_t n, CommType t, const char* op) {
  K3_CHECK(n >= 0, op, ": negative element count ", n);
  return static_cast<size_t>(n) * comm_type_size(t);
}
}  // namespace

void TcpCommunicator::all_reduce_sum(float* data, int64_t n) {
  const size_t bytes = checked_bytes(n, CommType::F32, "all_reduce_sum");
  const int world = size();
  std::vector<float> all(static_cast<size_t>(n) * static_cast<size_t>(world));  // [world, n]
  boot_.all_gather_bytes(data, bytes, all.data());
  // Rank order from rank 0's value, as InProcessGroup: the same bits on every rank.
  std::copy(all.begin(), all.begin() + n, data);
  for (int r = 1; r < world; ++r) {
    const float* src = all.data() + static_cast<size_t>(r) * static_cast<size_t>(n);
    for (int64_t i = 0; i < n; ++i) data[i] += src[i];
  }
}

void TcpCommunicator::all_gather(const void* in, int64_t n, CommType t, void* out) {
  boot_.all_gather_bytes(in, checked_bytes(n, t, "all_gather"), out);
}

void TcpCommunicator::all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                                   const int64_t* recv_counts, CommType t) {
  const size_t world = static_cast<size_t>(size());
  std::vector<size_t> sb(world), rb(world);
  for (size_t r = 0; r < world; ++r) {
    sb[r] = checked_bytes(send_counts[r], t, "all_to_all_v");
    rb[r] = checked_bytes(recv_counts[r], t, "all_to_all_v");
  }
  boot_.all_to_all_v_bytes(send, sb.data(), recv, rb.data());
}

void TcpCommunicator::broadcast(void* data, int64_t n, CommType t, int root) {
  K3_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " outside the group of ", size());
  boot_.broadcast_bytes(data, checked_bytes(n, t, "broadcast"), root);
}

}  // namespace k3::parallel
