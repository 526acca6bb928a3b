// Whether the client of an HTTP request is still there. cpp-httplib 0.11 does not hand its
// handlers the connection's socket, so it is found once by its address pair and then probed
// with a non-blocking peek: 0 bytes means the peer closed, ECONNRESET that it reset. This lets a
// request that has sent nothing yet (a non-streaming one, or a stream still in prefill) be
// cancelled as soon as its client goes away, instead of at its first failed write.
#pragma once

#include <string>

namespace k3::serve {

class PeerWatch {
 public:
  PeerWatch() = default;
  // The connected socket with this local and remote address (numeric host, port).
  PeerWatch(const std::string& local_addr, int local_port, const std::string& remote_addr,
            int remote_port);
  // True once the client closed or reset the connection. Without a socket (not found): false,
  // and a failed write is the only signal.
  bool closed() const;
  bool found() const { return fd_ >= 0; }

 private:
  int fd_ = -1;  // not owned: httplib closes it after the handler returns
};

}  // namespace k3::serve
