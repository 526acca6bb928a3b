// The stock path's row ops (RMSNorm, AttnRes mixing, GLU, argmax) against their CPU oracle
// (src/cpu/ops_*.h), on fresh random inputs (the seed is printed; K3_TEST_SEED replays it).
// Outputs are poisoned with NaN before each launch and every element must be written; the
// tolerance table of these and the skinny GEMMs (test_cuda_linear_*.cu) is in op_test_util.h.
// main() is in gpu_main.cu (exit 77 without a GPU).
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/numeric.h"
#include "cpu/ops_attn_res.h"
#include "cpu/ops_basic.h"
#include "cpu/sampling.h"
#include "cuda/argmax.h"
#include "cuda/attn_res.h"
#include "cuda/device_buffer.h"
#include "cuda/glu.h"
#include "cuda/rms_norm.h"
#include "gpu/gpu_check_util.h"
#include "gpu/op_test_util.h"
#include "test_util.h"

namespace k3 {
namespace {

using cuda::bf16;
using cuda::DeviceBuffer;
using gpu_test::bf16_to_floats;
using gpu_test::Bf16Data;
using gpu_test::expect_all_finite;
using gpu_test::expect_close;
using gpu_test::kAttnRes;
using gpu_test::kAttnResProbAbs;
using gpu_test::kGlu;
using gpu_test::kRmsNorm;
using gpu_test::make_bf16;
using gpu_test::Out;

// ============================== row ops ==============================

TEST(CudaRmsNorm, MatchesCpu) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  struct Case {
    int64_t rows, hidden, x_stride, y_stride;
    bool weight, in_place;
  };
  // Vector paths (1/2/4/8 vectors per thread), the generic path (odd hidden, odd stride, very
  // long rows), no weight, in place.
  const Case cases[] = {
      {1, 7168, 7168, 7168, true, false},    {64, 7168, 7168, 7168, true, false},
      {5, 3584, 3600, 3592, true, false},    {3, 2048, 2048, 2048, false, false},
      {2, 4000, 4000, 4000, true, false},    {4, 40000, 40000, 40000, true, false},
      {2, 70000, 70000, 70000, true, false}, {7, 1001, 1001, 1001, true, false},
      {3, 64, 72, 67, true, false},          {9, 7168, 7168, 7168, true, true}};
  const float eps = 1e-5f;
  for (const Case& c : cases) {
    const std::string what = "rms_norm rows " + std::to_string(c.rows) + " hidden " +
                             std::to_string(c.hidden) + (c.in_place ? " in place" : "");
    const float xs = std::exp(rng.normal());
    Bf16Data x = make_bf16(rng, static_cast<size_t>(c.rows * c.x_stride), xs);
    std::vector<float> w(static_cast<size_t>(c.hidden));
    for (auto& v : w) v = 1.0f + 0.1f * rng.normal();
    const auto dw = cuda::to_device<float>(w);
    const int64_t ys = c.in_place ? c.x_stride : c.y_stride;
    Out y(static_cast<size_t>(c.rows * ys), false);
    bf16* out = c.in_place ? x.dev.data() : static_cast<bf16*>(y.ptr());
    cuda::rms_norm(x.dev.data(), c.x_stride, c.weight ? dw.data() : nullptr, c.rows, c.hidden, eps,
                   out, ys, nullptr);
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> got_all;
    if (c.in_place) {
      got_all = bf16_to_floats(cuda::to_host<uint16_t>(x.dev));
    } else {
      got_all = y.get();
    }
    std::vector<float> got, ref;
    std::vector<float> row(static_cast<size_t>(c.hidden));
    for (int64_t r = 0; r < c.rows; ++r) {
      cpu::rms_norm(x.val.data() + r * c.x_stride, c.weight ? w.data() : nullptr, c.hidden, eps,
                    row.data());
      round_bf16(row);
      ref.insert(ref.end(), row.begin(), row.end());
      got.insert(got.end(), got_all.begin() + r * ys, got_all.begin() + r * ys + c.hidden);
    }
    expect_close(got, ref, kRmsNorm, what);
  }
}

TEST(CudaAttnRes, MatchesCpu) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  struct Case {
    int n;
    int64_t rows, hidden;
  };
  const Case cases[] = {{1, 3, 7168}, {2, 1, 7168}, {9, 64, 7168}, {16, 5, 2304},
                        {5, 2, 1001}, {3, 4, 520},  {9, 1, 64},    {8, 17, 7168}};
  const float eps = 1e-5f;
  for (const Case& c : cases) {
    const std::string what = "attn_res n " + std::to_string(c.n) + " rows " +
                             std::to_string(c.rows) + " hidden " + std::to_string(c.hidden);
    // A bank with very different RMS per source and a score vector giving O(1) scores.
    const int64_t per = c.rows * c.hidden;
    std::vector<uint16_t> bits;
    for (int j = 0; j < c.n; ++j) {
      const auto b = test::random_bf16(rng, static_cast<size_t>(per), std::exp(rng.normal()));
      bits.insert(bits.end(), b.begin(), b.end());
    }
    const std::vector<float> val = bf16_to_floats(bits);
    const auto dbank = cuda::to_device<bf16>(bits);
    const auto w = test::random_normal(rng, static_cast<size_t>(c.hidden),
                                       2.0f / std::sqrt(static_cast<float>(c.hidden)));
    const auto dw = cuda::to_device<float>(w);
    Out y(static_cast<size_t>(per), false);
    Out probs(static_cast<size_t>(c.rows * c.n), true);
    cuda::attn_res_mix(dbank.data(), c.n, per, c.hidden, dw.data(), c.rows, c.hidden, eps,
                       static_cast<bf16*>(y.ptr()), c.hidden, static_cast<float*>(probs.ptr()),
                       nullptr);
    const auto got = y.get(), got_p = probs.get();
    std::vector<float> ref, ref_p;
    std::vector<float> out(static_cast<size_t>(c.hidden)), p(static_cast<size_t>(c.n));
    for (int64_t r = 0; r < c.rows; ++r) {
      std::vector<const float*> src;
      for (int j = 0; j < c.n; ++j) src.push_back(val.data() + j * per + r * c.hidden);
      cpu::attn_res_mix(src.data(), c.n, w.data(), c.hidden, eps, out.data(), p.data());
      round_bf16(out);
      ref.insert(ref.end(), out.begin(), out.end());
      ref_p.insert(ref_p.end(), p.begin(), p.end());
    }
    if (c.n == 1) {
      EXPECT_EQ(0, std::memcmp(got.data(), val.data(), got.size() * sizeof(float)))
          << what << ": one source must pass through bit for bit";
    }
    expect_close(got, ref, kAttnRes, what);
    expect_all_finite(got_p, what + " probs");
    EXPECT_LE(test::max_abs_diff(got_p, ref_p), kAttnResProbAbs) << what;
  }
}

// Separate source buffers (the pointer form) and the output written over source 0.
TEST(CudaAttnRes, PointerSourcesInPlace) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int n = 4;
  const int64_t rows = 3, hidden = 7168;
  std::vector<Bf16Data> src;
  for (int j = 0; j < n; ++j)
    src.push_back(make_bf16(rng, static_cast<size_t>(rows * hidden), std::exp(rng.normal())));
  const auto w = test::random_normal(rng, hidden, 2.0f / std::sqrt(static_cast<float>(hidden)));
  const auto dw = cuda::to_device<float>(w);
  cuda::AttnResSources s;
  for (int j = 0; j < n; ++j) s.src[j] = src[j].dev.data();
  cuda::attn_res_mix(s, n, hidden, dw.data(), rows, hidden, 1e-5f, src[0].dev.data(), hidden,
                     nullptr, nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = bf16_to_floats(cuda::to_host<uint16_t>(src[0].dev));
  std::vector<float> ref, out(hidden);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<const float*> p;
    for (int j = 0; j < n; ++j) p.push_back(src[j].val.data() + r * hidden);
    cpu::attn_res_mix(p.data(), n, w.data(), hidden, 1e-5f, out.data());
    round_bf16(out);
    ref.insert(ref.end(), out.begin(), out.end());
  }
  expect_close(got, ref, kAttnRes, "attn_res pointer sources, in place");
}

TEST(CudaGlu, MatchesCpu) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  struct Act {
    cpu::GluActivation cpu;
    cuda::GluAct gpu;
  };
  std::vector<Act> acts(3);
  acts[1].cpu.kind = cpu::GluActivation::Kind::SiTU;
  acts[1].gpu.kind = cuda::GluAct::Kind::SiTU;
  acts[2].cpu.kind = cpu::GluActivation::Kind::SiTU;
  acts[2].cpu.beta = 3.0f;
  acts[2].cpu.linear_beta = 2.5f;
  acts[2].gpu = {cuda::GluAct::Kind::SiTU, 3.0f, true, 2.5f};
  const int64_t shapes[][2] = {{1, 3072}, {17, 1001}, {64, 384}};
  for (const Act& a : acts)
    for (const auto& sh : shapes) {
      const int64_t rows = sh[0], width = sh[1];
      const std::string what = "glu kind " + std::to_string(static_cast<int>(a.gpu.kind)) +
                               " beta " + std::to_string(a.gpu.beta) + " rows " +
                               std::to_string(rows) + " width " + std::to_string(width);
      // Gate and up side by side in one [rows, 2*width] buffer, as a fused gate/up GEMM writes.
      const Bf16Data gu = make_bf16(rng, static_cast<size_t>(rows * 2 * width), 3.0f);
      Out h(static_cast<size_t>(rows * width), false);
      cuda::glu(a.gpu, gu.dev.data(), 2 * width, gu.dev.data() + width, 2 * width, rows, width,
                static_cast<bf16*>(h.ptr()), width, nullptr);
      const auto got = h.get();
      std::vector<float> ref;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < width; ++i)
          ref.push_back(
              round_bf16(a.cpu(gu.val[r * 2 * width + i], gu.val[r * 2 * width + width + i])));
      expect_close(got, ref, kGlu, what);
    }
}

TEST(CudaArgmax, MatchesCpuWithTies) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t cases[][3] = {{1, 163840, 163840}, {4, 1000, 1000}, {3, 7, 7},
                              {2, 65537, 65539},   {3, 1001, 1004}, {2, 163840, 163844}};
  for (const auto& c : cases) {
    const int64_t rows = c[0], n = c[1], stride = c[2];
    std::vector<float> x(static_cast<size_t>(rows * stride), NAN);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) x[r * stride + i] = rng.normal();
      // The maximum twice (lowest index must win), and in the last row every value equal.
      const int64_t a = rng.next_u64() % n, b = rng.next_u64() % n;
      x[r * stride + a] = x[r * stride + b] = 10.0f;
      if (r == rows - 1 && rows > 1)
        for (int64_t i = 0; i < n; ++i) x[r * stride + i] = -INFINITY;
    }
    const auto dx = cuda::to_device<float>(x);
    DeviceBuffer<int32_t> i32(static_cast<size_t>(rows));
    DeviceBuffer<int64_t> i64(static_cast<size_t>(rows));
    i32.fill_bytes(0xff);
    i64.fill_bytes(0xff);
    cuda::argmax(dx.data(), stride, rows, n, i32.data(), nullptr);
    cuda::argmax(dx.data(), stride, rows, n, i64.data(), nullptr);
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    const auto g32 = cuda::to_host<int32_t>(i32);
    const auto g64 = cuda::to_host<int64_t>(i64);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t want = cpu::argmax(x.data() + r * stride, n);
      EXPECT_EQ(g32[r], want) << "argmax int32 rows " << rows << " n " << n << " row " << r;
      EXPECT_EQ(g64[r], want) << "argmax int64 rows " << rows << " n " << n << " row " << r;
    }
  }
}

}  // namespace
}  // namespace k3
