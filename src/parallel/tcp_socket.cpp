// POSIX socket plumbing for the TCP bootstrap.
#include "parallel/tcp_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace k3::parallel::tcp {

namespace {

struct AddrList {
  addrinfo* head = nullptr;
  ~AddrList() {
    if (head) ::freeaddrinfo(head);
  }
};

void resolve(const std::string& addr, int port, AddrList& out) {
  // Digits and dots only is meant as an IPv4 address: reject a malformed one without DNS.
  const bool dotted = !addr.empty() && addr.find_first_not_of("0123456789.") == std::string::npos;
  in_addr v4{};
  K3_CHECK(!addr.empty() && (!dotted || ::inet_pton(AF_INET, addr.c_str(), &v4) == 1),
           "bootstrap: bad master address '", addr, "' (K3_MASTER_ADDR / MASTER_ADDR)");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string p = std::to_string(port);
  const int rc = ::getaddrinfo(addr.c_str(), p.c_str(), &hints, &out.head);
  K3_CHECK(rc == 0 && out.head, "bootstrap: bad master address '", addr,
           "' (K3_MASTER_ADDR / MASTER_ADDR): ", rc ? gai_strerror(rc) : "no address");
}

void set_nodelay(int fd) {
  int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// One non-blocking connect bounded by the deadline; the socket, or -1 with `err` set.
int try_connect(const addrinfo* a, Clock::time_point deadline, int& err) {
  const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
  if (fd < 0) {
    err = errno;
    return -1;
  }
  const int flags = ::fcntl(fd, F_GETFL, 0);
  (void)::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
  if (rc < 0 && errno == EINPROGRESS) {
    if (!wait_fd(fd, POLLOUT, deadline)) {
      err = ETIMEDOUT;
      ::close(fd);
      return -1;
    }
    socklen_t len = sizeof err;
    err = 0;
    (void)::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    rc = err ? -1 : 0;
  } else if (rc < 0) {
    err = errno;
  }
  if (rc < 0) {
    ::close(fd);
    return -1;
  }
  (void)::fcntl(fd, F_SETFL, flags);
  set_nodelay(fd);
  return fd;
}

}  // namespace

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6));
}

std::string errno_text(int e) {
  return std::string(std::strerror(e));
}

bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) fail("bootstrap: poll failed: ", errno_text(errno));
  }
}

void send_all(int fd, const void* data, size_t n, const std::string& who) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t s = ::send(fd, p, n, MSG_NOSIGNAL);
    if (s < 0) {
      if (errno == EINTR) continue;
      fail("bootstrap: sending to ", who, " failed (", errno_text(errno),
           "): that process probably failed or exited");
    }
    p += s;
    n -= static_cast<size_t>(s);
  }
}

void recv_all(int fd, void* data, size_t n, Clock::time_point deadline, const std::string& who) {
  uint8_t* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    if (!wait_fd(fd, POLLIN, deadline))
      fail("bootstrap: timed out waiting for ", who, " (is it stuck or in another collective?)");
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r == 0) fail("bootstrap: ", who, " closed the connection (that process failed or exited)");
    if (r < 0) {
      if (errno == EINTR) continue;
      fail("bootstrap: receiving from ", who, " failed: ", errno_text(errno));
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

void check_address(const std::string& addr, int port) {
  AddrList a;
  resolve(addr, port, a);
}

int connect_until(const std::string& addr, int port, Clock::time_point deadline, int& err) {
  AddrList addrs;
  resolve(addr, port, addrs);
  for (;;) {
    for (const addrinfo* a = addrs.head; a; a = a->ai_next) {
      const int fd = try_connect(a, deadline, err);
      if (fd >= 0) return fd;
    }
    if (Clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // not listening yet
  }
}

int listen_on(const std::string& addr, int port, int backlog) {
  // Every interface (like torchrun), so a hostname that resolves to another local interface
  // still works; IPv6 sockets also take IPv4 peers (dual stack).
  AddrList addrs;
  resolve(addr, port, addrs);
  const int family = addrs.head->ai_family;
  int fd = ::socket(family, SOCK_STREAM, 0);
  K3_CHECK(fd >= 0, "bootstrap: socket() failed: ", errno_text(errno));
  int one = 1;
  (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // reuse after TIME_WAIT
  sockaddr_storage any{};
  socklen_t len = 0;
  if (family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&any);
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_any;
    a->sin6_port = htons(static_cast<uint16_t>(port));
    len = sizeof *a;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&any);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_ANY);
    a->sin_port = htons(static_cast<uint16_t>(port));
    len = sizeof *a;
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&any), len) != 0 || ::listen(fd, backlog) != 0) {
    const int e = errno;
    close_fd(fd);
    if (e == EADDRINUSE)
      fail("bootstrap: rank 0 cannot listen on port ", port,
           ": the port is in use (another job? pick another K3_MASTER_PORT)");
    fail("bootstrap: rank 0 cannot listen on port ", port, ": ", errno_text(e));
  }
  return fd;
}

int accept_peer(int listen_fd) {
  const int fd = ::accept(listen_fd, nullptr, nullptr);
  if (fd >= 0) set_nodelay(fd);
  return fd;
}

}  // namespace k3::parallel::tcp
