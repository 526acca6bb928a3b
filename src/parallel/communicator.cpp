// InProcessGroup: every collective is publish (each rank posts its buffer pointers), barrier,
// read (each rank reads what it needs from the others' buffers), barrier (no rank may reuse a
// buffer while another still reads it). Reductions run in rank order on every rank, so all
// ranks compute the same bits.
#include "parallel/communicator.h"

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>

#include "core/error.h"

namespace k3::parallel {

size_t comm_type_size(CommType t) {
  switch (t) {
    case CommType::F32:
      return 4;
    case CommType::I32:
      return 4;
    case CommType::I64:
      return 8;
  }
  return 0;
}

std::vector<int64_t> exchange_counts(Communicator& comm, const std::vector<int64_t>& send_counts) {
  const int n = comm.size();
  K3_CHECK(static_cast<int>(send_counts.size()) == n, "exchange_counts: ", send_counts.size(),
           " counts for a group of ", n);
  std::vector<int64_t> all(static_cast<size_t>(n) * static_cast<size_t>(n));  // [src][dst]
  comm.all_gather(send_counts.data(), n, CommType::I64, all.data());
  std::vector<int64_t> recv(static_cast<size_t>(n));
  for (int s = 0; s < n; ++s)
    recv[static_cast<size_t>(s)] = all[static_cast<size_t>(s * n + comm.rank())];
  return recv;
}

namespace {

enum class Op : uint8_t { AllReduce, AllGather, AllToAll, Broadcast, Barrier };

const char* op_name(Op op) {
  switch (op) {
    case Op::AllReduce:
      return "all_reduce_sum";
    case Op::AllGather:
      return "all_gather";
    case Op::AllToAll:
      return "all_to_all_v";
    case Op::Broadcast:
      return "broadcast";
    case Op::Barrier:
      return "barrier";
  }
  return "?";
}

// What one rank posts for the collective in progress.
struct Slot {
  Op op = Op::Barrier;
  CommType type = CommType::F32;
  const void* in = nullptr;
  const int64_t* counts = nullptr;  // all_to_all_v send counts [size]
  int64_t n = 0;
  int root = 0;
};

}  // namespace

struct InProcessGroup::Shared {
  explicit Shared(int n) : size(n), slots(static_cast<size_t>(n)) {}
  int size;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::vector<Slot> slots;

  // A reusable barrier that every waiting rank leaves with an error once the group is aborted.
  void sync() {
    std::unique_lock lock(m);
    K3_CHECK(!aborted, "parallel group aborted (another rank failed)");
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return generation != gen || aborted; });
    K3_CHECK(!aborted, "parallel group aborted (another rank failed)");
  }
  void abort() {
    std::lock_guard lock(m);
    aborted = true;
    cv.notify_all();
  }
  // Every rank must be in the same collective with the same element count and type.
  void check_matching(const Slot& mine, bool same_n) const {
    for (int r = 0; r < size; ++r) {
      const Slot& s = slots[static_cast<size_t>(r)];
      K3_CHECK(s.op == mine.op, "collective mismatch: rank ", r, " called ", op_name(s.op),
               " while another rank called ", op_name(mine.op));
      K3_CHECK(s.type == mine.type && (!same_n || s.n == mine.n), op_name(mine.op), ": rank ", r,
               " passed ", s.n, " elements, another rank ", mine.n);
      K3_CHECK(s.root == mine.root, op_name(mine.op), ": ranks disagree on the root");
    }
  }
};

namespace {

class InProcessComm final : public Communicator {
 public:
  InProcessComm(InProcessGroup::Shared& g, int rank) : g_(g), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_.size; }

  void all_reduce_sum(float* data, int64_t n) override {
    post({Op::AllReduce, CommType::F32, data, nullptr, n, 0}, true);
    std::vector<float> sum(static_cast<size_t>(n));
    const float* first = static_cast<const float*>(g_.slots[0].in);
    std::copy(first, first + n, sum.begin());
    for (int r = 1; r < g_.size; ++r) {
      const float* src = static_cast<const float*>(g_.slots[static_cast<size_t>(r)].in);
      for (int64_t i = 0; i < n; ++i) sum[static_cast<size_t>(i)] += src[i];
    }
    g_.sync();  // everyone has read every input: now overwrite ours
    std::copy(sum.begin(), sum.end(), data);
  }

  void all_gather(const void* in, int64_t n, CommType t, void* out) override {
    post({Op::AllGather, t, in, nullptr, n, 0}, true);
    const size_t bytes = static_cast<size_t>(n) * comm_type_size(t);
    for (int r = 0; r < g_.size; ++r)
      if (bytes)
        std::memcpy(static_cast<uint8_t*>(out) + r * bytes, g_.slots[static_cast<size_t>(r)].in,
                    bytes);
    g_.sync();
  }

  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv,
                    const int64_t* recv_counts, CommType t) override {
    post({Op::AllToAll, t, send, send_counts, 0, 0}, false);
    const size_t es = comm_type_size(t);
    size_t out_off = 0;  // elements
    std::string error;
    for (int s = 0; s < g_.size && error.empty(); ++s) {
      const Slot& src = g_.slots[static_cast<size_t>(s)];
      int64_t in_off = 0;
      for (int d = 0; d < rank_; ++d) in_off += src.counts[d];
      const int64_t cnt = src.counts[rank_];
      if (cnt != recv_counts[s]) {
        error = detail::concat("all_to_all_v: rank ", s, " sends ", cnt, " elements to rank ",
                               rank_, ", which expects ", recv_counts[s]);
        break;
      }
      if (cnt)
        std::memcpy(static_cast<uint8_t*>(recv) + out_off * es,
                    static_cast<const uint8_t*>(src.in) + static_cast<size_t>(in_off) * es,
                    static_cast<size_t>(cnt) * es);
      out_off += static_cast<size_t>(cnt);
    }
    g_.sync();  // keep the group in lockstep before reporting a count mismatch
    if (!error.empty()) fail(error);
  }

  void broadcast(void* data, int64_t n, CommType t, int root) override {
    K3_CHECK(root >= 0 && root < g_.size, "broadcast: root ", root, " outside the group of ",
             g_.size);
    post({Op::Broadcast, t, data, nullptr, n, root}, true);
    const size_t bytes = static_cast<size_t>(n) * comm_type_size(t);
    if (rank_ != root && bytes) std::memcpy(data, g_.slots[static_cast<size_t>(root)].in, bytes);
    g_.sync();
  }

  void barrier() override {
    post({Op::Barrier, CommType::F32, nullptr, nullptr, 0, 0}, true);
    g_.sync();  // nobody posts the next slot while another rank still checks this one
  }

 private:
  // Posts this rank's slot and waits until every rank has posted; then checks they match.
  void post(const Slot& s, bool same_n) {
    g_.slots[static_cast<size_t>(rank_)] = s;
    g_.sync();
    g_.check_matching(s, same_n);
  }

  InProcessGroup::Shared& g_;
  int rank_;
};

}  // namespace

InProcessGroup::InProcessGroup(int size) {
  K3_CHECK(size >= 1, "a parallel group needs at least one rank, got ", size);
  shared_ = std::make_unique<Shared>(size);
  for (int r = 0; r < size; ++r) comms_.push_back(std::make_unique<InProcessComm>(*shared_, r));
}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::size() const {
  return shared_->size;
}

Communicator& InProcessGroup::comm(int rank) {
  K3_CHECK(rank >= 0 && rank < size(), "rank ", rank, " outside the group of ", size());
  return *comms_[static_cast<size_t>(rank)];
}

void InProcessGroup::abort() {
  shared_->abort();
}

}  // namespace k3::parallel
