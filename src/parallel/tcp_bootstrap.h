// Rendezvous and byte collectives over TCP for `world` processes (one per GPU), so the same
// binary spans hosts without MPI. Rank 0 listens on master_addr:master_port; every other rank
// connects to it (a star). Each collective sends one framed message per rank to rank 0, which
// checks that every rank called the same collective with matching sizes and sends each rank its
// result. This is the control plane (ncclUniqueId, counts, CPU runs of the reference), not a
// fast data path. A failing process closes its sockets, so the others fail with an error instead
// of hanging; mismatched calls are reported to every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace k3::parallel {

struct BootstrapConfig {
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int rank = 0;
  int world = 1;
  int local_rank = -1;             // -1: not given (the GPU layer picks rank % device count)
  double connect_timeout_s = 120;  // every rank must show up within this
  double op_timeout_s = 1800;      // one collective may wait this long for the slowest rank

  // K3_MASTER_ADDR, K3_MASTER_PORT, K3_RANK, K3_WORLD_SIZE, K3_LOCAL_RANK, falling back to
  // torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK; K3_BOOTSTRAP_TIMEOUT
  // (seconds) sets connect_timeout_s. Unset values keep the defaults above.
  static BootstrapConfig from_env();
};

class TcpBootstrap {
 public:
  // Blocks until all `world` ranks have connected (rank 0) or rank 0 has accepted this rank
  // (others). world == 1 opens no socket.
  explicit TcpBootstrap(const BootstrapConfig& cfg);
  ~TcpBootstrap();
  TcpBootstrap(const TcpBootstrap&) = delete;
  TcpBootstrap& operator=(const TcpBootstrap&) = delete;

  int rank() const { return cfg_.rank; }
  int size() const { return cfg_.world; }
  int local_rank() const { return cfg_.local_rank; }
  const BootstrapConfig& config() const { return cfg_; }

  // data[bytes] of rank `root` copied to every rank; every rank passes the same byte count.
  void broadcast_bytes(void* data, size_t bytes, int root = 0);
  // in[bytes] of every rank -> out[size * bytes], rank r's bytes at out + r * bytes.
  void all_gather_bytes(const void* in, size_t bytes, void* out);
  // send: payloads packed by destination, send_bytes[size] each. recv: packed by source;
  // recv_bytes[size] must match what the sources send (checked, the error names the pair).
  void all_to_all_v_bytes(const void* send, const size_t* send_bytes, void* recv,
                          const size_t* recv_bytes);
  void barrier();

  // Closes every socket: the other ranks' pending and later collectives fail.
  void abort();

 private:
  // One round through rank 0: every rank sends (op, aux, payload); rank 0 checks them and
  // replies with each rank's result. Returns this rank's reply.
  std::vector<uint8_t> round(uint32_t op, int64_t aux, const void* payload, size_t bytes);
  std::vector<std::vector<uint8_t>> route(uint32_t op, int64_t aux,
                                          const std::vector<std::vector<uint8_t>>& in) const;

  BootstrapConfig cfg_;
  int listen_fd_ = -1;
  std::vector<int> peers_;  // rank 0: socket of rank r at [r] (-1 at [0]); others: [0] = rank 0
};

}  // namespace k3::parallel
