#include "cuda/nccl_communicator.h"

namespace k3::cuda {

RankComms make_nccl_rank_comms(parallel::TcpBootstrap& boot,
                               const parallel::ParallelLayout& layout) {
  auto world = std::make_shared<NcclCommunicator>(boot);  // also selects this process's GPU
  RankComms c;
  c.world = world;
  if (layout.tp == layout.world())
    c.tp = world;
  else  // this replica's tp ranks: color dp_rank, ordered by tp_rank
    c.tp = world->split(boot.rank() / layout.tp, boot.rank() % layout.tp);
  return c;
}

}  // namespace k3::cuda
