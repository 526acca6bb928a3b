// The specialized path's tuning choices timed one by one (k3_bench_step without --no-flips).
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/backbone.h"
#include "cuda/device_buffer.h"
#include "step_args.h"

namespace k3::bench {

// The specialized path with one SpecializedTuning choice flipped at a time. The GPU drifts by
// a few percent over a run, so each flip is timed between two timings of the defaults and judged
// against their mean; then every flip that gained over 1% is timed combined, interleaved with
// the defaults again.
void time_tuning_flips(cuda::CudaBackbone& bb, const StepArgs& a, int rows, int64_t ctx,
                       double floor_ms, const std::vector<int32_t>& slots,
                       const std::vector<int32_t>& toks, cuda::DeviceBuffer<uint8_t>& flush);

}  // namespace k3::bench
