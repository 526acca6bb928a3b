// Helpers of the GEMM planner's host tests (tests/cuda_host): the candidate list on an H200's
// explicit limits, and scopes that set a process-wide planner switch for one test.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/linear_plan.h"

namespace k3::plan_test {

// The planner's candidates, best first, on the default DeviceLimits (no device query).
inline std::vector<cuda::LinearPlan> candidates(cuda::LinearWeight w, int m, int64_t n, int64_t k,
                                                int groups = 1) {
  return cuda::linear_candidates(w, m, n, k, groups, cuda::DeviceLimits{}, nullptr);
}

// Restores batch invariance after a test that sets it.
struct InvariantScope {
  bool was = cuda::batch_invariant();
  explicit InvariantScope(bool on) { cuda::set_batch_invariant(on); }
  ~InvariantScope() { cuda::set_batch_invariant(was); }
};

// Sets whether the warpgroup tilings are offered, for one scope.
struct WgmmaScope {
  bool was = cuda::mxfp4_wgmma_plans();
  explicit WgmmaScope(bool on) { cuda::set_mxfp4_wgmma_plans(on); }
  ~WgmmaScope() { cuda::set_mxfp4_wgmma_plans(was); }
};

}  // namespace k3::plan_test
