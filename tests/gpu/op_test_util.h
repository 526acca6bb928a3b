// Helpers of the GPU op suites (test_cuda_ops.cu, test_cuda_linear_*.cu): the tolerance table
// of the ops they check against the CPU oracle, bf16 inputs known on both sides, and output
// buffers poisoned with NaN so that every element must be written.
#pragma once

#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/rng.h"
#include "cuda/check.h"
#include "cuda/device_buffer.h"
#include "gpu/gpu_check_util.h"
#include "test_util.h"

namespace k3::gpu_test {

// ---- Tolerances: |gpu - ref| <= ulps * ulp_bf16(|ref|) + rel * scale, ref the CPU oracle on
// the same bf16-valued inputs, rounded to bf16 where the GPU stores bf16. `scale` is the RMS of
// the reference output (a cancellation guard: a bug moves elements by O(scale)). ----
constexpr Tol kGemmBf16Out{1.0, 1e-3};  // bf16 and MXFP4 (exact dequantization) GEMMs
constexpr Tol kGemmF32Out{0.0, 1e-4};   // fp32 y: only the k order differs
constexpr Tol kRmsNorm{1.0, 1e-6};
constexpr Tol kAttnRes{1.0, 1e-4};
constexpr double kAttnResProbAbs = 3e-5;  // scores differ by the k order of two 7168-term sums
constexpr Tol kGlu{1.0, 1e-6};
// argmax: exact.

// Every element of v written (finite: outputs start as NaN).
inline void expect_all_finite(const std::vector<float>& v, const std::string& what) {
  int64_t n = 0;
  for (float x : v) n += !std::isfinite(x);
  EXPECT_EQ(n, 0) << what << ": " << n << " of " << v.size() << " elements not written";
}

// bf16 data on both sides: bits on the device, values on the host.
struct Bf16Data {
  std::vector<uint16_t> bits;
  std::vector<float> val;
  cuda::DeviceBuffer<cuda::bf16> dev;
};
inline Bf16Data make_bf16(Rng& rng, size_t n, float scale) {
  Bf16Data d;
  d.bits = test::random_bf16(rng, n, scale);
  d.val.resize(n);
  for (size_t i = 0; i < n; ++i) d.val[i] = bf16_to_float(d.bits[i]);
  d.dev = cuda::to_device<cuda::bf16>(d.bits);
  return d;
}

inline std::vector<float> bf16_to_floats(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_float(b[i]);
  return f;
}

// Output buffer poisoned with NaN (all-ones bytes), read back as floats.
struct Out {
  cuda::DeviceBuffer<uint8_t> buf;
  bool fp32 = false;
  size_t n = 0;
  Out(size_t count, bool f32) : buf(count * (f32 ? 4 : 2)), fp32(f32), n(count) { poison(); }
  void poison() {
    buf.fill_bytes(0xff);
    K3_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void* ptr() { return buf.data(); }
  std::vector<float> get() {
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    if (fp32) {
      std::vector<float> h(n);
      K3_CUDA_CHECK(cudaMemcpy(h.data(), buf.data(), 4 * n, cudaMemcpyDeviceToHost));
      return h;
    }
    std::vector<uint16_t> h(n);
    K3_CUDA_CHECK(cudaMemcpy(h.data(), buf.data(), 2 * n, cudaMemcpyDeviceToHost));
    return bf16_to_floats(h);
  }
};

}  // namespace k3::gpu_test
