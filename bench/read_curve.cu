#include "read_curve.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "cuda/check.h"
#include "cuda/device_buffer.h"
#include "cuda/linear_plan.h"
#include "cuda/mma.cuh"
#include "graph_timing.h"

namespace k3::bench {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // loads in flight per thread
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kBufferBytes = 512 * kMiB;

// Reads src[0, n) once, 16 bytes per load. The XOR of the data decides a store that a zeroed
// buffer never makes, so no load can be dropped and nothing is written.
__global__ void __launch_bounds__(kThreads)
    stream_read_kernel(const uint4* __restrict__ src, int64_t n, uint32_t* sink) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = cuda::detail::ldg_stream(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = cuda::detail::ldg_stream(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

}  // namespace

ReadCurve ReadCurve::measure(cudaStream_t stream) {
  cudaDeviceProp p{};
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  K3_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  cuda::DeviceBuffer<uint8_t> buf(kBufferBytes);
  cuda::DeviceBuffer<uint32_t> sink(1);
  K3_CUDA_CHECK(cudaMemsetAsync(buf.data(), 0, kBufferBytes, stream));
  ReadCurve c;
  for (size_t mb = 1; mb <= 256; mb *= 2) {
    const size_t bytes = mb * kMiB;
    // Copies so that one replay walks more than twice the L2 (each launch reads cold).
    const int R = static_cast<int>(std::clamp<size_t>(
        (static_cast<size_t>(2.2 * p.l2CacheSize) + bytes - 1) / bytes, 2, kBufferBytes / bytes));
    const int64_t n = static_cast<int64_t>(bytes / sizeof(uint4));
    const int grid = static_cast<int>(
        std::min<int64_t>(4LL * p.multiProcessorCount, (n + kThreads - 1) / kThreads));
    const double us = graph_batched_us(
        [&](int copy, cudaStream_t s) {
          stream_read_kernel<<<grid, kThreads, 0, s>>>(
              reinterpret_cast<const uint4*>(buf.data() + static_cast<size_t>(copy) * bytes), n,
              sink.data());
          K3_CUDA_CHECK_LAUNCH();
        },
        R, stream);
    c.mb_.push_back(static_cast<double>(mb));
    c.tbps_.push_back(static_cast<double>(bytes) / (us * 1e-6) / 1e12);
  }
  return c;
}

double ReadCurve::tbps(double bytes) const {
  if (mb_.empty()) return 0.0;
  return cuda::read_curve_tbps(mb_.data(), tbps_.data(), static_cast<int>(mb_.size()), bytes);
}

void ReadCurve::print() const {
  std::printf("read curve of this GPU, measured (TB/s; the H200 table's in brackets):");
  for (size_t i = 0; i < mb_.size(); ++i)
    std::printf(" %g MB %.2f (%.2f)%s", mb_[i], tbps_[i],
                cuda::h200_read_curve_tbps(mb_[i] * static_cast<double>(kMiB)),
                i + 1 < mb_.size() ? " |" : "\n");
  std::fflush(stdout);
}

}  // namespace k3::bench
