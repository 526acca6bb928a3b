#include "attn_harness.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/numeric.h"
#include "cuda/check.h"
#include "cuda/linear_plan.h"

namespace k3::bench {
namespace {

constexpr double kPeakTBps = 4.3;
constexpr double kColdBytes = 2.2 * 60e6;
constexpr int kReplays = 50;
constexpr int kMaxCopies = 1024;

std::vector<Result> g_results;

// GB/s = bytes / us; %curve against h200_read_curve_tbps(bytes).
void print(const Result& r, bool table) {
  const double gbps = r.bytes / (r.us * 1e-6) / 1e9;
  const double curve = cuda::h200_read_curve_tbps(r.bytes) * 1e3;
  std::printf(table ? "%-6s %-22s %4d %9.2f %7.0f %6.1f %6.1f  %s%s\n"
                    : "%-6s %-22s rows=%-3d %9.2f us  %7.1f GB/s  %5.1f%% of 4.3T  %5.1f%% of "
                      "curve  %s%s\n",
              r.kernel.c_str(), r.shape.c_str(), r.rows, r.us, gbps, 100 * gbps / (kPeakTBps * 1e3),
              100 * gbps / curve, r.check.c_str(), r.warm ? (table ? " warm" : " [warm]") : "");
  std::fflush(stdout);
}

}  // namespace

int copies_for(double bytes_per_copy) {
  return std::clamp(static_cast<int>(std::ceil(kColdBytes / bytes_per_copy)), 1, kMaxCopies);
}

Timer::Timer() {
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking));
  K3_CUDA_CHECK(cudaEventCreate(&a_));
  K3_CUDA_CHECK(cudaEventCreate(&b_));
}

double Timer::batched_us(const std::function<void(int, cudaStream_t)>& enqueue, int R) {
  enqueue(0, st_);  // eager warm-up
  K3_CUDA_CHECK(cudaStreamSynchronize(st_));
  cudaGraph_t g;
  cudaGraphExec_t e;
  K3_CUDA_CHECK(cudaStreamBeginCapture(st_, cudaStreamCaptureModeGlobal));
  for (int c = 0; c < R; ++c) enqueue(c, st_);
  K3_CUDA_CHECK(cudaStreamEndCapture(st_, &g));
  K3_CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
  K3_CUDA_CHECK(cudaGraphDestroy(g));
  std::vector<double> t;
  for (int i = 0; i < kReplays + 3; ++i) {
    K3_CUDA_CHECK(cudaEventRecord(a_, st_));
    K3_CUDA_CHECK(cudaGraphLaunch(e, st_));
    K3_CUDA_CHECK(cudaEventRecord(b_, st_));
    K3_CUDA_CHECK(cudaEventSynchronize(b_));
    float ms = 0;
    K3_CUDA_CHECK(cudaEventElapsedTime(&ms, a_, b_));
    if (i >= 3) t.push_back(1000.0 * ms / R);
  }
  K3_CUDA_CHECK(cudaGraphExecDestroy(e));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];  // median
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
  std::printf("\n%-6s %-22s %4s %9s %7s %6s %6s  %s\n", "kernel", "shape", "rows", "us", "GB/s",
              "%4.3T", "%curve", "check");
  for (const auto& r : g_results) print(r, true);
}

}  // namespace k3::bench
