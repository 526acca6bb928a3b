// Prometheus text exposition (format 0.0.4) of the serving metrics: latency histograms (TTFT,
// TPOT, end-to-end), token counters, running / waiting gauges and finished requests by reason.
// Names follow vLLM's (k3_ instead of vllm:) so existing dashboards map over. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace k3::serve {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);  // ascending; +Inf is implicit
  void observe(double v);
  // Appends the _bucket / _sum / _count lines for `name`.
  void render(std::string& out, std::string_view name) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // [bounds + 1], not cumulative
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();
  void add_prompt_tokens(int64_t n);
  void add_generation_tokens(int64_t n);
  void observe_ttft(double seconds);
  void observe_tpot(double seconds);
  void observe_e2e(double seconds);
  void set_queue(int64_t running, int64_t waiting);
  // finished_reason: stop | length | abort | error
  void add_finished(std::string_view finished_reason);
  // Speculative decoding, per verify step with drafts: one draft of `draft_tokens` tokens, of
  // which `accepted` were accepted (vLLM's spec_decode_num_* counters).
  void add_spec_decode(int64_t draft_tokens, int64_t accepted);

  std::string render() const;
  int64_t running() const;

 private:
  mutable std::mutex mu_;
  Histogram ttft_, tpot_, e2e_;
  uint64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  uint64_t spec_drafts_ = 0, spec_draft_tokens_ = 0, spec_accepted_ = 0;
  int64_t running_ = 0, waiting_ = 0;
  std::map<std::string, uint64_t, std::less<>> finished_;
};

}  // namespace k3::serve
