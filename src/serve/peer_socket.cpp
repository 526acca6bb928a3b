#include "serve/peer_socket.h"

#include <dirent.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>

namespace k3::serve {
namespace {

// httplib reports addresses through getnameinfo(NI_NUMERICHOST), so the same call here gives
// strings that compare equal.
bool endpoint(const sockaddr_storage& a, socklen_t len, std::string& host, int& port) {
  char h[NI_MAXHOST], s[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, h, sizeof h, s, sizeof s,
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  host = h;
  port = std::atoi(s);
  return true;
}

bool matches(int fd, const std::string& la, int lp, const std::string& ra, int rp) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  std::string host;
  int port = -1;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return false;
  if (!endpoint(a, len, host, port) || host != ra || port != rp) return false;
  len = sizeof a;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return false;
  return endpoint(a, len, host, port) && host == la && port == lp;
}

}  // namespace

PeerWatch::PeerWatch(const std::string& local_addr, int local_port, const std::string& remote_addr,
                     int remote_port) {
  if (local_port <= 0 || remote_port <= 0) return;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return;
  const int self = dirfd(d);
  while (const dirent* e = readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == self) continue;
    if (matches(static_cast<int>(fd), local_addr, local_port, remote_addr, remote_port)) {
      fd_ = static_cast<int>(fd);
      break;
    }
  }
  closedir(d);
}

bool PeerWatch::closed() const {
  if (fd_ < 0) return false;
  char c;
  const ssize_t n = recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) return true;  // orderly shutdown by the client
  if (n > 0) return false;  // a pipelined next request: still connected
  return !(errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
}

}  // namespace k3::serve
