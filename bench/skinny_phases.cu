#include "skinny_phases.h"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "cuda/check.h"
#include "cuda/device_buffer.h"

namespace k3::bench {
namespace {

double median_of(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

std::string skinny_phases(const cuda::LinearPlan& p,
                          const std::function<void(long long*, cudaStream_t)>& launch,
                          cudaStream_t stream, void* scratch, size_t scratch_bytes, int runs) {
  using namespace cuda;
  // Durations between consecutive clock64 stamps, in cycles.
  struct Phase {
    const char* name;
    SkinnyStamp from, to;
  };
  const Phase phases[] = {{"wait", kStampEntry, kStampWaited},
                          {"x", kStampWaited, kStampXStaged},
                          {"loop", kStampXStaged, kStampLooped},
                          {"reduce", kStampLooped, kStampReduced},
                          {"csync", kStampReduced, kStampClusterSynced},
                          {"csum", kStampClusterSynced, kStampSummed},
                          {"exit", kStampSummed, kStampEnd}};
  constexpr int kPhases = sizeof(phases) / sizeof(phases[0]);
  const int64_t ctas = p.grid_x();
  DeviceBuffer<long long> d(static_cast<size_t>(ctas) * kSkinnyStamps);
  std::vector<std::vector<double>> cycles(kPhases);
  std::vector<double> spans, skews;
  double ns_sum = 0, cycle_sum = 0;  // clock calibration: globaltimer ns per clock64 cycle
  for (int r = 0; r < runs; ++r) {
    K3_CUDA_CHECK(cudaMemsetAsync(scratch, r & 0xff, scratch_bytes, stream));
    K3_CUDA_CHECK(cudaMemsetAsync(d.data(), 0, d.size() * sizeof(long long), stream));
    launch(d.data(), stream);
    K3_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<long long> h = to_host<long long>(d);
    long long first = 0, last_start = 0, last_end = 0;
    for (int64_t c = 0; c < ctas; ++c) {
      const long long* s = h.data() + c * kSkinnyStamps;
      for (int i = 0; i < kPhases; ++i)
        cycles[i].push_back(static_cast<double>(s[phases[i].to] - s[phases[i].from]));
      ns_sum += static_cast<double>(s[kStampGlobalEnd] - s[kStampGlobalEntry]);
      cycle_sum += static_cast<double>(s[kStampEnd] - s[kStampEntry]);
      if (c == 0 || s[kStampGlobalEntry] < first) first = s[kStampGlobalEntry];
      last_start = std::max(last_start, s[kStampGlobalEntry]);
      last_end = std::max(last_end, s[kStampGlobalEnd]);
    }
    spans.push_back(1e-3 * static_cast<double>(last_end - first));
    skews.push_back(1e-3 * static_cast<double>(last_start - first));
  }
  const double us_per_cycle = cycle_sum > 0 ? 1e-3 * ns_sum / cycle_sum : 0.0;
  std::string out;
  char buf[96];
  for (int i = 0; i < kPhases; ++i) {
    const double med = median_of(cycles[i]) * us_per_cycle;
    const double mx = *std::max_element(cycles[i].begin(), cycles[i].end()) * us_per_cycle;
    std::snprintf(buf, sizeof buf, "%s %.2f/%.2f  ", phases[i].name, med, mx);
    out += buf;
  }
  std::snprintf(buf, sizeof buf, "| span %.2f  start spread %.2f  (%.2f GHz)", median_of(spans),
                median_of(skews), us_per_cycle > 0 ? 1e-3 / us_per_cycle : 0.0);
  return out + buf;
}

}  // namespace k3::bench
