// CUPTI activity tracing of kernels (kernel_trace.h).
#include "kernel_trace.h"

#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

#include "core/error.h"

namespace k3::bench {
namespace {

#define K3_CUPTI_CHECK(call)                                                \
  do {                                                                      \
    const CUptiResult r_ = (call);                                          \
    if (r_ != CUPTI_SUCCESS) {                                              \
      const char* s_ = nullptr;                                             \
      cuptiGetResultString(r_, &s_);                                        \
      ::k3::fail("CUPTI: ", #call, " failed: ", s_ ? s_ : "unknown error"); \
    }                                                                       \
  } while (0)

constexpr size_t kBufferBytes = 8u << 20;

// CUPTI hands buffers back on its own thread: the records go to one process-wide sink.
struct Sink {
  std::mutex mu;
  std::vector<KernelRecord> records;
};
Sink& sink() {
  static Sink s;
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                           std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<KernelRecord> got;
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    KernelRecord r;
    r.name = short_kernel_name(demangle(k->name));
    r.start_ns = k->start;
    r.end_ns = k->end;
    r.stream = k->streamId;
    r.grid = k->gridX * k->gridY * k->gridZ;
    r.block = k->blockX * k->blockY * k->blockZ;
    got.push_back(std::move(r));
  }
  std::free(buffer);
  Sink& s = sink();
  const std::lock_guard<std::mutex> lock(s.mu);
  s.records.insert(s.records.end(), got.begin(), got.end());
}

}  // namespace

std::string short_kernel_name(const std::string& demangled) {
  std::string d = demangled;
  for (size_t p; (p = d.find("(anonymous namespace)::")) != std::string::npos;) d.erase(p, 23);
  // Cut the parameter list: the first '(' outside template brackets.
  int depth = 0;
  size_t end = d.size();
  for (size_t i = 0; i < d.size(); ++i) {
    if (d[i] == '<') ++depth;
    if (d[i] == '>') --depth;
    if (d[i] == '(' && depth == 0) {
      end = i;
      break;
    }
  }
  std::string base = d.substr(0, end);
  if (base.rfind("void ", 0) == 0) base = base.substr(5);
  // Drop template arguments, then namespaces.
  std::string plain;
  depth = 0;
  for (const char c : base) {
    if (c == '<') ++depth;
    if (depth == 0) plain += c;
    if (c == '>') --depth;
  }
  const size_t colon = plain.rfind("::");
  if (colon != std::string::npos) plain = plain.substr(colon + 2);
  if (plain.find("skinny_gemm") != std::string::npos)
    plain += d.find("Mxfp4") != std::string::npos ? "<mxfp4>" : "<bf16>";
  return plain;
}

KernelTrace::KernelTrace() {
  K3_CUPTI_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
  K3_CUPTI_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
}

KernelTrace::~KernelTrace() {
  cuptiActivityFlushAll(1);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
}

void KernelTrace::clear() {
  K3_CUPTI_CHECK(cuptiActivityFlushAll(1));
  Sink& s = sink();
  const std::lock_guard<std::mutex> lock(s.mu);
  s.records.clear();
}

std::vector<KernelRecord> KernelTrace::take() {
  K3_CUPTI_CHECK(cuptiActivityFlushAll(1));
  Sink& s = sink();
  std::vector<KernelRecord> out;
  {
    const std::lock_guard<std::mutex> lock(s.mu);
    out.swap(s.records);
  }
  std::sort(out.begin(), out.end(),
            [](const KernelRecord& a, const KernelRecord& b) { return a.start_ns < b.start_ns; });
  return out;
}

void print_trace(const std::vector<KernelRecord>& ks, const std::string& title,
                 const std::string& marker, int from, int to) {
  if (ks.empty()) {
    std::printf("trace %s: no kernels recorded\n", title.c_str());
    return;
  }
  const uint64_t t0 = ks.front().start_ns;
  // Kernels in end order move the frontier (the latest end so far); idle = stretches with no
  // kernel running (starts past the frontier).
  std::vector<size_t> by_end(ks.size());
  for (size_t i = 0; i < ks.size(); ++i) by_end[i] = i;
  std::sort(by_end.begin(), by_end.end(),
            [&](size_t a, size_t b) { return ks[a].end_ns < ks[b].end_ns; });
  std::vector<double> frontier_us(ks.size(), 0.0);
  uint64_t front = t0;
  for (const size_t i : by_end) {
    if (ks[i].end_ns > front) frontier_us[i] = (ks[i].end_ns - front) * 1e-3;
    front = std::max(front, ks[i].end_ns);
  }
  double idle_us = 0;
  uint64_t reach = t0;  // in start order: the latest end among kernels started so far
  for (const KernelRecord& k : ks) {
    if (k.start_ns > reach) idle_us += (k.start_ns - reach) * 1e-3;
    reach = std::max(reach, k.end_ns);
  }
  const double span_us = (front - t0) * 1e-3;
  std::printf("\ntrace %s: %zu kernels, span %.3f ms, no kernel running %.3f ms\n", title.c_str(),
              ks.size(), span_us * 1e-3, idle_us * 1e-3);
  struct Agg {
    int n = 0;
    double dur = 0, front = 0;
  };
  std::map<std::string, Agg> agg;
  for (size_t i = 0; i < ks.size(); ++i) {
    Agg& a = agg[ks[i].name];
    ++a.n;
    a.dur += (ks[i].end_ns - ks[i].start_ns) * 1e-3;
    a.front += frontier_us[i];
  }
  std::vector<std::pair<std::string, Agg>> rows(agg.begin(), agg.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.front > b.second.front; });
  std::printf("%-34s %6s %12s %8s %12s %10s\n", "kernel", "count", "frontier ms", "%span",
              "sum dur ms", "mean us");
  for (const auto& [name, a] : rows)
    std::printf("%-34s %6d %12.3f %7.1f%% %12.3f %10.2f\n", name.c_str(), a.n, a.front * 1e-3,
                100.0 * a.front / span_us, a.dur * 1e-3, a.dur / a.n);
  // The stretch between two launches of the marker kernel.
  size_t lo = ks.size(), hi = ks.size();
  int seen = 0;
  for (size_t i = 0; i < ks.size(); ++i) {
    if (ks[i].name != marker) continue;
    if (seen == from) lo = i;
    if (seen == to) {
      hi = i;
      break;
    }
    ++seen;
  }
  if (lo >= ks.size()) return;
  std::printf("kernels from launch %d to launch %d of %s (us from its start):\n", from, to,
              marker.c_str());
  std::printf("%9s %9s %9s %9s %7s %7s  %s\n", "start", "end", "dur", "frontier", "grid", "block",
              "kernel (stream)");
  const uint64_t s0 = ks[lo].start_ns;
  for (size_t i = lo; i < hi && i < ks.size(); ++i) {
    const KernelRecord& k = ks[i];
    std::printf("%9.2f %9.2f %9.2f %9.2f %7d %7d  %s (%u)\n",
                (static_cast<double>(k.start_ns) - s0) * 1e-3,
                (static_cast<double>(k.end_ns) - s0) * 1e-3, (k.end_ns - k.start_ns) * 1e-3,
                frontier_us[i], k.grid, k.block, k.name.c_str(), k.stream);
  }
}

}  // namespace k3::bench
