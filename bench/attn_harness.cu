#include "attn_harness.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/numeric.h"
#include "cuda/check.h"
#include "cuda/linear_plan.h"
#include "graph_timing.h"
#include "read_curve.h"

namespace k3::bench {
namespace {

constexpr double kPeakTBps = 4.3;
constexpr double kColdBytes = 2.2 * 60e6;
constexpr int kReplays = 50;
constexpr int kMaxCopies = 1024;

std::vector<Result> g_results;
ReadCurve g_card;  // this GPU's read curve (measure_card_curve)

// GB/s = bytes / us; %curve against h200_read_curve_tbps(bytes), %card against this GPU's.
void print(const Result& r, bool table) {
  const double gbps = r.bytes / (r.us * 1e-6) / 1e9;
  const double curve = cuda::h200_read_curve_tbps(r.bytes) * 1e3;
  std::printf(table ? "%-6s %-22s %4d %9.2f %7.0f %6.1f %6.1f %6.1f  %s%s\n"
                    : "%-6s %-22s rows=%-3d %9.2f us  %7.1f GB/s  %5.1f%% of 4.3T  %5.1f%% of "
                      "curve  %5.1f%% of card  %s%s\n",
              r.kernel.c_str(), r.shape.c_str(), r.rows, r.us, gbps, 100 * gbps / (kPeakTBps * 1e3),
              100 * gbps / curve, g_card.percent(gbps, r.bytes), r.check.c_str(),
              r.warm ? (table ? " warm" : " [warm]") : "");
  std::fflush(stdout);
}

}  // namespace

int copies_for(double bytes_per_copy) {
  return std::clamp(static_cast<int>(std::ceil(kColdBytes / bytes_per_copy)), 1, kMaxCopies);
}

Timer::Timer() {
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking));
}

double Timer::batched_us(const std::function<void(int, cudaStream_t)>& enqueue, int R) {
  return graph_batched_us(enqueue, R, st_, kReplays);
}

void measure_card_curve(cudaStream_t stream) {
  g_card = ReadCurve::measure(stream);
  g_card.print();
}

cuda::DeviceBuffer<int32_t> run_page_tables(size_t runs, int ppr) {
  std::vector<int32_t> bt(runs * ppr);  // [runs][ppr]
  for (size_t b = 0; b < runs; ++b)
    for (int p = 0; p < ppr; ++p) bt[b * ppr + p] = static_cast<int32_t>(b * ppr + p);
  return cuda::to_device<int32_t>(bt);
}

std::vector<uint16_t> random_bf16(Rng& rng, size_t n, float scale) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16(scale * rng.normal());
  return v;
}

std::vector<float> floats(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_float(b[i]);
  return f;
}

double maxrel(const float* got, const double* ref, size_t n) {
  double num = 0, ss = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - ref[i]);
    num = std::isfinite(d) ? std::max(num, d) : INFINITY;
    ss += ref[i] * ref[i];
  }
  return num / std::sqrt(ss / static_cast<double>(n) + 1e-300);
}

std::string fmt(const char* f, double a, double b) {
  char s[96];
  std::snprintf(s, sizeof s, f, a, b);
  return s;
}

void record(Result r) {
  print(r, false);
  g_results.push_back(std::move(r));
}

void print_table() {
  std::printf("\n%-6s %-22s %4s %9s %7s %6s %6s %6s  %s\n", "kernel", "shape", "rows", "us", "GB/s",
              "%4.3T", "%curve", "%card", "check");
  for (const auto& r : g_results) print(r, true);
}

}  // namespace k3::bench
