// TcpBootstrap / TcpCommunicator on 127.0.0.1: ranks as threads with their own sockets (and once
// as forked processes), collectives checked bit for bit against InProcessGroup on random data,
// and the error paths (missing rank, port in use, bad address, mismatched calls, a rank that
// exits) checked to fail fast with a clear message instead of hanging.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "parallel/communicator.h"
#include "parallel/tcp_bootstrap.h"
#include "parallel/tcp_communicator.h"
#include "test_util.h"

namespace k3 {
namespace {

using parallel::BootstrapConfig;
using parallel::Communicator;
using parallel::InProcessGroup;
using parallel::TcpBootstrap;
using parallel::TcpCommunicator;

// Short timeouts: every error test must finish well within a second or two.
constexpr double kConnectTimeout = 5.0;
constexpr double kShortTimeout = 0.3;

// A port nobody listens on right now (the kernel's pick for port 0). Another process could take
// it before we bind; the ephemeral range makes that unlikely enough for a test.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  EXPECT_EQ(0, ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a));
  socklen_t len = sizeof a;
  EXPECT_EQ(0, ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len));
  ::close(fd);
  return ntohs(a.sin_port);
}

BootstrapConfig config(int port, int rank, int world, double timeout = kConnectTimeout) {
  BootstrapConfig c;
  c.master_addr = "127.0.0.1";
  c.master_port = port;
  c.rank = rank;
  c.world = world;
  c.connect_timeout_s = timeout;
  c.op_timeout_s = timeout;
  return c;
}

// Runs fn(rank, bootstrap) on n threads, each with its own bootstrap on a fresh port; returns
// each rank's error message ("" when it succeeded).
std::vector<std::string> on_tcp_ranks(int n, const std::function<void(int, TcpBootstrap&)>& fn,
                                      double timeout = kConnectTimeout) {
  const int port = free_port();
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        TcpBootstrap boot(config(port, r, n, timeout));
        fn(r, boot);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        if (errors[static_cast<size_t>(r)].empty()) errors[static_cast<size_t>(r)] = "?";
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// One rank's script of collectives on seeded random data; records every result.
struct Results {
  std::vector<std::vector<uint8_t>> outs;
  void add(const void* p, size_t bytes) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    outs.emplace_back(b, b + bytes);
  }
};

void script(Communicator& c, uint64_t seed, Results& res) {
  const int n = c.size(), r = c.rank();
  Rng rng(seed * 131 + static_cast<uint64_t>(r));
  for (int round = 0; round < 3; ++round) {
    const int64_t len = round == 1 ? 0 : 257 + round;  // a zero-size round too
    std::vector<float> v = test::random_normal(rng, static_cast<size_t>(len), 10.0f);
    c.all_reduce_sum(v.data(), len);
    res.add(v.data(), v.size() * 4);

    std::vector<int32_t> ids(static_cast<size_t>(len));
    for (auto& x : ids) x = static_cast<int32_t>(rng.next_u64());
    std::vector<int32_t> gathered(static_cast<size_t>(n * len));
    c.all_gather(ids.data(), len, gathered.data());
    res.add(gathered.data(), gathered.size() * 4);

    // Random counts per destination (the same draws on both backends: the rng is per rank).
    std::vector<int64_t> sc(static_cast<size_t>(n));
    for (auto& x : sc) x = static_cast<int64_t>(rng.next_u64() % 9);
    int64_t total_send = 0;
    for (auto x : sc) total_send += x;
    std::vector<float> send = test::random_normal(rng, static_cast<size_t>(total_send));
    const std::vector<int64_t> rc = parallel::exchange_counts(c, sc);
    res.add(rc.data(), rc.size() * 8);
    int64_t total_recv = 0;
    for (auto x : rc) total_recv += x;
    std::vector<float> recv(static_cast<size_t>(total_recv), -1.0f);
    c.all_to_all_v(send.data(), sc.data(), recv.data(), rc.data());
    res.add(recv.data(), recv.size() * 4);

    std::vector<float> b = test::random_normal(rng, 100);
    c.broadcast(b.data(), 100, (round + 1) % n);
    res.add(b.data(), b.size() * 4);
    c.barrier();
  }
}

TEST(TcpBootstrap, CollectivesMatchInProcessGroupBitForBit) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (int n = 1; n <= 4; ++n) {
    SCOPED_TRACE("ranks " + std::to_string(n));
    std::vector<Results> want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
    {
      InProcessGroup g(n);
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r)
        threads.emplace_back([&, r] { script(g.comm(r), seed, want[static_cast<size_t>(r)]); });
      for (auto& t : threads) t.join();
    }
    expect_no_errors(on_tcp_ranks(n, [&](int r, TcpBootstrap& boot) {
      TcpCommunicator c(boot);
      ASSERT_EQ(c.rank(), r);
      ASSERT_EQ(c.size(), n);
      script(c, seed, got[static_cast<size_t>(r)]);
    }));
    for (int r = 0; r < n; ++r) {
      const auto& w = want[static_cast<size_t>(r)].outs;
      const auto& o = got[static_cast<size_t>(r)].outs;
      ASSERT_EQ(w.size(), o.size()) << "rank " << r;
      for (size_t i = 0; i < w.size(); ++i)
        EXPECT_EQ(w[i], o[i]) << "rank " << r << " result " << i;
      // The all-reduce result is also identical across ranks.
      EXPECT_EQ(got[0].outs[0], o[0]);
    }
  }
}

TEST(TcpBootstrap, ByteCollectives) {
  expect_no_errors(on_tcp_ranks(3, [](int r, TcpBootstrap& boot) {
    uint64_t id[4] = {0, 0, 0, 0};
    if (r == 0) id[0] = 0x1234, id[3] = 0xabcd;  // e.g. an ncclUniqueId
    boot.broadcast_bytes(id, sizeof id, 0);
    EXPECT_EQ(id[0], 0x1234u);
    EXPECT_EQ(id[3], 0xabcdu);
    const int mine = 10 + r;
    int all[3] = {-1, -1, -1};
    boot.all_gather_bytes(&mine, sizeof mine, all);
    EXPECT_EQ(all[0], 10);
    EXPECT_EQ(all[1], 11);
    EXPECT_EQ(all[2], 12);
    boot.barrier();
  }));
}

// Real processes: this one is rank 0, forked children are the others (they only touch
// sockets, then _exit with 0 on success).
TEST(TcpBootstrap, ForkedProcesses) {
  constexpr int kWorld = 3;
  constexpr int64_t kLen = 64;
  const int port = free_port();
  auto input = [](int r) {
    std::vector<float> v(kLen);
    for (int64_t i = 0; i < kLen; ++i)
      v[static_cast<size_t>(i)] = 0.5f * r + 0.25f * static_cast<float>(i);
    return v;
  };
  std::vector<float> want(kLen);
  for (int64_t i = 0; i < kLen; ++i) {
    float s = input(0)[static_cast<size_t>(i)];
    for (int r = 1; r < kWorld; ++r) s += input(r)[static_cast<size_t>(i)];
    want[static_cast<size_t>(i)] = s;
  }
  std::vector<pid_t> kids;
  for (int r = 1; r < kWorld; ++r) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int code = 1;
      try {
        TcpBootstrap boot(config(port, r, kWorld));
        TcpCommunicator c(boot);
        std::vector<float> v = input(r);
        c.all_reduce_sum(v.data(), kLen);
        c.barrier();
        code = v == want ? 0 : 2;
      } catch (...) {
        code = 3;
      }
      ::_exit(code);
    }
    kids.push_back(pid);
  }
  std::string error;
  try {
    TcpBootstrap boot(config(port, 0, kWorld));
    TcpCommunicator c(boot);
    std::vector<float> v = input(0);
    c.all_reduce_sum(v.data(), kLen);
    c.barrier();
    EXPECT_EQ(v, want);
  } catch (const std::exception& e) {
    error = e.what();
  }
  for (pid_t pid : kids) {
    int status = -1;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }
  EXPECT_EQ(error, "");
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(TcpBootstrap, MissingRankTimesOut) {
  const int port = free_port();
  expect_error([&] { TcpBootstrap b(config(port, 0, 3, kShortTimeout)); },
               "rank(s) 1, 2 of 3 did not connect");
  expect_error([&] { TcpBootstrap b(config(port, 1, 3, kShortTimeout)); },
               "could not connect to rank 0");
}

TEST(TcpBootstrap, PortInUseAndBadAddress) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  ASSERT_EQ(0, ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a));
  ASSERT_EQ(0, ::listen(fd, 1));
  socklen_t len = sizeof a;
  ASSERT_EQ(0, ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len));
  expect_error([&] { TcpBootstrap b(config(ntohs(a.sin_port), 0, 2, kShortTimeout)); },
               "port is in use");
  ::close(fd);

  BootstrapConfig c = config(free_port(), 1, 2, kShortTimeout);
  c.master_addr = "999.1.1.1";
  expect_error([&] { TcpBootstrap b(c); }, "bad master address '999.1.1.1'");
  c.master_addr = "";
  expect_error([&] { TcpBootstrap b(c); }, "bad master address");
  expect_error([&] { TcpBootstrap b(config(free_port(), 2, 2)); }, "outside the world");
}

TEST(TcpBootstrap, MismatchedCallsFailOnEveryRank) {
  auto errors = on_tcp_ranks(2, [](int r, TcpBootstrap& boot) {
    std::vector<uint8_t> in(r == 0 ? 8 : 4), out(16);
    boot.all_gather_bytes(in.data(), in.size(), out.data());
  });
  for (const auto& e : errors)
    EXPECT_NE(e.find("passed 4 bytes, rank 0 passed 8"), std::string::npos) << e;
  EXPECT_NE(errors[1].find("reported by rank 0"), std::string::npos) << errors[1];

  errors = on_tcp_ranks(3, [](int r, TcpBootstrap& boot) {
    float x = 1;
    if (r == 2)
      boot.broadcast_bytes(&x, 4, 0);
    else
      boot.barrier();
  });
  for (const auto& e : errors)
    EXPECT_NE(e.find("rank 2 called broadcast while rank 0 called barrier"), std::string::npos)
        << e;

  // all_to_all_v: rank 1 expects 2 elements from rank 0, which sends 1.
  errors = on_tcp_ranks(2, [](int r, TcpBootstrap& boot) {
    TcpCommunicator c(boot);
    const std::vector<float> send = {1, 2, 3};
    const std::vector<int64_t> sc =
        r == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{1, 1};
    const std::vector<int64_t> rc =
        r == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{2, 1};
    std::vector<float> recv(3);
    c.all_to_all_v(send.data(), sc.data(), recv.data(), rc.data());
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_NE(errors[1].find("rank 0 sends 4 bytes to rank 1, which expects 8"), std::string::npos)
      << errors[1];

  // World sizes that disagree are refused at the rendezvous.
  const int port = free_port();
  std::string e0, e1;
  std::thread t([&] {
    try {
      TcpBootstrap b(config(port, 1, 3, 2.0));
    } catch (const std::exception& e) {
      e1 = e.what();
    }
  });
  try {
    TcpBootstrap b(config(port, 0, 2, 2.0));
  } catch (const std::exception& e) {
    e0 = e.what();
  }
  t.join();
  EXPECT_NE(e0.find("rank 1 has world size 3, rank 0 has 2"), std::string::npos) << e0;
  EXPECT_NE(e1.find("rank 1 has world size 3"), std::string::npos) << e1;
}

TEST(TcpBootstrap, ExitedRankFailsTheOthers) {
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = on_tcp_ranks(3, [](int r, TcpBootstrap& boot) {
    if (r == 1) return;  // leaves: its destructor closes the socket
    boot.barrier();
  });
  EXPECT_EQ(errors[1], "");
  EXPECT_NE(errors[0].find("rank 1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("closed the connection"), std::string::npos) << errors[0];
  EXPECT_NE(errors[2].find("rank 0"), std::string::npos) << errors[2];
  // Detected from the closed socket, not by waiting for the timeout.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            kConnectTimeout / 2);
}

TEST(TcpBootstrap, ConfigFromEnvironment) {
  const char* names[] = {"K3_MASTER_ADDR", "MASTER_ADDR", "K3_MASTER_PORT",      "MASTER_PORT",
                         "K3_RANK",        "RANK",        "K3_WORLD_SIZE",       "WORLD_SIZE",
                         "K3_LOCAL_RANK",  "LOCAL_RANK",  "K3_BOOTSTRAP_TIMEOUT"};
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved.emplace_back(n, v);
    ::unsetenv(n);
  }
  ::setenv("MASTER_ADDR", "node0", 1);
  ::setenv("MASTER_PORT", "1234", 1);
  ::setenv("RANK", "3", 1);
  ::setenv("WORLD_SIZE", "8", 1);
  ::setenv("LOCAL_RANK", "3", 1);
  ::setenv("K3_RANK", "5", 1);  // the K3_ name wins
  ::setenv("K3_BOOTSTRAP_TIMEOUT", "7.5", 1);
  const BootstrapConfig c = BootstrapConfig::from_env();
  EXPECT_EQ(c.master_addr, "node0");
  EXPECT_EQ(c.master_port, 1234);
  EXPECT_EQ(c.rank, 5);
  EXPECT_EQ(c.world, 8);
  EXPECT_EQ(c.local_rank, 3);
  EXPECT_EQ(c.connect_timeout_s, 7.5);
  ::setenv("K3_WORLD_SIZE", "two", 1);
  expect_error([] { (void)BootstrapConfig::from_env(); }, "K3_WORLD_SIZE='two'");
  for (const char* n : names) ::unsetenv(n);
  for (const auto& [k, v] : saved) ::setenv(k.c_str(), v.c_str(), 1);
}

}  // namespace
}  // namespace k3
