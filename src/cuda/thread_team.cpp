#include "cuda/thread_team.h"

namespace k3::cuda {

ThreadTeam::ThreadTeam(int n, std::function<void()> on_error)
    : n_(n), on_error_(std::move(on_error)) {
  for (int i = 0; i < n; ++i) threads_.emplace_back([this, i] { loop(i); });
}

ThreadTeam::~ThreadTeam() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadTeam::run(const std::function<void(int)>& fn) {
  std::unique_lock lock(mu_);
  fn_ = &fn;
  ++generation_;
  pending_ = n_;
  first_error_ = nullptr;
  cv_.notify_all();
  done_.wait(lock, [&] { return pending_ == 0; });
  if (first_error_) std::rethrow_exception(first_error_);
}

void ThreadTeam::loop(int i) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* fn = nullptr;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
    }
    std::exception_ptr err;
    try {
      (*fn)(i);
    } catch (...) {
      err = std::current_exception();
    }
    if (err) {
      bool first = false;
      {
        std::lock_guard lock(mu_);
        first = !first_error_;
        if (first) first_error_ = err;
      }
      if (first && on_error_) on_error_();
    }
    std::lock_guard lock(mu_);
    if (--pending_ == 0) done_.notify_all();
  }
}

}  // namespace k3::cuda
