#include "cuda/rank_worker.h"

#include <algorithm>
#include <cstring>
#include <span>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/host_staged_communicator.h"

namespace k3::cuda {
namespace {

NcclRankCommsFactory g_nccl_factory = nullptr;

template <typename T>
void put(std::vector<uint8_t>& b, const T& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof v);
}
template <typename T>
void put_vec(std::vector<uint8_t>& b, const std::vector<T>& v) {
  put(b, static_cast<int64_t>(v.size()));
  const auto* p = reinterpret_cast<const uint8_t*>(v.data());
  b.insert(b.end(), p, p + v.size() * sizeof(T));
}

struct Reader {
  const std::vector<uint8_t>& b;
  size_t at = 0;
  template <typename T>
  T get() {
    K3_CHECK(at + sizeof(T) <= b.size(), "rank command: truncated message");
    T v;
    std::memcpy(&v, b.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  template <typename T>
  std::vector<T> get_vec() {
    const int64_t n = get<int64_t>();
    K3_CHECK(n >= 0 && at + static_cast<size_t>(n) * sizeof(T) <= b.size(),
             "rank command: truncated message");
    std::vector<T> v(static_cast<size_t>(n));
    std::memcpy(v.data(), b.data() + at, v.size() * sizeof(T));
    at += v.size() * sizeof(T);
    return v;
  }
};

}  // namespace

std::vector<uint8_t> encode(const RankCommand& c) {
  std::vector<uint8_t> b;
  put(b, c.op);
  put(b, c.replica);
  put(b, c.slot);
  put(b, c.index);
  put(b, c.value);
  put(b, c.path);
  put(b, c.keep);
  put(b, c.rows);
  put_vec(b, c.slots);
  put_vec(b, c.tokens);
  put_vec(b, c.want);
  return b;
}

RankCommand decode(const std::vector<uint8_t>& b) {
  Reader r{b};
  RankCommand c;
  c.op = r.get<RankOp>();
  c.replica = r.get<int32_t>();
  c.slot = r.get<int32_t>();
  c.index = r.get<int32_t>();
  c.value = r.get<int64_t>();
  c.path = r.get<int32_t>();
  c.keep = r.get<int32_t>();
  c.rows = r.get<int32_t>();
  c.slots = r.get_vec<int32_t>();
  c.tokens = r.get_vec<int32_t>();
  c.want = r.get_vec<int64_t>();
  K3_CHECK(c.op >= RankOp::Step && c.op <= RankOp::Stop, "rank command: unknown operation");
  return c;
}

RankWorker::RankWorker(const ModelConfig& cfg, const ModelWeights& w, const RankedOptions& o,
                       int rank, const RankComms& comms)
    : rank(rank),
      dp_rank(rank / o.layout.tp),
      tp_rank(rank % o.layout.tp),
      comms(comms),
      weights(cfg, w, o.layout, rank) {
  CudaBackboneOptions bo = o.backbone;
  bo.pool.slots = o.backbone.pool.slots + 1;  // + the padding slot
  bo.padding_slot = o.backbone.pool.slots;
  bo.ranks.layout = o.layout;
  bo.ranks.rank = rank;
  bo.ranks.world = comms.world.get();
  bo.ranks.tp = comms.tp.get();
  bb = std::make_unique<CudaBackbone>(weights.config(), weights.weights(), bo);
}

void RankWorker::apply(const RankCommand& c) {
  switch (c.op) {
    case RankOp::Step: {
      const size_t R = static_cast<size_t>(c.rows), at = static_cast<size_t>(dp_rank) * R;
      const std::span<const int32_t> slots(c.slots.data() + at, R);
      const std::span<const int32_t> tokens(c.tokens.data() + at, R);
      const int pad = bb->slots() - 1;
      // A padded step starts the padding slot afresh: its rows are never read, but its
      // state must not drift (its run may be any length).
      if (std::find(slots.begin(), slots.end(), pad) != slots.end()) bb->reset_slot(pad);
      bb->step(slots, tokens, static_cast<StepPath>(c.path), c.keep != 0);
      break;
    }
    case RankOp::Reset:
      if (c.replica == dp_rank) bb->reset_slot(c.slot);
      break;
    case RankOp::Restore:
      if (c.replica == dp_rank) bb->restore_kda(c.slot, c.index);
      break;
    case RankOp::SetPosition:
      if (c.replica == dp_rank) bb->set_position(c.slot, c.value);
      break;
    case RankOp::Reserve:
      bb->reserve_snapshots(static_cast<int>(c.value));
      break;
    case RankOp::Logits:
    case RankOp::Hidden:
    case RankOp::Stop:
      break;
  }
}

std::vector<float> RankWorker::rows_out(const RankCommand& c, int64_t width) {
  std::vector<float> out;
  if (tp_rank != 0) return out;
  std::vector<int64_t> local;
  for (const int64_t w : c.want)
    if (w / c.rows == dp_rank) local.push_back(w % c.rows);
  if (local.empty()) return out;
  out.resize(local.size() * static_cast<size_t>(width));
  if (c.op == RankOp::Logits) {
    std::vector<float*> dst;
    for (size_t i = 0; i < local.size(); ++i) dst.push_back(out.data() + i * width);
    bb->logits_rows_to_host(local, dst);
  } else {
    std::vector<float> all(static_cast<size_t>(c.rows * width));
    bb->hidden_to_host(c.rows, all.data());
    for (size_t i = 0; i < local.size(); ++i)
      std::copy_n(all.data() + local[i] * width, width, out.data() + i * width);
  }
  return out;
}

void send_command(parallel::TcpBootstrap& boot, const RankCommand& c) {
  std::vector<uint8_t> b = encode(c);
  int64_t n = static_cast<int64_t>(b.size());
  boot.broadcast_bytes(&n, sizeof n, 0);
  boot.broadcast_bytes(b.data(), b.size(), 0);
}

RankCommand receive_command(parallel::TcpBootstrap& boot) {
  int64_t n = 0;
  boot.broadcast_bytes(&n, sizeof n, 0);
  K3_CHECK(n > 0 && n < (int64_t{1} << 32), "rank command: bad size ", n);
  std::vector<uint8_t> b(static_cast<size_t>(n));
  boot.broadcast_bytes(b.data(), b.size(), 0);
  return decode(b);
}

void set_nccl_rank_comms_factory(NcclRankCommsFactory factory) {
  g_nccl_factory = factory;
}
bool have_nccl_rank_comms() {
  return g_nccl_factory != nullptr;
}

int visible_devices() {
  int n = 0;
  K3_CUDA_CHECK(cudaGetDeviceCount(&n));
  K3_CHECK(n > 0, "multi-rank CUDA backbone: no CUDA device visible");
  return n;
}

std::unique_ptr<ProcessRank> make_process_rank(const ModelConfig& cfg, const ModelWeights& w,
                                               const RankedOptions& o, parallel::TcpBootstrap& boot,
                                               RankComm comm) {
  const parallel::ParallelLayout& lo = o.layout;
  parallel::validate_layout(lo, cfg);
  K3_CHECK(boot.size() == lo.world(), "the layout has ", lo.world(), " ranks (tp ", lo.tp, " x dp ",
           lo.dp, ") but ", boot.size(), " processes joined (K3_WORLD_SIZE)");
  auto p = std::make_unique<ProcessRank>();
  RankComms comms;
  if (comm == RankComm::Nccl) {
    K3_CHECK(g_nccl_factory != nullptr,
             "NCCL collectives: this binary was built without NCCL (use K3_RANK_COMM=host)");
    comms = g_nccl_factory(boot, lo);
  } else {
    // Host-staged over the bootstrap: the world group is the bootstrap's; a tp group is the
    // world (one replica) or this rank alone (tp 1). Processes may share a GPU.
    K3_CHECK(lo.dp == 1 || lo.tp == 1,
             "host-staged collectives across processes support one DP replica or "
             "tensor_parallel_size 1 (a tp group inside several replicas needs NCCL)");
    p->world_host = std::make_unique<parallel::TcpCommunicator>(boot);
    comms.world = std::make_shared<HostStagedCommunicator>(*p->world_host);
    if (lo.dp == 1) {
      comms.tp = comms.world;
    } else {
      p->solo = std::make_unique<parallel::InProcessGroup>(1);
      comms.tp = std::make_shared<HostStagedCommunicator>(p->solo->comm(0));
    }
    const int local = boot.local_rank() >= 0 ? boot.local_rank() : boot.rank();
    K3_CUDA_CHECK(cudaSetDevice(local % visible_devices()));
  }
  p->worker = std::make_unique<RankWorker>(cfg, w, o, boot.rank(), comms);
  return p;
}

}  // namespace k3::cuda
