// GPU token sampling for the decode step: the CPU pipeline of cpu/sampling.h (temperature ->
// top-k -> softmax -> top-p -> one uniform draw through the inverse CDF in descending-probability
// order, ties by lower id), in double, with the uniform supplied per row. For the same u it
// picks the same token as cpu::sample_from_uniform, except when a cumulative probability lies
// within ~1e-12 of the draw or of top_p (the sums are added in a different order).
//
// Cost: one stable CUB radix sort of all rows' logits at once (64-bit keys: row, logit), then one
// CTA per row that walks the sorted prefix only as far as top-p / the draw needs. Workspace:
// ~24 B per logit (252 MB at 64 rows x 163840).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace k3::cuda {

struct SampleRowParams {
  float temperature;  // <= 0 (or NaN): greedy argmax, lowest id on ties
  int top_k;          // <= 0: off
  float top_p;        // >= 1: off; expected in (0, 1]
};

// Device scratch sample_rows needs for this (rows, vocab); sized on the host, no allocation.
size_t sample_rows_workspace_bytes(int64_t rows, int64_t vocab);

// logits:    [rows][stride] fp32 (device); the first vocab entries of each row are used
// params:    [rows] (device)
// uniform:   [rows] double in [0, 1) (device), ignored by greedy rows
// workspace: sample_rows_workspace_bytes(rows, vocab) bytes, 256-B aligned (device)
// ids:       [rows] int32 (device), each in [0, vocab)
// Where the CPU raises, the GPU still returns an in-range id: NaN logits count as -inf, and a
// row whose largest scaled logit is not finite returns its first sorted id. rows * vocab < 2^31.
// No allocation, no host sync; capturable in a CUDA graph.
void sample_rows(const float* logits, int64_t stride, int64_t rows, int64_t vocab,
                 const SampleRowParams* params, const double* uniform, void* workspace,
                 int32_t* ids, cudaStream_t stream);

}  // namespace k3::cuda
