// One rank of a multi-rank CUDA run (rank_group.h) and the commands it executes: the leader
// turns each StepExecutor call into a Command that every rank applies in the same order (in
// this process on the ranks' threads, or broadcast to follower processes over the bootstrap).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/backbone.h"
#include "cuda/rank_group.h"
#include "parallel/communicator.h"
#include "parallel/layout.h"
#include "parallel/tcp_bootstrap.h"
#include "parallel/tcp_communicator.h"

namespace k3::cuda {

enum class RankOp : int32_t { Step, Reset, Restore, SetPosition, Reserve, Logits, Hidden, Stop };

struct RankCommand {
  RankOp op = RankOp::Stop;
  int32_t replica = 0, slot = 0, index = 0;  // Reset / Restore / SetPosition: replica, local slot
  int64_t value = 0;                         // SetPosition: position; Reserve: snapshots
  int32_t path = 0, keep = 0, rows = 0;      // Step: path, keep_kda, rows per replica (padded);
                                             // Logits / Hidden: that step's rows per replica
  std::vector<int32_t> slots, tokens;        // Step: [dp][rows] local slots and tokens
  std::vector<int64_t> want;                 // Logits / Hidden: replica * rows + row, in order
};

std::vector<uint8_t> encode(const RankCommand& c);
RankCommand decode(const std::vector<uint8_t>& bytes);  // raises k3::Error on a bad message
// Over the bootstrap, from rank 0 to every rank: the size, then the bytes.
void send_command(parallel::TcpBootstrap& boot, const RankCommand& c);
RankCommand receive_command(parallel::TcpBootstrap& boot);

// One rank: its slice of the weights (parallel::RankWeights) and its CudaBackbone, whose pool
// has the replica's request slots plus one padding slot (the last).
struct RankWorker {
  RankWorker(const ModelConfig& cfg, const ModelWeights& w, const RankedOptions& o, int rank,
             const RankComms& comms);

  void apply(const RankCommand& c);
  // The rows of c.want this rank answers for (its replica's, on tp rank 0; empty elsewhere),
  // `width` floats each, in c.want's order: logits ([vocab]) or hidden states ([hidden]).
  std::vector<float> rows_out(const RankCommand& c, int64_t width);

  int rank, dp_rank, tp_rank;
  RankComms comms;
  parallel::RankWeights weights;
  std::unique_ptr<CudaBackbone> bb;
};

int visible_devices();

// This process's rank of a process-per-rank run: its communicators (NCCL through the registered
// factory, or host-staged over the bootstrap) and its worker. Sets this process's GPU.
struct ProcessRank {
  std::unique_ptr<parallel::TcpCommunicator> world_host;  // host-staged collectives
  std::unique_ptr<parallel::InProcessGroup> solo;         // a tp group of this rank alone
  std::unique_ptr<RankWorker> worker;
};
std::unique_ptr<ProcessRank> make_process_rank(const ModelConfig& cfg, const ModelWeights& w,
                                               const RankedOptions& o, parallel::TcpBootstrap& boot,
                                               RankComm comm);

}  // namespace k3::cuda
