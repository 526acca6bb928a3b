// Greedy token choice on the GPU: per row, the index of the largest fp32 logit, lowest index on
// ties (cpu::argmax). NaN logits are never chosen (the CPU reference rejects them); a row of
// only NaN gives 0.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

// logits: [rows, n] fp32, row stride `stride` elements (device)
// ids: [rows] int32 or int64 (device)
// A cluster of up to 8 CTAs per row, reduced in rank order; no allocation, no host sync.
void argmax(const float* logits, int64_t stride, int64_t rows, int64_t n, int32_t* ids,
            cudaStream_t stream);
void argmax(const float* logits, int64_t stride, int64_t rows, int64_t n, int64_t* ids,
            cudaStream_t stream);

}  // namespace k3::cuda
