// A fixed team of threads that run one function together: run(fn) calls fn(i) on thread i of
// every thread and waits. The multi-rank backbone keeps one thread per rank this way, so each
// rank's CUDA work and collectives stay on its own thread from step to step.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace k3::cuda {

class ThreadTeam {
 public:
  // on_error: called once, from the first thread whose fn throws, before it reports (so it can
  // unblock the others, e.g. abort their collectives).
  ThreadTeam(int n, std::function<void()> on_error);
  ~ThreadTeam();
  ThreadTeam(const ThreadTeam&) = delete;
  ThreadTeam& operator=(const ThreadTeam&) = delete;

  // Runs fn(i) on every thread and waits for all; rethrows the first failure (not the ones it
  // caused in the others).
  void run(const std::function<void(int)>& fn);

 private:
  void loop(int i);

  int n_;
  std::function<void()> on_error_;
  std::mutex mu_;
  std::condition_variable cv_, done_;
  const std::function<void(int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr first_error_;
  std::vector<std::thread> threads_;
};

}  // namespace k3::cuda
