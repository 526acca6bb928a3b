// How every benchmark here times a launch: one CUDA graph of R back-to-back launches, each on
// its own copy of the operands (R chosen so one replay walks more than twice the L2, so every
// launch reads cold from HBM), replayed; per-launch time = median replay time / R. This is what
// a launch costs inside a decode graph: the kernel plus its node gap.
#pragma once

#include <cuda_runtime.h>

#include <functional>

namespace k3::bench {

// enqueue(copy, stream): one launch on copy `copy` of the operands.
using Enqueue = std::function<void(int copy, cudaStream_t stream)>;

// One graph of the launches of copies first .. first + count - 1, captured on `stream` and
// instantiated (the caller destroys it).
cudaGraphExec_t capture_launches(const Enqueue& enqueue, int first, int count, cudaStream_t stream);

// Median per-launch time (us) of `replays` replays of a graph of R launches (copies 0..R-1),
// after an eager warm-up launch and 3 untimed replays.
double graph_batched_us(const Enqueue& enqueue, int R, cudaStream_t stream, int replays = 50);

}  // namespace k3::bench
