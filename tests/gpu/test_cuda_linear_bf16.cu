// The skinny bf16 GEMM against the CPU oracle (cpu::linear_rows) on fresh random inputs: odd and
// K3 rank shapes, every kind of tiling, the few-row GEMV plans and the cuBLAS plan. Outputs are
// poisoned with NaN before each launch and every element must be written; tolerances:
// op_test_util.h. main() is in gpu_main.cu (exit 77 without a GPU).
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "cuda/linear_bf16.h"
#include "cuda/linear_plan.h"
#include "gpu/gpu_check_util.h"
#include "gpu/linear_test_util.h"
#include "gpu/op_test_util.h"
#include "test_util.h"

namespace k3 {
namespace {

using cuda::bf16;
using cuda::DeviceBuffer;
using gpu_test::Bf16Data;
using gpu_test::Bf16Weight;
using gpu_test::diverse_plans;
using gpu_test::expect_linear_output;
using gpu_test::make_bf16;
using gpu_test::make_bf16_weight;
using gpu_test::Out;
using gpu_test::shape_str;

void check_bf16_linear(Rng& rng, int64_t M, int64_t N, int64_t K, bool f32,
                       const cuda::LinearPlan* plan = nullptr) {
  const std::string what = shape_str("linear_bf16", M, N, K, f32, plan);
  const Bf16Data x = make_bf16(rng, static_cast<size_t>(M * K), 1.0f);
  const Bf16Weight w = make_bf16_weight(rng, N, K);
  Out y(static_cast<size_t>(M * N), f32);
  if (plan)
    cuda::linear_bf16(*plan, x.dev.data(), K, w.d.dev.data(), M, y.ptr(), N, f32, nullptr);
  else
    cuda::linear_bf16(x.dev.data(), K, w.d.dev.data(), M, N, K, y.ptr(), N, f32, nullptr);
  expect_linear_output(rng, y.get(), w.wm, x.val, M, N, K, f32, what);
}

TEST(CudaLinearBf16, SmallAndOddShapes) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  // K % 64 != 0 (chunk tails), N % 16 != 0 (ragged tiles), K % 8 != 0 (generic kernel).
  const int64_t shapes[][2] = {{37, 72}, {130, 200}, {257, 1000}, {64, 4104},
                               {16, 64}, {33, 7},    {70, 33},    {129, 1001}};
  for (const auto& s : shapes)
    for (int64_t M : {1, 3, 8, 17, 64}) check_bf16_linear(rng, M, s[0], s[1], false);
  check_bf16_linear(rng, 100, 130, 200, false);  // > 64 rows: two launches
  check_bf16_linear(rng, 5, 257, 1000, true);
}

TEST(CudaLinearBf16, K3RankShapes) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t shapes[][2] = {{768, 7168}, {7168, 768}, {3584, 7168}, {384, 7168}};
  for (const auto& s : shapes)
    for (int64_t M : {1, 8, 17, 64}) check_bf16_linear(rng, M, s[0], s[1], false);
  check_bf16_linear(rng, 3, 768, 7168, true);
}

TEST(CudaLinearBf16, EveryKindOfPlan) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (const bool alt : {false, true}) {  // x through cp.async and the fast reduction, or not
    const gpu_test::SkinnyFormsScope forms(alt, alt);
    SCOPED_TRACE(alt ? "K3_SKINNY_X_ASYNC=1 K3_SKINNY_FAST_REDUCE=1" : "default forms");
    for (int64_t M : {1, 17, 64}) {
      for (const auto& s : {std::pair<int64_t, int64_t>{768, 7168}, {200, 1000}}) {
        auto plans =
            diverse_plans(cuda::linear_bf16_candidates(static_cast<int>(M), s.first, s.second));
        ASSERT_FALSE(plans.empty());
        cuda::LinearPlan fb = plans.front();
        fb.fallback = true;
        plans.push_back(fb);
        for (const auto& p : plans) check_bf16_linear(rng, M, s.first, s.second, false, &p);
      }
    }
  }
}

// Every GEMV plan (1..4 rows, dense bf16) against the oracle: every k split and rows per warp
// on the rank's shapes, ragged N (rows past N in the last CTA), K with partial lane units (K / 8
// not a multiple of 32 * ks), 3 rows on the 4-row kernel, bf16 and fp32 out; and the same launch
// twice gives the same bits.
TEST(CudaLinearBf16, EveryGemvPlan) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t shapes[][2] = {{768, 7168}, {7168, 768}, {37, 72}, {257, 1000}, {130, 4104}};
  for (const int64_t M : {1, 2, 3, 4})
    for (const auto& s : shapes) {
      int n_gemv = 0;
      for (const auto& p : cuda::linear_bf16_candidates(static_cast<int>(M), s[0], s[1])) {
        if (!p.gemv()) continue;
        ++n_gemv;
        check_bf16_linear(rng, M, s[0], s[1], (n_gemv % 2) == 0, &p);
      }
      EXPECT_GE(n_gemv, 4) << "M " << M << " " << s[0] << "x" << s[1];
    }
  // Determinism: two launches of one plan, bit for bit.
  const int64_t N = 3584, K = 7168;
  const auto plans = cuda::linear_bf16_candidates(1, N, K);
  ASSERT_TRUE(!plans.empty() && plans.front().gemv()) << "the model's one-row pick is a GEMV";
  const Bf16Data x = make_bf16(rng, static_cast<size_t>(K), 1.0f);
  const Bf16Weight w = make_bf16_weight(rng, N, K);
  DeviceBuffer<bf16> y1(static_cast<size_t>(N)), y2(static_cast<size_t>(N));
  cuda::linear_bf16(plans.front(), x.dev.data(), K, w.d.dev.data(), 1, y1.data(), N, false,
                    nullptr);
  cuda::linear_bf16(plans.front(), x.dev.data(), K, w.d.dev.data(), 1, y2.data(), N, false,
                    nullptr);
  EXPECT_EQ(cuda::to_host<uint16_t>(y1), cuda::to_host<uint16_t>(y2));
}

// Under batch invariance no GEMV plan is offered (it sums K in another order than the tilings
// of more rows).
TEST(CudaLinearBf16, NoGemvUnderBatchInvariance) {
  const bool was = cuda::batch_invariant();
  cuda::set_batch_invariant(true);
  const auto plans = cuda::linear_bf16_candidates(1, 768, 7168);
  cuda::set_batch_invariant(was);
  ASSERT_FALSE(plans.empty());
  for (const auto& p : plans) EXPECT_FALSE(p.gemv()) << p.str();
}

// The cuBLAS plan (the tuner times it beside the kernels) against the oracle: the rank's shapes
// and ragged ones, 1..64 rows, bf16 and fp32 out.
TEST(CudaLinearBf16, CublasPlan) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t shapes[][2] = {{768, 7168}, {7168, 768}, {3584, 7168}, {37, 72}, {257, 1000}};
  for (const auto& s : shapes)
    for (const int64_t M : {1, 3, 8, 17, 64}) {
      const cuda::LinearPlan p = cuda::cublas_plan(static_cast<int>(M), s[0], s[1]);
      check_bf16_linear(rng, M, s[0], s[1], M == 3, &p);
    }
}

}  // namespace
}  // namespace k3
