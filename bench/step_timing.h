// Timing and checking one decode step of the bench rank (k3_bench_step): CUDA-graph replays
// from a cold L2, and the paths' logits against each other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/backbone.h"
#include "cuda/device_buffer.h"

namespace k3::bench {

// The H200 read ceiling the byte floors are quoted at (TB/s).
constexpr double kPeakTBps = 4.3;

// The median of v (the upper middle for an even count).
double median_ms(std::vector<double> v);

// Median over replays of one step of `path`, L2 flushed before each, events around the step.
// Untimed replays first: runs 14-15 timed a path's first measurement after the other path ~5%
// slower than the same defaults timed again a moment later.
double time_step(cuda::CudaBackbone& bb, const std::vector<int32_t>& slots,
                 const std::vector<int32_t>& toks, cuda::StepPath path, int replays,
                 cuda::DeviceBuffer<uint8_t>& flush, bool keep_kda = false);

// Every row's slot back to a ctx-long context (caches and positions) before a timing.
void rewind(cuda::CudaBackbone& bb, int rows, int64_t ctx);

// Every logit of the step's first `rows` rows (vocabulary V) is finite.
bool finite_logits(cuda::CudaBackbone& bb, int rows, size_t V);

// Logits of the two paths on the same state and tokens (the speed numbers' check): rel L2
// between the paths, and the larger of each path's distance to its own second run (a graph
// replayed on the same inputs must give the same bits; the paths launch the same GEMMs, so they
// should agree too). The KDA state is saved before the first step and restored before each
// later one (assume_context refills the caches and positions only).
struct PathsCheck {
  double paths = 0;   // stock vs specialized
  double replay = 0;  // max over the paths of run vs rerun
};

PathsCheck paths_rel_l2(cuda::CudaBackbone& bb, int rows, int64_t ctx, size_t V,
                        const std::vector<int32_t>& slots, const std::vector<int32_t>& toks);

}  // namespace k3::bench
