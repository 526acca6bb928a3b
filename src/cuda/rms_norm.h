// RMSNorm over bf16 rows on the GPU: y = bf16(x / sqrt(mean(x^2) + eps) * w), fp32 math. Matches
// cpu::rms_norm on the same (bf16-valued) inputs followed by bf16 rounding.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

// x: [rows, hidden] bf16, row stride x_stride elements (device)
// w: [hidden] fp32 (device), or null for no scale
// y: [rows, hidden] bf16, row stride y_stride elements (device); may alias x when the strides
//    are equal (each element is read before it is written, by the same thread)
// One CTA per row; no allocation, no host sync. Vector path when hidden % 8 == 0, the strides
// are multiples of 8 and the pointers 16-byte aligned; an element-wise path otherwise.
void rms_norm(const __nv_bfloat16* x, int64_t x_stride, const float* w, int64_t rows,
              int64_t hidden, float eps, __nv_bfloat16* y, int64_t y_stride, cudaStream_t stream);

}  // namespace k3::cuda
