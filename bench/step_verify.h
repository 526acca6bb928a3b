// Speculative verify and prefill on the bench rank (k3_bench_step --verify-q).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench_rank.h"
#include "cuda/backbone.h"
#include "cuda/device_buffer.h"
#include "model/config.h"
#include "step_args.h"

namespace k3::bench {

// Speculative verify at batch 1: one request's q tokens as one run of rows (keeping the KDA
// state after each token, as a verify does), against the q = 1 step, on both paths, at the
// first context. The floor counts the weights q rows touch and the request's cache once.
struct VerifyRow {
  int q;
  double stock = 0, spec = 0, floor_ms = 0;
  std::string spec_stages;  // the specialized step per stage (--profile; snapshots not written)
};

struct VerifyResult {
  std::vector<VerifyRow> rows;
  int64_t prefill_tokens = 0;
  double prefill_ms = 0;
};

VerifyResult time_verify(const StepArgs& a, cuda::CudaBackbone& bb, const ModelConfig& cfg,
                         const bench::Floor& fl, int64_t margin,
                         cuda::DeviceBuffer<uint8_t>& flush);

void print_verify(const VerifyResult& v);

}  // namespace k3::bench
