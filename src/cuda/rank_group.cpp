#include "cuda/rank_group.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/host_staged_communicator.h"
#include "cuda/rank_worker.h"
#include "cuda/thread_team.h"
#include "parallel/communicator.h"

namespace k3::cuda {

RankComm parse_rank_comm(std::string_view s) {
  std::string v(s);
  if (v.empty()) {
    const char* e = std::getenv("K3_RANK_COMM");
    v = e && *e ? e : (have_nccl_rank_comms() ? "nccl" : "host");
  }
  if (v == "nccl") return RankComm::Nccl;
  if (v == "host") return RankComm::Host;
  fail("rank communicator must be nccl or host (K3_RANK_COMM), got \"", v, "\"");
}

namespace {

// What the GPU ranks need beyond parallel::validate_layout: TP-sliced MXFP4 experts keep whole
// 32-column blocks of w2 (the kernels read MXFP4 or bf16; a straddling slice becomes fp32).
void check_gpu_layout(const ModelConfig& cfg, const ModelWeights& w,
                      const parallel::ParallelLayout& lo) {
  parallel::validate_layout(lo, cfg);
  if (lo.ep || lo.tp == 1) return;
  for (const LayerWeights& L : w.layers) {
    if (!L.moe || L.moe_w.experts.empty()) continue;
    const WeightMatrix& w2 = L.moe_w.experts.front().w2;
    K3_CHECK(w2.format != WeightFormat::MXFP4 || (w2.cols / lo.tp) % 32 == 0,
             "tensor_parallel_size ", lo.tp, " slices the MXFP4 experts' ", w2.cols,
             " intermediate columns into ", w2.cols / lo.tp,
             ", not whole 32-column blocks: use enable_expert_parallel (experts whole, placed "
             "over the ranks) or a smaller tensor_parallel_size");
  }
}

}  // namespace

struct RankedBackbone::Impl {
  Impl(const ModelConfig& c, const RankedOptions& o) : cfg(&c), opt(o), S(o.backbone.pool.slots) {
    K3_CHECK(S >= 1, "multi-rank backbone: at least one slot per replica");
    positions.assign(static_cast<size_t>(dp() * S), 0);
  }

  const ModelConfig* cfg;
  RankedOptions opt;
  int S;                           // request slots per replica
  std::vector<int64_t> positions;  // [dp * S] host mirror
  int32_t last_rows = 0;           // rows per replica of the last step (padded)
  int snapshots = 0;               // KDA snapshots reserved on every rank
  std::vector<int64_t> row_at;     // row of the last step -> replica * last_rows + its row
  std::string broken;              // set once a multi-rank step failed

  // In this process: every rank on a thread.
  std::unique_ptr<parallel::InProcessGroup> world_group;
  std::vector<std::unique_ptr<parallel::InProcessGroup>> tp_groups;
  std::vector<std::unique_ptr<RankWorker>> ranks;
  std::unique_ptr<ThreadTeam> team;
  int devices = 1;  // visible GPUs

  // Process per rank: this process leads.
  parallel::TcpBootstrap* boot = nullptr;
  std::unique_ptr<ProcessRank> local;  // this process's rank

  int dp() const { return opt.layout.dp; }
  int64_t width(RankOp op) const {
    return op == RankOp::Logits ? cfg->vocab_size : cfg->hidden_size;
  }

  // Runs c on every rank (and, for Logits / Hidden, gathers the answering ranks' rows into
  // dst[i] for c.want[i]).
  void run(const RankCommand& c, std::span<float* const> dst = {}, int64_t width = 0) {
    K3_CHECK(broken.empty(), "an earlier multi-rank step failed: ", broken);
    try {
      if (team)
        run_threads(c, dst, width);
      else
        run_leader(c, dst, width);
    } catch (const std::exception& e) {
      broken = e.what();
      throw;
    }
  }

  void scatter(const RankCommand& c, int replica, const std::vector<float>& rows,
               std::span<float* const> dst, int64_t width) const {
    size_t k = 0;
    for (size_t i = 0; i < c.want.size(); ++i)
      if (c.want[i] / c.rows == replica) std::copy_n(rows.data() + (k++) * width, width, dst[i]);
  }

  void run_threads(const RankCommand& c, std::span<float* const> dst, int64_t width) {
    team->run([&](int r) {
      RankWorker& rk = *ranks[static_cast<size_t>(r)];
      ranks_device(r);
      rk.apply(c);
      if ((c.op == RankOp::Logits || c.op == RankOp::Hidden) && rk.tp_rank == 0)
        scatter(c, rk.dp_rank, rk.rows_out(c, width), dst, width);  // disjoint rows per replica
    });
  }

  // Rank r's GPU (threads placement): one of the devices visible at construction.
  void ranks_device(int r) const { K3_CUDA_CHECK(cudaSetDevice(r % devices)); }

  void run_leader(const RankCommand& c, std::span<float* const> dst, int64_t width) {
    send_command(*boot, c);
    RankWorker& rk = *local->worker;
    rk.apply(c);
    if (c.op != RankOp::Logits && c.op != RankOp::Hidden) return;
    scatter(c, 0, rk.rows_out(c, width), dst, width);
    // The other replicas' tp rank 0 send their rows here.
    const int W = opt.layout.world();
    std::vector<size_t> send(static_cast<size_t>(W), 0), recv(static_cast<size_t>(W), 0);
    for (int d = 1; d < dp(); ++d) {
      size_t n = 0;
      for (const int64_t w : c.want) n += w / c.rows == d ? 1 : 0;
      recv[static_cast<size_t>(d * opt.layout.tp)] = n * static_cast<size_t>(width) * 4;
    }
    size_t total = 0;
    for (size_t b : recv) total += b;
    std::vector<uint8_t> in(std::max<size_t>(total, 1));
    const uint8_t nothing = 0;
    boot->all_to_all_v_bytes(&nothing, send.data(), in.data(), recv.data());
    size_t at = 0;
    for (int d = 1; d < dp(); ++d) {
      const size_t bytes = recv[static_cast<size_t>(d * opt.layout.tp)];
      std::vector<float> rows(bytes / 4);
      std::memcpy(rows.data(), in.data() + at, bytes);
      at += bytes;
      scatter(c, d, rows, dst, width);
    }
  }

  void check_slot(int slot) const {
    K3_CHECK(slot >= 0 && slot < dp() * S, "slot ", slot, " outside the ", dp() * S,
             " slots of the multi-rank backbone");
  }
  RankCommand slot_command(RankOp op, int slot) const {
    check_slot(slot);
    RankCommand c;
    c.op = op;
    c.replica = slot / S;
    c.slot = slot % S;
    return c;
  }
};

RankedBackbone::RankedBackbone(const ModelConfig& cfg, const ModelWeights& w,
                               const RankedOptions& o)
    : impl_(std::make_unique<Impl>(cfg, o)) {
  Impl& m = *impl_;
  check_gpu_layout(cfg, w, o.layout);
  m.devices = visible_devices();
  const int W = o.layout.world(), tp = o.layout.tp;
  m.world_group = std::make_unique<parallel::InProcessGroup>(W);
  for (int d = 0; d < o.layout.dp; ++d)
    m.tp_groups.push_back(std::make_unique<parallel::InProcessGroup>(tp));
  std::vector<RankComms> comms(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    comms[static_cast<size_t>(r)].world =
        std::make_shared<HostStagedCommunicator>(m.world_group->comm(r));
    comms[static_cast<size_t>(r)].tp = std::make_shared<HostStagedCommunicator>(
        m.tp_groups[static_cast<size_t>(r / tp)]->comm(r % tp));
  }
  m.ranks.resize(static_cast<size_t>(W));
  m.team = std::make_unique<ThreadTeam>(W, [&m] {
    m.world_group->abort();
    for (auto& g : m.tp_groups) g->abort();
  });
  m.team->run([&](int r) {
    m.ranks_device(r);
    m.ranks[static_cast<size_t>(r)] =
        std::make_unique<RankWorker>(cfg, w, o, r, comms[static_cast<size_t>(r)]);
  });
}

RankedBackbone::RankedBackbone(const ModelConfig& cfg, const ModelWeights& w,
                               const RankedOptions& o, parallel::TcpBootstrap& boot, RankComm comm)
    : impl_(std::make_unique<Impl>(cfg, o)) {
  Impl& m = *impl_;
  K3_CHECK(boot.rank() == 0, "the multi-rank leader is rank 0; rank ", boot.rank(),
           " runs follow_rank");
  m.boot = &boot;
  try {
    check_gpu_layout(cfg, w, o.layout);
    m.local = make_process_rank(cfg, w, o, boot, comm);
  } catch (...) {
    boot.abort();  // the followers fail instead of waiting for commands
    throw;
  }
}

RankedBackbone::~RankedBackbone() {
  if (!impl_ || impl_->team || !impl_->broken.empty()) return;
  try {
    RankCommand stop;
    stop.op = RankOp::Stop;
    send_command(*impl_->boot, stop);
  } catch (...) {
    // A destructor must not throw: the followers then fail on the closed bootstrap.
  }
}

int RankedBackbone::slots() const {
  return impl_->dp() * impl_->S;
}
int64_t RankedBackbone::max_context() const {
  return impl_->opt.backbone.pool.max_context;
}
int RankedBackbone::max_rows() const {
  return impl_->opt.backbone.max_rows;
}
bool RankedBackbone::specialized_ready() const {
  return !impl_->opt.backbone.capture_sizes.empty();
}
int RankedBackbone::max_capture_rows() const {
  const auto& c = impl_->opt.backbone.capture_sizes;
  return c.empty() ? 0 : c.back();
}

void RankedBackbone::reset_slot(int slot) {
  impl_->run(impl_->slot_command(RankOp::Reset, slot));
  impl_->positions[static_cast<size_t>(slot)] = 0;
}

int64_t RankedBackbone::position(int slot) const {
  impl_->check_slot(slot);
  return impl_->positions[static_cast<size_t>(slot)];
}

void RankedBackbone::reserve_snapshots(int n) {
  if (n <= impl_->snapshots) return;  // grow only: nothing to tell the ranks
  RankCommand c;
  c.op = RankOp::Reserve;
  c.value = n;
  impl_->run(c);
  impl_->snapshots = n;
}

void RankedBackbone::restore_kda(int slot, int index) {
  RankCommand c = impl_->slot_command(RankOp::Restore, slot);
  c.index = index;
  impl_->run(c);
}

void RankedBackbone::set_position(int slot, int64_t position) {
  RankCommand c = impl_->slot_command(RankOp::SetPosition, slot);
  c.value = position;
  impl_->run(c);
  impl_->positions[static_cast<size_t>(slot)] = position;
}

void RankedBackbone::step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                          StepPath path, bool keep_kda_states) {
  Impl& m = *impl_;
  const int64_t n = static_cast<int64_t>(slots.size());
  // Checked here for every replica (a follower must not fail after the command went out).
  check_step_rows(slots, tokens, max_rows(), m.cfg->vocab_size, m.positions, max_context());
  // Each replica's rows in order; every replica padded to the longest one's count.
  std::vector<std::vector<int32_t>> rs(static_cast<size_t>(m.dp())), ts(rs.size());
  std::vector<std::pair<int64_t, int64_t>> at;  // step row -> (replica, row in the replica)
  for (int64_t r = 0; r < n; ++r) {
    const int32_t g = slots[static_cast<size_t>(r)];
    const size_t d = static_cast<size_t>(g / m.S);
    at.emplace_back(static_cast<int64_t>(d), static_cast<int64_t>(rs[d].size()));
    rs[d].push_back(g % m.S);
    ts[d].push_back(tokens[static_cast<size_t>(r)]);
  }
  size_t R = 1;
  for (const auto& v : rs) R = std::max(R, v.size());
  RankCommand c;
  c.op = RankOp::Step;
  c.path = static_cast<int32_t>(path);
  c.keep = keep_kda_states ? 1 : 0;
  c.rows = static_cast<int32_t>(R);
  for (size_t d = 0; d < rs.size(); ++d) {
    rs[d].resize(R, m.S);  // the padding slot (each rank's slot S)
    ts[d].resize(R, 0);
    c.slots.insert(c.slots.end(), rs[d].begin(), rs[d].end());
    c.tokens.insert(c.tokens.end(), ts[d].begin(), ts[d].end());
  }
  m.run(c);
  for (const int32_t g : slots) ++m.positions[static_cast<size_t>(g)];
  m.row_at.clear();
  for (const auto& [d, j] : at) m.row_at.push_back(d * static_cast<int64_t>(R) + j);
  m.last_rows = c.rows;
}

void RankedBackbone::logits_rows_to_host(std::span<const int64_t> rows,
                                         std::span<float* const> out) {
  Impl& m = *impl_;
  K3_CHECK(rows.size() == out.size(), "logits_rows_to_host: ", rows.size(), " rows, ", out.size(),
           " outputs");
  RankCommand c;
  c.op = RankOp::Logits;
  c.rows = m.last_rows;
  for (const int64_t r : rows) {
    K3_CHECK(r >= 0 && r < static_cast<int64_t>(m.row_at.size()), "logits_rows_to_host: row ", r,
             " is not a row of the last step");
    c.want.push_back(m.row_at[static_cast<size_t>(r)]);
  }
  m.run(c, out, m.width(RankOp::Logits));
}

void RankedBackbone::hidden_to_host(int64_t rows, float* out) {
  Impl& m = *impl_;
  K3_CHECK(rows >= 0 && rows <= static_cast<int64_t>(m.row_at.size()), "hidden_to_host: ", rows,
           " rows");
  const int64_t H = m.width(RankOp::Hidden);
  RankCommand c;
  c.op = RankOp::Hidden;
  c.rows = m.last_rows;
  std::vector<float*> dst;
  for (int64_t r = 0; r < rows; ++r) {
    c.want.push_back(m.row_at[static_cast<size_t>(r)]);
    dst.push_back(out + r * H);
  }
  m.run(c, dst, H);
}

void follow_rank(const ModelConfig& cfg, const ModelWeights& w, const RankedOptions& o,
                 parallel::TcpBootstrap& boot, RankComm comm) {
  K3_CHECK(boot.rank() != 0,
           "rank 0 leads the multi-rank run (RankedBackbone), it does not follow");
  std::unique_ptr<ProcessRank> p;
  try {
    check_gpu_layout(cfg, w, o.layout);
    p = make_process_rank(cfg, w, o, boot, comm);
    RankWorker& rk = *p->worker;
    const int W = o.layout.world();
    for (;;) {
      const RankCommand c = receive_command(boot);
      if (c.op == RankOp::Stop) return;
      rk.apply(c);
      if (c.op != RankOp::Logits && c.op != RankOp::Hidden) continue;
      const int64_t width = c.op == RankOp::Logits ? cfg.vocab_size : cfg.hidden_size;
      const std::vector<float> rows = rk.rows_out(c, width);
      std::vector<size_t> send(static_cast<size_t>(W), 0), recv(static_cast<size_t>(W), 0);
      send[0] = rows.size() * sizeof(float);
      uint8_t nothing = 0;
      boot.all_to_all_v_bytes(rows.empty() ? static_cast<const void*>(&nothing) : rows.data(),
                              send.data(), &nothing, recv.data());
    }
  } catch (...) {
    boot.abort();  // the leader and the other followers fail instead of waiting
    throw;
  }
}

}  // namespace k3::cuda
