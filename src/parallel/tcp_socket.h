// Blocking TCP helpers for the bootstrap (parallel/tcp_bootstrap.h): every wait has a deadline
// so a missing peer becomes an error, and sends use MSG_NOSIGNAL so a dead peer is an error
// (EPIPE) rather than a SIGPIPE. `who` names the peer in error messages.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace k3::parallel::tcp {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double seconds);
std::string errno_text(int e);

// Waits until fd is readable (POLLIN) or writable (POLLOUT); false when the deadline passes.
bool wait_fd(int fd, short events, Clock::time_point deadline);
void send_all(int fd, const void* data, size_t n, const std::string& who);
void recv_all(int fd, void* data, size_t n, Clock::time_point deadline, const std::string& who);
void close_fd(int& fd);  // closes when >= 0, then sets -1

// Fails with a clear message unless addr resolves (a malformed dotted IPv4 address fails
// without a DNS query).
void check_address(const std::string& addr, int port);
// Connects to addr:port, retrying until the deadline (the listener may start later). Returns
// the socket (TCP_NODELAY), or -1 with the last errno in `err` when the deadline passed.
int connect_until(const std::string& addr, int port, Clock::time_point deadline, int& err);
// A listening socket on `port` of every interface of addr's address family. A port in use
// fails with a message saying so.
int listen_on(const std::string& addr, int port, int backlog);
// accept() with TCP_NODELAY; -1 on a failed accept.
int accept_peer(int listen_fd);

}  // namespace k3::parallel::tcp
