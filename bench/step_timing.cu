// Timing and checking one decode step of the bench rank (step_timing.h).
#include "step_timing.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cuda/check.h"

namespace k3::bench {

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double time_step(cuda::CudaBackbone& bb, const std::vector<int32_t>& slots,
                 const std::vector<int32_t>& toks, cuda::StepPath path, int replays,
                 cuda::DeviceBuffer<uint8_t>& flush, bool keep_kda) {
  constexpr int kWarmReplays = 6;
  cudaEvent_t e0, e1;
  K3_CUDA_CHECK(cudaEventCreate(&e0));
  K3_CUDA_CHECK(cudaEventCreate(&e1));
  bb.step(slots, toks, path, keep_kda);  // eager on first use (attributes, plans) or replay
  for (int i = 0; i < kWarmReplays; ++i) bb.step(slots, toks, path, keep_kda);  // captured
  std::vector<double> ms;
  for (int i = 0; i < replays; ++i) {
    flush.fill_bytes(i & 0xff, bb.stream());
    K3_CUDA_CHECK(cudaEventRecord(e0, bb.stream()));
    bb.step(slots, toks, path, keep_kda);
    K3_CUDA_CHECK(cudaEventRecord(e1, bb.stream()));
    K3_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    K3_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  K3_CUDA_CHECK(cudaEventDestroy(e0));
  K3_CUDA_CHECK(cudaEventDestroy(e1));
  return median_ms(ms);
}

void rewind(cuda::CudaBackbone& bb, int rows, int64_t ctx) {
  for (int r = 0; r < rows; ++r) bb.assume_context(r, ctx);
}

bool finite_logits(cuda::CudaBackbone& bb, int rows, size_t V) {
  std::vector<float> logits(V * static_cast<size_t>(rows));
  bb.logits_to_host(rows, logits.data());
  return std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); });
}

PathsCheck paths_rel_l2(cuda::CudaBackbone& bb, int rows, int64_t ctx, size_t V,
                        const std::vector<int32_t>& slots, const std::vector<int32_t>& toks) {
  bb.reserve_snapshots(1);
  for (int r = 0; r < rows; ++r) {
    bb.assume_context(r, ctx);
    bb.save_kda(r, 0);
  }
  const auto run = [&](cuda::StepPath path, bool restore) {
    std::vector<float> out(V * rows);
    for (int r = 0; r < rows && restore; ++r) {
      bb.assume_context(r, ctx);
      bb.restore_kda(r, 0);
    }
    bb.step(slots, toks, path);
    bb.logits_to_host(rows, out.data());
    return out;
  };
  const auto rel = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (static_cast<double>(b[i]) - a[i]) * (static_cast<double>(b[i]) - a[i]);
      den += static_cast<double>(a[i]) * a[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
  };
  const auto stock = run(cuda::StepPath::Stock, false);
  const auto stock2 = run(cuda::StepPath::Stock, true);
  const auto spec = run(cuda::StepPath::Specialized, true);
  const auto spec2 = run(cuda::StepPath::Specialized, true);
  return {rel(stock, spec), std::max(rel(stock, stock2), rel(spec, spec2))};
}

}  // namespace k3::bench
