// The timing harness of k3_bench_attn (bench_attention.cu: KDA, MLA, router; bench_dsa.cu: the
// DSA indexer): one CUDA graph of R back-to-back launches, each on its own copy of the big
// operand, R so one replay touches > 132 MB (2.2x L2), us = median of 50 replays / R; a result
// line per case with its bytes, GB/s, % of 4.3 TB/s, of the H200 read curve at its size and of
// this GPU's (measured first), and a correctness check.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "cuda/check.h"
#include "cuda/device_buffer.h"

namespace k3::bench {

struct Result {
  std::string kernel, shape, check;
  int rows = 0;
  double bytes = 0, us = 0;
  bool warm = false;  // timed on one L2-resident copy
};

// Copies of an operand of bytes_per_copy that one replay walks so that it is cold in L2.
int copies_for(double bytes_per_copy);

class Timer {
 public:
  Timer();
  // Median per-launch time of R back-to-back launches (copies 0..R-1) in one graph.
  double batched_us(const std::function<void(int, cudaStream_t)>& enqueue, int R);
  cudaStream_t stream() const { return st_; }

 private:
  cudaStream_t st_ = nullptr;  // lives for the whole run: nothing to release
};

std::vector<uint16_t> random_bf16(Rng& rng, size_t n, float scale);  // bf16 bits
std::vector<float> floats(const std::vector<uint16_t>& bf16_bits);
// max |got - ref| / rms(ref); inf when any value is not finite.
double maxrel(const float* got, const double* ref, size_t n);
std::string fmt(const char* f, double a, double b = 0);

// A device buffer [runs][host.size()] holding `host` in every run (the copies a cold replay
// walks; the copies after the first are made on the device).
template <typename T, typename H>
cuda::DeviceBuffer<T> replicated(const std::vector<H>& host, size_t runs) {
  static_assert(sizeof(T) == sizeof(H), "host and device element sizes differ");
  const size_t n = host.size();
  cuda::DeviceBuffer<T> d(runs * n);
  cuda::copy_to_device(d, host.data(), n);
  for (size_t b = 1; b < runs; ++b)
    K3_CUDA_CHECK(cudaMemcpy(d.data() + b * n, d.data(), n * sizeof(T), cudaMemcpyDeviceToDevice));
  return d;
}

// Page tables [runs][ppr] of `runs` distinct page runs: run b holds pages b ppr .. b ppr + ppr - 1.
cuda::DeviceBuffer<int32_t> run_page_tables(size_t runs, int ppr);

// Measures this GPU's read curve (read_curve.h) for the %card column; prints it.
void measure_card_curve(cudaStream_t stream);
// Prints the result's line and keeps it for the table print_table() prints last.
void record(Result r);
void print_table();

}  // namespace k3::bench
