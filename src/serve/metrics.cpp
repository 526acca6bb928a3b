#include "serve/metrics.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "core/error.h"

namespace k3::serve {
namespace {

// Prometheus floats: shortest round-trip form, +Inf spelled as the format wants.
std::string num(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  // Whole numbers as "10.0" (what prometheus_client writes), others in the shortest form that
  // reads back as the same double ("0.1", not "0.10000000000000001").
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.1f", v);
    return buf;
  }
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

void header(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out.append("# HELP ").append(name).append(" ").append(help).append("\n");
  out.append("# TYPE ").append(name).append(" ").append(type).append("\n");
}

void sample(std::string& out, std::string_view name, double v) {
  out.append(name).append(" ").append(num(v)).append("\n");
}

// Counts stay integers: exact at any size and easier to read than 12.0.
void count(std::string& out, std::string_view name, uint64_t v) {
  out.append(name).append(" ").append(std::to_string(v)).append("\n");
}

// Buckets in seconds. The CPU tiny model decodes in milliseconds and a real deployment in tens of
// milliseconds, so both ends are covered.
const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,
                                          0.5,   0.75,  1.0,  2.5,  5.0,  7.5,  10.0, 20.0, 40.0};
const std::vector<double> kTpotBuckets = {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025,
                                          0.05,  0.075,  0.1,   0.15,   0.2,  0.3,
                                          0.4,   0.5,    0.75,  1.0,    2.5};
const std::vector<double> kE2eBuckets = {0.01, 0.05, 0.1,  0.3,  0.5,   0.8,  1.0,
                                         1.5,  2.0,  2.5,  5.0,  10.0,  15.0, 20.0,
                                         30.0, 40.0, 50.0, 60.0, 120.0, 240.0};

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {
  for (size_t i = 1; i < bounds_.size(); ++i)
    K3_CHECK(bounds_[i - 1] < bounds_[i], "histogram bounds must ascend");
}

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;  // le: a value on a bound counts in it
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, std::string_view name) const {
  uint64_t cum = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cum += counts_[i];
    const double le = i < bounds_.size() ? bounds_[i] : INFINITY;
    out.append(name).append("_bucket{le=\"").append(num(le)).append("\"} ");
    out.append(std::to_string(cum)).append("\n");
  }
  sample(out, std::string(name) + "_sum", sum_);
  out.append(name).append("_count ").append(std::to_string(count_)).append("\n");
}

Metrics::Metrics() : ttft_(kTtftBuckets), tpot_(kTpotBuckets), e2e_(kE2eBuckets) {
  // Listed up front so every series exists (at 0) before the first request.
  for (const char* r : {"stop", "length", "abort", "error"}) finished_[r] = 0;
}

void Metrics::add_prompt_tokens(int64_t n) {
  std::lock_guard lock(mu_);
  prompt_tokens_ += static_cast<uint64_t>(n);
}
void Metrics::add_generation_tokens(int64_t n) {
  std::lock_guard lock(mu_);
  generation_tokens_ += static_cast<uint64_t>(n);
}
void Metrics::observe_ttft(double s) {
  std::lock_guard lock(mu_);
  ttft_.observe(s);
}
void Metrics::observe_tpot(double s) {
  std::lock_guard lock(mu_);
  tpot_.observe(s);
}
void Metrics::observe_e2e(double s) {
  std::lock_guard lock(mu_);
  e2e_.observe(s);
}
void Metrics::set_queue(int64_t running, int64_t waiting) {
  std::lock_guard lock(mu_);
  running_ = running;
  waiting_ = waiting;
}
void Metrics::add_finished(std::string_view reason) {
  std::lock_guard lock(mu_);
  auto it = finished_.find(reason);
  if (it == finished_.end()) it = finished_.emplace(std::string(reason), 0).first;
  ++it->second;
}
void Metrics::add_spec_decode(int64_t draft_tokens, int64_t accepted) {
  std::lock_guard lock(mu_);
  ++spec_drafts_;
  spec_draft_tokens_ += static_cast<uint64_t>(draft_tokens);
  spec_accepted_ += static_cast<uint64_t>(accepted);
}
int64_t Metrics::running() const {
  std::lock_guard lock(mu_);
  return running_;
}

std::string Metrics::render() const {
  std::lock_guard lock(mu_);
  std::string out;
  header(out, "k3_time_to_first_token_seconds", "histogram",
         "Time from request arrival to its first generated token.");
  ttft_.render(out, "k3_time_to_first_token_seconds");
  header(out, "k3_time_per_output_token_seconds", "histogram",
         "Mean time between generated tokens of a request, after the first.");
  tpot_.render(out, "k3_time_per_output_token_seconds");
  header(out, "k3_e2e_request_latency_seconds", "histogram",
         "Time from request arrival to its last token.");
  e2e_.render(out, "k3_e2e_request_latency_seconds");
  header(out, "k3_prompt_tokens_total", "counter", "Prompt tokens prefilled.");
  count(out, "k3_prompt_tokens_total", prompt_tokens_);
  header(out, "k3_generation_tokens_total", "counter", "Tokens generated.");
  count(out, "k3_generation_tokens_total", generation_tokens_);
  // Mean acceptance length = 1 + accepted / drafts; acceptance rate = accepted / draft tokens.
  header(out, "k3_spec_decode_num_drafts_total", "counter",
         "Speculative verify steps that carried drafted tokens.");
  count(out, "k3_spec_decode_num_drafts_total", spec_drafts_);
  header(out, "k3_spec_decode_num_draft_tokens_total", "counter", "Drafted tokens verified.");
  count(out, "k3_spec_decode_num_draft_tokens_total", spec_draft_tokens_);
  header(out, "k3_spec_decode_num_accepted_tokens_total", "counter",
         "Drafted tokens accepted by verification.");
  count(out, "k3_spec_decode_num_accepted_tokens_total", spec_accepted_);
  header(out, "k3_requests_running", "gauge", "Requests in the decode batch.");
  out.append("k3_requests_running ").append(std::to_string(running_)).append("\n");
  header(out, "k3_requests_waiting", "gauge", "Requests queued for a decode slot.");
  out.append("k3_requests_waiting ").append(std::to_string(waiting_)).append("\n");
  header(out, "k3_request_success_total", "counter", "Finished requests by finish reason.");
  for (const auto& [reason, n] : finished_)
    out.append("k3_request_success_total{finished_reason=\"")
        .append(reason)
        .append("\"} ")
        .append(std::to_string(n))
        .append("\n");
  return out;
}

}  // namespace k3::serve
