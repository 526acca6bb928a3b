// Where a tiled skinny GEMM launch spends its time (k3_bench_ops --phases): the kernel's phase
// stamps (linear_plan.h, SkinnyStamp) of a few cold launches, as per-phase durations.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <string>

#include "cuda/linear_plan.h"

namespace k3::bench {

// launch(stamps, stream): one launch of plan p writing its stamps ([p.grid_x()][kSkinnyStamps]
// int64, device). Each of `runs` launches follows a write of `scratch` (evicting L2), as a
// decode step's weights are cold. Returns one line: for each phase the median and the max over
// CTAs (all runs) in us, then the launch's span and the spread of its CTAs' start times.
std::string skinny_phases(const cuda::LinearPlan& p,
                          const std::function<void(long long*, cudaStream_t)>& launch,
                          cudaStream_t stream, void* scratch, size_t scratch_bytes, int runs = 5);

}  // namespace k3::bench
