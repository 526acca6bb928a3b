// TcpBootstrap: a star of TCP sockets around rank 0. Every message is a fixed header (magic, op,
// aux, count, payload bytes) followed by the payload. Non-root ranks send one message per
// collective and wait for one reply; rank 0 reads every rank's message in rank order, checks
// that they agree, and replies (socket plumbing with deadlines: parallel/tcp_socket.h).
#include "parallel/tcp_bootstrap.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.h"
#include "parallel/tcp_socket.h"

namespace k3::parallel {

namespace {

using tcp::Clock;
using tcp::deadline_after;
using tcp::errno_text;

constexpr uint32_t kMagic = 0x4b33424eu;  // "K3BN"
enum Op : uint32_t {
  kHello = 1,
  kBroadcast,
  kAllGather,
  kAllToAll,
  kBarrier,
  kReply = 100,
  kErrorReply = 101
};
constexpr uint64_t kMaxPayload = uint64_t{1} << 40;  // a larger header is garbage

const char* op_name(uint32_t op) {
  switch (op) {
    case kHello:
      return "hello";
    case kBroadcast:
      return "broadcast";
    case kAllGather:
      return "all_gather";
    case kAllToAll:
      return "all_to_all_v";
    case kBarrier:
      return "barrier";
    case kReply:
      return "reply";
    case kErrorReply:
      return "error";
  }
  return "unknown";
}

struct Header {
  uint32_t magic = kMagic;
  uint32_t op = 0;
  int64_t aux = 0;     // broadcast root; hello: world size
  uint64_t count = 0;  // byte count every rank declares (broadcast, all_gather); hello: rank
  uint64_t bytes = 0;  // payload that follows
};
static_assert(sizeof(Header) == 32);

struct Message {
  Header h;
  std::vector<uint8_t> payload;
};

void send_message(int fd, const Header& h, const void* payload, const std::string& who) {
  tcp::send_all(fd, &h, sizeof h, who);
  if (h.bytes) tcp::send_all(fd, payload, h.bytes, who);
}

Message recv_message(int fd, Clock::time_point deadline, const std::string& who) {
  Message m;
  tcp::recv_all(fd, &m.h, sizeof m.h, deadline, who);
  K3_CHECK(m.h.magic == kMagic && m.h.bytes <= kMaxPayload, "bootstrap: garbage from ", who,
           " (not a k3 bootstrap peer, or a different version)");
  m.payload.resize(m.h.bytes);
  if (m.h.bytes) tcp::recv_all(fd, m.payload.data(), m.h.bytes, deadline, who);
  return m;
}

void send_error(int fd, const std::string& what) {
  Header h;
  h.op = kErrorReply;
  h.bytes = what.size();
  try {
    send_message(fd, h, what.data(), "peer");
  } catch (const Error&) {
    // That peer is gone already; it has nothing to learn.
  }
}

std::string rank_name(int r) {
  return "rank " + std::to_string(r);
}

// Throws unless a message is a reply; an error reply carries rank 0's message.
void check_reply(const Message& m) {
  if (m.h.op == kErrorReply)
    fail(std::string(m.payload.begin(), m.payload.end()), " (reported by rank 0)");
  K3_CHECK(m.h.op == kReply, "bootstrap: expected a reply from rank 0, got ", op_name(m.h.op));
}

int env_int(const char* k3_name, const char* alt_name, int fallback) {
  const char* v = std::getenv(k3_name);
  const char* name = k3_name;
  if (!v || !*v) {
    v = alt_name ? std::getenv(alt_name) : nullptr;
    name = alt_name;
  }
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  K3_CHECK(errno == 0 && end && *end == '\0' && x >= -1 && x <= (1 << 30), "bootstrap: ", name,
           "='", v, "' is not a valid integer");
  return static_cast<int>(x);
}

}  // namespace

BootstrapConfig BootstrapConfig::from_env() {
  BootstrapConfig c;
  const char* addr = std::getenv("K3_MASTER_ADDR");
  if (!addr || !*addr) addr = std::getenv("MASTER_ADDR");
  if (addr && *addr) c.master_addr = addr;
  c.master_port = env_int("K3_MASTER_PORT", "MASTER_PORT", c.master_port);
  c.rank = env_int("K3_RANK", "RANK", c.rank);
  c.world = env_int("K3_WORLD_SIZE", "WORLD_SIZE", c.world);
  c.local_rank = env_int("K3_LOCAL_RANK", "LOCAL_RANK", c.local_rank);
  if (const char* t = std::getenv("K3_BOOTSTRAP_TIMEOUT"); t && *t) {
    char* end = nullptr;
    const double s = std::strtod(t, &end);
    K3_CHECK(end && *end == '\0' && s > 0, "bootstrap: K3_BOOTSTRAP_TIMEOUT='", t,
             "' is not a positive number of seconds");
    c.connect_timeout_s = s;
  }
  return c;
}

TcpBootstrap::TcpBootstrap(const BootstrapConfig& cfg) : cfg_(cfg) {
  K3_CHECK(cfg_.world >= 1, "bootstrap: world size ", cfg_.world, " (need >= 1)");
  K3_CHECK(cfg_.rank >= 0 && cfg_.rank < cfg_.world, "bootstrap: rank ", cfg_.rank,
           " outside the world of ", cfg_.world);
  K3_CHECK(cfg_.master_port > 0 && cfg_.master_port < 65536, "bootstrap: master port ",
           cfg_.master_port, " outside 1..65535");
  K3_CHECK(cfg_.connect_timeout_s > 0 && cfg_.op_timeout_s > 0, "bootstrap: timeouts must be > 0");
  if (cfg_.world == 1) return;
  // A bad address fails on every rank, before anyone waits.
  tcp::check_address(cfg_.master_addr, cfg_.master_port);
  const auto deadline = deadline_after(cfg_.connect_timeout_s);
  const std::string where = cfg_.master_addr + ":" + std::to_string(cfg_.master_port);

  if (cfg_.rank != 0) {
    int err = 0;
    const int fd = tcp::connect_until(cfg_.master_addr, cfg_.master_port, deadline, err);
    if (fd < 0)
      fail("bootstrap: rank ", cfg_.rank, " could not connect to rank 0 at ", where, " within ",
           cfg_.connect_timeout_s, " s (last error: ", errno_text(err), ")");
    peers_.assign(1, fd);
    Header hello;
    hello.op = kHello;
    hello.aux = cfg_.world;
    hello.count = static_cast<uint64_t>(cfg_.rank);
    try {
      send_message(fd, hello, nullptr, "rank 0");
      check_reply(recv_message(fd, deadline, "rank 0 (waiting for every rank to connect)"));
    } catch (...) {
      abort();
      throw;
    }
    return;
  }

  listen_fd_ = tcp::listen_on(cfg_.master_addr, cfg_.master_port, cfg_.world);
  peers_.assign(static_cast<size_t>(cfg_.world), -1);
  try {
    int connected = 1;
    while (connected < cfg_.world) {
      if (!tcp::wait_fd(listen_fd_, POLLIN, deadline)) {
        std::string missing;
        for (int r = 1; r < cfg_.world; ++r)
          if (peers_[static_cast<size_t>(r)] < 0)
            missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        fail("bootstrap: rank(s) ", missing, " of ", cfg_.world, " did not connect to rank 0 at ",
             where, " within ", cfg_.connect_timeout_s, " s");
      }
      int fd = tcp::accept_peer(listen_fd_);
      if (fd < 0) continue;
      // A stranger that connects and sends garbage (or nothing) is dropped, not fatal.
      Message m;
      try {
        m = recv_message(fd, std::min(deadline, deadline_after(10)), "a connecting rank");
      } catch (const Error&) {
        tcp::close_fd(fd);
        continue;
      }
      const int r = static_cast<int>(m.h.count);
      std::string bad;
      if (m.h.op != kHello)
        bad = "expected a hello";
      else if (m.h.aux != cfg_.world)
        bad = detail::concat("rank ", r, " has world size ", m.h.aux, ", rank 0 has ", cfg_.world);
      else if (r <= 0 || r >= cfg_.world)
        bad = detail::concat("rank ", r, " outside the world of ", cfg_.world);
      else if (peers_[static_cast<size_t>(r)] >= 0)
        bad = detail::concat("two processes claim rank ", r);
      if (!bad.empty()) {
        send_error(fd, "bootstrap: " + bad);
        tcp::close_fd(fd);
        fail("bootstrap: ", bad);
      }
      peers_[static_cast<size_t>(r)] = fd;
      ++connected;
    }
    Header ack;
    ack.op = kReply;
    for (int r = 1; r < cfg_.world; ++r)
      send_message(peers_[static_cast<size_t>(r)], ack, nullptr, rank_name(r));
  } catch (...) {
    abort();
    throw;
  }
  tcp::close_fd(listen_fd_);
}

TcpBootstrap::~TcpBootstrap() {
  abort();
}

void TcpBootstrap::abort() {
  for (int& fd : peers_) tcp::close_fd(fd);
  tcp::close_fd(listen_fd_);
}

std::vector<std::vector<uint8_t>> TcpBootstrap::route(
    uint32_t op, int64_t aux, const std::vector<std::vector<uint8_t>>& in) const {
  // Runs on rank 0 only, after `in` holds every rank's payload; headers were checked by round().
  const size_t n = static_cast<size_t>(cfg_.world);
  std::vector<std::vector<uint8_t>> out(n);
  switch (op) {
    case kBroadcast:
      for (size_t r = 0; r < n; ++r)
        if (static_cast<int64_t>(r) != aux) out[r] = in[static_cast<size_t>(aux)];
      break;
    case kAllGather: {
      std::vector<uint8_t> all;
      for (const auto& p : in) all.insert(all.end(), p.begin(), p.end());
      for (auto& o : out) o = all;
      break;
    }
    case kAllToAll: {
      // in[s] = send_bytes[n] (uint64) then the payloads by destination; out[d] = the byte
      // count from each source (uint64 [n]) then the payloads by source.
      std::vector<std::vector<uint64_t>> counts(n, std::vector<uint64_t>(n));
      std::vector<std::vector<uint64_t>> offs(n, std::vector<uint64_t>(n));
      for (size_t s = 0; s < n; ++s) {
        K3_CHECK(in[s].size() >= n * 8, "all_to_all_v: short message from rank ", s);
        std::memcpy(counts[s].data(), in[s].data(), n * 8);
        uint64_t at = n * 8;
        for (size_t d = 0; d < n; ++d) {
          offs[s][d] = at;
          at += counts[s][d];
        }
        K3_CHECK(at == in[s].size(), "all_to_all_v: rank ", s, "'s counts do not match its data");
      }
      for (size_t d = 0; d < n; ++d) {
        out[d].resize(n * 8);
        for (size_t s = 0; s < n; ++s) {
          std::memcpy(out[d].data() + s * 8, &counts[s][d], 8);
          const uint8_t* p = in[s].data() + offs[s][d];
          out[d].insert(out[d].end(), p, p + counts[s][d]);
        }
      }
      break;
    }
    default:
      break;  // barrier: empty replies
  }
  return out;
}

std::vector<uint8_t> TcpBootstrap::round(uint32_t op, int64_t aux, const void* payload,
                                         size_t bytes) {
  const uint64_t count = op == kAllToAll || op == kBarrier ? 0 : bytes;
  // A broadcast's payload travels only from its root.
  const bool carries = !(op == kBroadcast && aux != cfg_.rank);
  if (cfg_.world == 1) {
    std::vector<std::vector<uint8_t>> in(1);
    if (carries && bytes) {
      const uint8_t* p = static_cast<const uint8_t*>(payload);
      in[0].assign(p, p + bytes);
    }
    return route(op, aux, in)[0];
  }
  K3_CHECK(!peers_.empty() && peers_[cfg_.rank == 0 ? 1 : 0] >= 0,
           "bootstrap: this group was aborted after an earlier failure");
  const auto deadline = deadline_after(cfg_.op_timeout_s);
  Header h;
  h.op = op;
  h.aux = aux;
  h.count = count;
  h.bytes = carries ? bytes : 0;

  if (cfg_.rank != 0) {
    try {
      send_message(peers_[0], h, payload, "rank 0");
      Message m = recv_message(peers_[0], deadline, std::string("rank 0 in ") + op_name(op));
      check_reply(m);
      return std::move(m.payload);
    } catch (...) {
      abort();
      throw;
    }
  }

  try {
    const size_t n = static_cast<size_t>(cfg_.world);
    std::vector<std::vector<uint8_t>> in(n);
    if (h.bytes) {
      const uint8_t* p = static_cast<const uint8_t*>(payload);
      in[0].assign(p, p + bytes);
    }
    // Read everything first (so no peer is left blocked in a send), then judge.
    std::string error;
    for (size_t r = 1; r < n; ++r) {
      Message m =
          recv_message(peers_[r], deadline, rank_name(static_cast<int>(r)) + " in " + op_name(op));
      if (!error.empty()) continue;
      if (m.h.op != op)
        error = detail::concat("collective mismatch: rank ", r, " called ", op_name(m.h.op),
                               " while rank 0 called ", op_name(op));
      else if (m.h.aux != aux)
        error =
            detail::concat(op_name(op), ": rank ", r, " has root ", m.h.aux, ", rank 0 has ", aux);
      else if (m.h.count != count)
        error = detail::concat(op_name(op), ": rank ", r, " passed ", m.h.count,
                               " bytes, rank 0 passed ", count);
      in[r] = std::move(m.payload);
    }
    if (error.empty() && op == kBroadcast && in[static_cast<size_t>(aux)].size() != count)
      error = "broadcast: the root's payload does not match its declared size";
    std::vector<std::vector<uint8_t>> out;
    if (error.empty()) {
      try {
        out = route(op, aux, in);
      } catch (const Error& e) {
        error = e.what();
      }
    }
    if (!error.empty()) {
      for (size_t r = 1; r < n; ++r) send_error(peers_[r], error);
      fail(error);
    }
    Header reply;
    reply.op = kReply;
    for (size_t r = 1; r < n; ++r) {
      reply.bytes = out[r].size();
      send_message(peers_[r], reply, out[r].data(), rank_name(static_cast<int>(r)));
    }
    return std::move(out[0]);
  } catch (...) {
    abort();
    throw;
  }
}

void TcpBootstrap::broadcast_bytes(void* data, size_t bytes, int root) {
  K3_CHECK(root >= 0 && root < cfg_.world, "broadcast: root ", root, " outside the world of ",
           cfg_.world);
  std::vector<uint8_t> got = round(kBroadcast, root, data, bytes);
  if (cfg_.rank == root) return;
  K3_CHECK(got.size() == bytes, "broadcast: got ", got.size(), " bytes, expected ", bytes);
  if (bytes) std::memcpy(data, got.data(), bytes);
}

void TcpBootstrap::all_gather_bytes(const void* in, size_t bytes, void* out) {
  std::vector<uint8_t> got = round(kAllGather, 0, in, bytes);
  K3_CHECK(got.size() == bytes * static_cast<size_t>(cfg_.world), "all_gather: got ", got.size(),
           " bytes");
  if (!got.empty()) std::memcpy(out, got.data(), got.size());
}

void TcpBootstrap::all_to_all_v_bytes(const void* send, const size_t* send_bytes, void* recv,
                                      const size_t* recv_bytes) {
  const size_t n = static_cast<size_t>(cfg_.world);
  std::vector<uint8_t> msg(n * 8);
  size_t total = 0;
  for (size_t d = 0; d < n; ++d) {
    const uint64_t c = send_bytes[d];
    std::memcpy(msg.data() + d * 8, &c, 8);
    total += send_bytes[d];
  }
  const uint8_t* p = static_cast<const uint8_t*>(send);
  if (total) msg.insert(msg.end(), p, p + total);
  std::vector<uint8_t> got = round(kAllToAll, 0, msg.data(), msg.size());
  K3_CHECK(got.size() >= n * 8, "all_to_all_v: short reply");
  size_t at = n * 8;
  uint8_t* out = static_cast<uint8_t*>(recv);
  for (size_t s = 0; s < n; ++s) {
    uint64_t c = 0;
    std::memcpy(&c, got.data() + s * 8, 8);
    K3_CHECK(c == recv_bytes[s], "all_to_all_v: rank ", s, " sends ", c, " bytes to rank ",
             cfg_.rank, ", which expects ", recv_bytes[s]);
    K3_CHECK(at + c <= got.size(), "all_to_all_v: short reply");
    if (c) std::memcpy(out, got.data() + at, c);
    out += c;
    at += c;
  }
}

void TcpBootstrap::barrier() {
  (void)round(kBarrier, 0, nullptr, 0);
}

}  // namespace k3::parallel
