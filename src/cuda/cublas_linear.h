// cuBLAS as one more plan kind of the bf16 skinny GEMM (LinearPlan::cublas): cublasGemmEx with
// bf16 operands, fp32 compute and a bf16 or fp32 output. Above a few token rows its tensor-core
// tilings beat ours (bench/RESULTS.md: 3584x7168 at 64 rows 19.7 against 45.9 us), so the tuner
// times it beside the kernels; it is never the model's pick (no model of it, and a first use
// inside a graph capture could not create its handle).
//
// Limits, all checked: dense launches without the GLU input; not under batch invariance (its K
// order changes with the row count). A folded epilogue (residual adds, bf16 y) runs as a small
// kernel after the GEMM, so it gives the bits of the GEMM and the separate add launches, as the
// kernels' fused stores do. cuBLAS's kernels do not wait for their producers (pdl.cuh), so the
// GEMM goes through enqueue_foreign (graph_pdl.h): the step's programmatic graphs keep full
// edges around it. One handle per device and a fixed workspace per stream (allocated by the
// stream's first eager launch; two streams' GEMMs may overlap), so a captured call allocates
// nothing and replays the algorithm of the eager call bit for bit.
#pragma once

#include <cuda_runtime.h>

#include "cuda/linear_plan.h"

namespace k3::cuda::detail {

struct SkinnyArgs;

// Runs the cuBLAS plan p on a (dense bf16 W, plain x); returns cudaErrorNotSupported
// when cuBLAS reports a failure (the tuner skips the plan), else the launch's error.
cudaError_t launch_cublas_linear(const LinearPlan& p, const SkinnyArgs& a, cudaStream_t stream);

}  // namespace k3::cuda::detail
