// The few-row bf16 GEMV (gemv_bf16.cu): a plan kind of the skinny GEMM launcher (LinearPlan::
// gemv_ks > 0) for dense launches of 1..4 rows, chosen where it measures faster than the tiling.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/linear_plan.h"

namespace k3::cuda::detail {

struct SkinnyArgs;

// A combined input (SkinnyArgs::combine_y) fits the kernel: moe_combine's one-pass widths
// (moe_combine.cuh: 8 columns of 512 threads) in whole 16-byte vectors, up to 64 choices.
constexpr bool gemv_takes_combined(int64_t k, int top_k) {
  return k >= 8 && k % 8 == 0 && k <= 8 * 512 && top_k >= 1 && top_k <= 64;
}

// Launches GEMV plan p on a (1..4 x rows, dense bf16 W, the skinny epilogue); returns the launch's
// error (the tuner skips plans that fail to launch).
cudaError_t launch_gemv_bf16(const LinearPlan& p, const SkinnyArgs& a, cudaStream_t stream);

}  // namespace k3::cuda::detail
