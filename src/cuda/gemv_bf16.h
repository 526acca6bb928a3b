// The few-row bf16 GEMV (gemv_bf16.cu): a plan kind of the skinny GEMM launcher (LinearPlan::
// gemv_ks > 0) for dense launches of 1..4 rows, chosen where it measures faster than the tiling.
#pragma once

#include <cuda_runtime.h>

#include "cuda/linear_plan.h"

namespace k3::cuda::detail {

struct SkinnyArgs;

// Launches GEMV plan p on a (1..4 x rows, dense bf16 W, the skinny epilogue); returns the launch's
// error (the tuner skips plans that fail to launch).
cudaError_t launch_gemv_bf16(const LinearPlan& p, const SkinnyArgs& a, cudaStream_t stream);

}  // namespace k3::cuda::detail
