// The few-row MXFP4 GEMV (gemv_mxfp4.cu): a plan kind of the skinny GEMM launcher
// (LinearPlan::gemv_fp4_pieces > 0) for launches of 1..8 rows per slot, dense or grouped, with
// plain or GLU x, chosen where it measures faster than the tiling.
#pragma once

#include <cuda_runtime.h>

#include "cuda/linear_plan.h"

namespace k3::cuda::detail {

struct SkinnyArgs;

// Launches MXFP4 GEMV plan p on a (dense: a.w / a.ws; grouped: the slot tables; x or x_glu; the
// skinny epilogue); returns the launch's error (the tuner skips plans that fail to launch).
cudaError_t launch_gemv_mxfp4(const LinearPlan& p, const SkinnyArgs& a, cudaStream_t stream);

}  // namespace k3::cuda::detail
