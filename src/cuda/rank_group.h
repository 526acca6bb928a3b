// The ranks of a multi-rank layout (parallel/layout.h) behind one StepExecutor, so the serving
// backend, generation and speculative verify drive them as they drive a single backbone.
//
// Slots are global: DP replica d owns slots [d * S, (d + 1) * S) of S request slots each. A step's
// rows are split by replica (each replica's rows in their order), every replica's rows are padded
// to the longest replica's count with its padding slot (vLLM's DP padding: every rank of an EP
// group steps the same row count, an idle replica a dummy step), and every rank runs its
// replica's rows in lockstep; the logits of a replica come from its tp rank 0.
//
// Two placements:
//  - in this process: one thread per rank (rank r on GPU r % visible devices), collectives
//    staged through the host over InProcessGroups (HostStagedCommunicator; no graphs). NCCL
//    refuses two ranks on one GPU, so this is how one GPU runs (and tests) every layout.
//  - one process per rank (tools/launch_ranks.sh; TCP bootstrap from the K3_* / torchrun
//    environment): rank 0 leads (it runs the engine and broadcasts each command over the
//    bootstrap), the others run follow_rank. Collectives run on NCCL (graphs captured) or
//    host-staged over TCP (RankComm::Host: processes may share a GPU; no graphs).
#pragma once

#include <memory>
#include <span>
#include <string_view>

#include "cuda/backbone.h"
#include "cuda/step_executor.h"
#include "model/config.h"
#include "model/model_weights.h"
#include "parallel/layout.h"
#include "parallel/tcp_bootstrap.h"

namespace k3::cuda {

enum class RankComm { Nccl, Host };
// "nccl" | "host"; empty: K3_RANK_COMM, else nccl when this binary links NCCL, else host.
RankComm parse_rank_comm(std::string_view s);

// A process's communicators for its rank: world (every rank) and its replica's tp group.
struct RankComms {
  std::shared_ptr<DeviceCommunicator> world, tp;
};
// NCCL communicators (built where NCCL is linked: nccl_rank_comms.cu registers itself through
// main.cpp). Collective over every process of boot; sets this process's GPU.
using NcclRankCommsFactory = RankComms (*)(parallel::TcpBootstrap& boot,
                                           const parallel::ParallelLayout& layout);
void set_nccl_rank_comms_factory(NcclRankCommsFactory factory);
bool have_nccl_rank_comms();

struct RankedOptions {
  parallel::ParallelLayout layout;
  // Per replica: pool.slots request slots (each rank adds its padding slot), max_rows rows per
  // step, context, capture sizes, tuning. ranks / padding_slot are set here.
  CudaBackboneOptions backbone;
};

class RankedBackbone final : public StepExecutor {
 public:
  // Every rank in this process, one thread each.
  RankedBackbone(const ModelConfig& cfg, const ModelWeights& w, const RankedOptions& o);
  // This process as rank 0 of boot's processes (boot.rank() must be 0; the others run
  // follow_rank with the same model and options).
  RankedBackbone(const ModelConfig& cfg, const ModelWeights& w, const RankedOptions& o,
                 parallel::TcpBootstrap& boot, RankComm comm);
  ~RankedBackbone() override;  // stops the followers
  RankedBackbone(const RankedBackbone&) = delete;
  RankedBackbone& operator=(const RankedBackbone&) = delete;

  int slots() const override;
  int64_t max_context() const override;
  int max_rows() const override;
  bool specialized_ready() const override;
  int max_capture_rows() const override;
  void reset_slot(int slot) override;
  int64_t position(int slot) const override;
  void reserve_snapshots(int n) override;
  void restore_kda(int slot, int index) override;
  void set_position(int slot, int64_t position) override;
  void step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
            StepPath path = StepPath::Stock, bool keep_kda_states = false) override;
  void logits_rows_to_host(std::span<const int64_t> rows, std::span<float* const> out) override;
  void hidden_to_host(int64_t rows, float* out) override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// A follower process (boot.rank() != 0): builds its rank and runs the leader's commands until
// the leader stops (returns) or fails (raises).
void follow_rank(const ModelConfig& cfg, const ModelWeights& w, const RankedOptions& o,
                 parallel::TcpBootstrap& boot, RankComm comm);

}  // namespace k3::cuda
