// Collectives between the ranks of one parallel group, shaped so that an NCCL backend can sit
// behind the same interface: typed buffers, sizes in elements given explicitly by every rank, and
// every rank of a group calling the same collectives in the same order (a rank with no work
// still calls them, with zero sizes). InProcessGroup implements it for ranks that are threads of
// one process (the CPU reference and its tests).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace k3::parallel {

enum class CommType : uint8_t { F32, I32, I64 };
size_t comm_type_size(CommType t);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data[n] fp32 replaced by the sum over ranks. Summed in rank order, so every rank gets the
  // same bits and the result does not depend on timing.
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  // in[n] of every rank -> out[size * n], rank r's values at out + r * n.
  virtual void all_gather(const void* in, int64_t n, CommType t, void* out) = 0;
  // send: this rank's payloads packed by destination, send_counts[size] elements each (rank 0's
  // first). recv: packed by source, recv_counts[size] elements each; the counts must agree with
  // what the sources send (exchange_counts gives them).
  virtual void all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                            const int64_t* recv_counts, CommType t) = 0;
  // data[n] of rank `root` copied to every rank.
  virtual void broadcast(void* data, int64_t n, CommType t, int root) = 0;
  virtual void barrier() = 0;

  // Typed conveniences.
  void all_gather(const float* in, int64_t n, float* out) { all_gather(in, n, CommType::F32, out); }
  void all_gather(const int32_t* in, int64_t n, int32_t* out) {
    all_gather(in, n, CommType::I32, out);
  }
  void all_to_all_v(const float* send, const int64_t* sc, float* recv, const int64_t* rc) {
    all_to_all_v(send, sc, recv, rc, CommType::F32);
  }
  void all_to_all_v(const int32_t* send, const int64_t* sc, int32_t* recv, const int64_t* rc) {
    all_to_all_v(send, sc, recv, rc, CommType::I32);
  }
  void broadcast(float* data, int64_t n, int root) { broadcast(data, n, CommType::F32, root); }
};

// recv_counts[size]: what each rank will send to this one, given send_counts[size] (an
// all-gather of the count rows; the first half of an all_to_all_v).
std::vector<int64_t> exchange_counts(Communicator& comm, const std::vector<int64_t>& send_counts);

// N communicators for N threads of this process. Each rank uses only its own communicator, from
// one thread. A rank that fails calls abort(): every rank blocked in (or later entering) a
// collective of this group then throws k3::Error instead of waiting forever.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const;
  Communicator& comm(int rank);
  void abort();

  struct Shared;

 private:
  std::unique_ptr<Shared> shared_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

}  // namespace k3::parallel
