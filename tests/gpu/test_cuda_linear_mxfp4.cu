// The skinny MXFP4 GEMM against the CPU oracle (exact dequantization, cpu::linear_rows) on fresh
// random inputs: every E2M1 code and scale range, the expert shapes, every kind of tiling
// (mma.sync, warpgroup and GEMV plans), the grouped MoE form; and graph replays of both GEMMs
// equal to eager launches. Tolerances: op_test_util.h. main() is in gpu_main.cu.
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
#include "cuda/linear_mxfp4.h"
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
using gpu_test::expect_all_finite;
using gpu_test::expect_close;
using gpu_test::expect_linear_output;
using gpu_test::Fp4Weight;
using gpu_test::gather;
using gpu_test::kGemmBf16Out;
using gpu_test::make_bf16;
using gpu_test::make_bf16_weight;
using gpu_test::make_fp4_weight;
using gpu_test::Out;
using gpu_test::ref_linear;
using gpu_test::sample_rows;
using gpu_test::shape_str;

void check_fp4_linear(Rng& rng, int64_t M, int64_t N, int64_t K, bool f32, bool raw,
                      const cuda::LinearPlan* plan = nullptr) {
  const std::string what =
      shape_str(raw ? "linear_mxfp4(raw codes)" : "linear_mxfp4", M, N, K, f32, plan);
  const Bf16Data x = make_bf16(rng, static_cast<size_t>(M * K), 1.0f);
  const Fp4Weight w = make_fp4_weight(rng, N, K, raw);
  Out y(static_cast<size_t>(M * N), f32);
  if (plan)
    cuda::linear_mxfp4(*plan, x.dev.data(), K, w.dp.data(), w.ds.data(), M, y.ptr(), N, f32,
                       nullptr);
  else
    cuda::linear_mxfp4(x.dev.data(), K, w.dp.data(), w.ds.data(), M, N, K, y.ptr(), N, f32,
                       nullptr);
  expect_linear_output(rng, y.get(), w.wm, x.val, M, N, K, f32, what);
}

TEST(CudaLinearMxfp4, SmallShapesAndEveryCode) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  // K % 256 != 0 (96, 288) takes the generic kernel.
  const int64_t shapes[][2] = {{40, 256}, {130, 512}, {257, 1024}, {33, 96}, {64, 288}};
  for (const auto& s : shapes)
    for (int64_t M : {1, 3, 8, 17, 64}) {
      check_fp4_linear(rng, M, s[0], s[1], false, false);
      check_fp4_linear(rng, M, s[0], s[1], false, true);
    }
  check_fp4_linear(rng, 6, 130, 512, true, true);
}

TEST(CudaLinearMxfp4, K3ExpertShapes) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t shapes[][2] = {{3072, 3584}, {3584, 3072}};
  for (const auto& s : shapes)
    for (int64_t M : {1, 8, 17, 64}) check_fp4_linear(rng, M, s[0], s[1], false, false);
  check_fp4_linear(rng, 4, 3072, 3584, false, true);
}

TEST(CudaLinearMxfp4, EveryKindOfPlan) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int64_t M : {1, 17, 64}) {
    auto plans = diverse_plans(cuda::linear_mxfp4_candidates(static_cast<int>(M), 3072, 3584));
    ASSERT_FALSE(plans.empty());
    cuda::LinearPlan fb = plans.front();
    fb.fallback = true;
    plans.push_back(fb);
    for (const auto& p : plans) check_fp4_linear(rng, M, 3072, 3584, false, true, &p);
  }
}

// Every kind of warpgroup (wgmma) plan against the oracle: 1..8 token tiles (2 to 64 rows, a
// partial last tile), ragged N (64-row tiles past N) and a K slice per CTA of one chunk up,
// warps along K, clusters, ring depths; raw codes (every nibble, s = 0, the two-multiply scales)
// and quantized rows, bf16 and fp32 out. One plan twice gives the same bits.
TEST(CudaLinearMxfp4, EveryWarpgroupPlan) {
  const gpu_test::Mxfp4WgmmaScope wgmma_on;
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t shapes[][2] = {{3072, 3584}, {130, 512}, {257, 1024}};
  int n = 0;
  for (const int64_t M : {2, 8, 17, 40, 64})
    for (const auto& s : shapes) {
      std::vector<cuda::LinearPlan> wg;
      for (const auto& p : cuda::linear_mxfp4_candidates(static_cast<int>(M), s[0], s[1]))
        if (p.wg) wg.push_back(p);
      ASSERT_FALSE(wg.empty()) << M << " rows, " << s[0] << "x" << s[1];
      for (const auto& p : diverse_plans(wg)) {
        ++n;
        check_fp4_linear(rng, M, s[0], s[1], n % 3 == 0, n % 2 == 0, &p);
      }
    }
  const int64_t M = 33, N = 3072, K = 3584;
  const Bf16Data x = make_bf16(rng, static_cast<size_t>(M * K), 1.0f);
  const Fp4Weight w = make_fp4_weight(rng, N, K, true);
  for (const auto& p : cuda::linear_mxfp4_candidates(static_cast<int>(M), N, K)) {
    if (!p.wg) continue;
    DeviceBuffer<bf16> y1(static_cast<size_t>(M * N)), y2(static_cast<size_t>(M * N));
    cuda::linear_mxfp4(p, x.dev.data(), K, w.dp.data(), w.ds.data(), M, y1.data(), N, false,
                       nullptr);
    cuda::linear_mxfp4(p, x.dev.data(), K, w.dp.data(), w.ds.data(), M, y2.data(), N, false,
                       nullptr);
    EXPECT_EQ(cuda::to_host<uint16_t>(y1), cuda::to_host<uint16_t>(y2)) << p.str();
    break;
  }
}

// Phase stamps (profiling, linear_plan.h): a stamped launch writes the same bits as a plain
// one, and every CTA's stamps are in phase order, for plans with and without clusters and for
// warpgroup plans.
TEST(CudaLinearMxfp4, PhaseStampsInOrderAndSameOutput) {
  const gpu_test::Mxfp4WgmmaScope wgmma_on;
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t M = 64, N = 3072, K = 3584;
  const Bf16Data x = make_bf16(rng, static_cast<size_t>(M * K), 1.0f);
  const Fp4Weight w = make_fp4_weight(rng, N, K, false);
  std::vector<cuda::LinearPlan> tiled;
  for (const auto& p : cuda::linear_mxfp4_candidates(static_cast<int>(M), N, K))
    if (!p.streams_rows()) tiled.push_back(p);
  int checked = 0;
  for (const auto& p : diverse_plans(tiled)) {
    SCOPED_TRACE(p.str());
    DeviceBuffer<bf16> y1(static_cast<size_t>(M * N)), y2(static_cast<size_t>(M * N));
    DeviceBuffer<long long> stamps(static_cast<size_t>(p.grid_x()) * cuda::kSkinnyStamps);
    cuda::linear_mxfp4(p, x.dev.data(), K, w.dp.data(), w.ds.data(), M, y1.data(), N, false,
                       nullptr);
    cuda::linear_mxfp4(p, x.dev.data(), K, w.dp.data(), w.ds.data(), M, y2.data(), N, false,
                       nullptr, stamps.data());
    EXPECT_EQ(cuda::to_host<uint16_t>(y1), cuda::to_host<uint16_t>(y2));
    const auto h = cuda::to_host<long long>(stamps);
    for (int64_t c = 0; c < p.grid_x(); ++c) {
      const long long* s = h.data() + c * cuda::kSkinnyStamps;
      for (int i = cuda::kStampEntry; i < cuda::kStampEnd; ++i)
        ASSERT_LE(s[i], s[i + 1]) << "CTA " << c << ", stamp " << i;
      ASSERT_LT(s[cuda::kStampEntry], s[cuda::kStampEnd]) << "CTA " << c;
      ASSERT_LE(s[cuda::kStampGlobalEntry], s[cuda::kStampGlobalEnd]) << "CTA " << c;
      ASSERT_GT(s[cuda::kStampGlobalEntry], 0) << "CTA " << c;
    }
    ++checked;
  }
  EXPECT_GE(checked, 2);
  const cuda::LinearPlan gemv = cuda::plan_linear_mxfp4(1, N, K);
  if (gemv.streams_rows()) {  // the GEMV kernels have no stamps: refused, not ignored
    DeviceBuffer<bf16> y(static_cast<size_t>(N));
    DeviceBuffer<long long> stamps(static_cast<size_t>(cuda::kSkinnyStamps));
    EXPECT_THROW(cuda::linear_mxfp4(gemv, x.dev.data(), K, w.dp.data(), w.ds.data(), 1, y.data(), N,
                                    false, nullptr, stamps.data()),
                 Error);
  }
}

// The tiled kernel's alternative forms give the default's bits: x staged with cp.async
// (skinny_gemm.cuh) for mma.sync and warpgroup tilings (x loaded past the rings, or through
// registers where that did not fit), and the fast reduction (skinny_reduce.cuh) with and
// without clusters and warps along K; K ends half way into a chunk (units past K zero-filled).
// The default form is checked against the oracle.
TEST(CudaLinearMxfp4, AlternativeFormsGiveTheSameBits) {
  const gpu_test::SkinnyFormsScope defaults(false, false);
  const gpu_test::Mxfp4WgmmaScope wgmma_on;
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t N = 1024, K = 3200;  // 12.5 chunks of 256 k
  int wg_staged = 0;                 // warpgroup plans run with x loaded past their rings
  for (const int64_t M : {5, 64}) {
    const Bf16Data x = make_bf16(rng, static_cast<size_t>(M * K), 1.0f);
    const Fp4Weight w = make_fp4_weight(rng, N, K, false);
    std::vector<cuda::LinearPlan> tiled;
    for (const auto& p : cuda::linear_mxfp4_candidates(static_cast<int>(M), N, K))
      if (!p.streams_rows() && !p.fallback) tiled.push_back(p);
    std::vector<cuda::LinearPlan> plans = diverse_plans(tiled);
    const auto wg = std::find_if(tiled.begin(), tiled.end(), [](const auto& p) { return p.wg; });
    if (wg != tiled.end()) plans.push_back(*wg);
    int wg_plans = 0;
    for (const auto& p : plans) {
      SCOPED_TRACE(p.str());
      wg_plans += p.wg;
      const auto run = [&](const cuda::LinearPlan& plan, bool x_async) {
        cuda::set_skinny_x_async(x_async);
        Out y(static_cast<size_t>(M * N), false);
        cuda::linear_mxfp4(plan, x.dev.data(), K, w.dp.data(), w.ds.data(), M, y.ptr(), N, false,
                           nullptr);
        return y.get();
      };
      const std::vector<float> ref = run(p, false);
      expect_linear_output(rng, ref, w.wm, x.val, M, N, K, false,
                           shape_str("linear_mxfp4 default forms", M, N, K, false, &p));
      // The plan again under the switches (fast reduction, staging space past the rings).
      cuda::LinearPlan alt = p;
      cuda::set_skinny_x_async(true);
      cuda::set_skinny_fast_reduce(true);
      const bool fits = cuda::finalize_plan(alt, cuda::device_limits());
      cuda::set_skinny_fast_reduce(false);
      EXPECT_EQ(run(p, true), ref) << "x through cp.async";
      if (!fits) continue;  // the padded reduction tile may not fit beside the rings
      EXPECT_TRUE(alt.fast_reduce);
      wg_staged += alt.wg && alt.x_pitch > 0;
      EXPECT_EQ(run(alt, false), ref) << "fast reduction";
      EXPECT_EQ(run(alt, true), ref) << "x through cp.async, fast reduction";
    }
    EXPECT_GE(wg_plans, 1) << M << " rows";
  }
  EXPECT_GE(wg_staged, 1);
}

// The planner's cluster fit comes from the device (cudaOccupancyMaxActiveClusters): clusters of
// 8 CTAs that each need over half an SM's shared memory fit at most SMs / 8 at once (fewer where
// a GPC's SM count is not a multiple of 8: an H100 held 15, not 16), and the model's first
// tiled plan for 64 rows launches no more of them than fit.
TEST(CudaLinearMxfp4, ClusterFitFromTheDevice) {
  const cuda::DeviceLimits d = cuda::device_limits();
  const auto c = cuda::linear_mxfp4_candidates(64, 3072, 3584);
  const auto big = std::find_if(c.begin(), c.end(), [&](const cuda::LinearPlan& p) {
    return !p.streams_rows() && p.ck == 8 && p.smem_bytes > d.smem_per_sm / 2;
  });
  ASSERT_NE(big, c.end());
  const int fit = cuda::linear_mxfp4_cluster_fit(*big, 1);
  EXPECT_GE(fit, 1) << big->str();
  EXPECT_LE(fit, d.sms / 8) << big->str();
  std::printf("clusters of 8 at one CTA per SM: %d on %d SMs (%s)\n", fit, d.sms,
              big->str().c_str());
  const auto tiled =
      std::find_if(c.begin(), c.end(), [](const cuda::LinearPlan& p) { return !p.streams_rows(); });
  ASSERT_NE(tiled, c.end());
  if (tiled->ck == 8 && tiled->smem_bytes > d.smem_per_sm / 2) {
    EXPECT_LE(tiled->grid_x() / 8, fit) << tiled->str();
  }
}

// Grouped MoE form: slots read their expert and rows from device memory; a skipped slot's rows
// stay untouched (NaN), every other row is written.
// expected_active: the plan's busy slots, i.e. its rows of CTAs, which take turns over the slots.
// plan: an explicit plan instead of the launcher's choice.
void check_grouped(Rng& rng, int64_t N, int64_t K, const std::vector<int32_t>& experts,
                   const std::vector<int32_t>& counts, int max_rows, int n_experts,
                   int expected_active = 0, const cuda::LinearPlan* plan = nullptr) {
  const std::string what = "linear_mxfp4_grouped N" + std::to_string(N) + " K" + std::to_string(K) +
                           " max_rows " + std::to_string(max_rows) + " expected_active " +
                           std::to_string(expected_active) + (plan ? " plan " + plan->str() : "");
  std::vector<Fp4Weight> w;
  std::vector<const uint8_t*> tp, ts;
  for (int e = 0; e < n_experts; ++e) {
    w.push_back(make_fp4_weight(rng, N, K, e % 2 == 1));
    tp.push_back(w.back().dp.data());
    ts.push_back(w.back().ds.data());
  }
  std::vector<int32_t> offsets{0};
  for (int32_t c : counts) offsets.push_back(offsets.back() + c);
  const int64_t rows = offsets.back(), x_rows = rows + 3;
  std::vector<int32_t> row_index(static_cast<size_t>(rows));
  for (auto& r : row_index) r = static_cast<int32_t>(rng.next_u64() % x_rows);
  const Bf16Data x = make_bf16(rng, static_cast<size_t>(x_rows * K), 1.0f);
  auto d_tp = cuda::to_device<const uint8_t*>(tp);
  auto d_ts = cuda::to_device<const uint8_t*>(ts);
  auto d_exp = cuda::to_device<int32_t>(experts);
  auto d_off = cuda::to_device<int32_t>(offsets);
  auto d_row = cuda::to_device<int32_t>(row_index);
  cuda::Mxfp4Grouped g;
  g.packed = d_tp.data();
  g.scales = d_ts.data();
  g.slot_expert = d_exp.data();
  g.slot_offsets = d_off.data();
  g.row_index = d_row.data();
  g.n_slots = static_cast<int>(experts.size());
  g.max_rows_per_slot = max_rows;
  g.expected_active = expected_active;
  Out y(static_cast<size_t>(rows * N), false);
  if (plan)
    cuda::linear_mxfp4_grouped(*plan, g, x.dev.data(), K, y.ptr(), N, false, nullptr);
  else
    cuda::linear_mxfp4_grouped(g, x.dev.data(), K, N, K, y.ptr(), N, false, nullptr);
  const std::vector<float> got = y.get();
  const auto sample = sample_rows(rng, N, 256);
  for (size_t s = 0; s < experts.size(); ++s) {
    for (int32_t r = offsets[s]; r < offsets[s + 1]; ++r) {
      const std::vector<float> row(got.begin() + r * N, got.begin() + (r + 1) * N);
      const std::string rw = what + " slot " + std::to_string(s) + " row " + std::to_string(r);
      if (experts[s] < 0) {
        EXPECT_TRUE(std::all_of(row.begin(), row.end(), [](float v) { return std::isnan(v); }))
            << rw << ": a skipped slot's row was written";
        continue;
      }
      expect_all_finite(row, rw);
      std::vector<float> xr(x.val.begin() + row_index[r] * K,
                            x.val.begin() + (row_index[r] + 1) * K);
      expect_close(gather(row, N, 1, sample), ref_linear(w[experts[s]].wm, xr, K, 1, sample, true),
                   kGemmBf16Out, rw);
    }
  }
}

TEST(CudaLinearMxfp4, GroupedExperts) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  // Expert 3 twice, a skipped slot (-1), an empty slot; tiled (bound 5) and generic (bound 70).
  check_grouped(rng, 200, 512, {3, -1, 0, 3, 1}, {2, 1, 0, 5, 1}, 5, 5);
  // Fewer rows of CTAs than busy slots: each row takes several slots in turn.
  for (int busy : {1, 2})
    check_grouped(rng, 200, 512, {3, -1, 0, 3, 1}, {2, 1, 0, 5, 1}, 5, 5, busy);
  check_grouped(rng, 3072, 3584, {1, 2, 0}, {1, 1, 2}, 2, 3, 1);
  check_grouped(rng, 3072, 3584, {2, 0}, {1, 3}, 3, 3);
  check_grouped(rng, 130, 512, {1, 0}, {70, 2}, 70, 2);
  check_grouped(rng, 64, 96, {0, 1}, {3, 1}, 3, 2);  // K % 256 != 0: generic kernel
}

// A grouped launch's slots (experts, rows) on an n x k expert shape, and its busy-slot count
// (the plan's rows of CTAs).
struct GroupedCase {
  int64_t n, k;
  std::vector<int32_t> experts, counts;
  int max_rows, n_experts, busy;
};

// Case c's candidate plans that pass keep.
template <class Keep>
std::vector<cuda::LinearPlan> grouped_plans(const GroupedCase& c, Keep keep) {
  std::vector<cuda::LinearPlan> out;
  for (const auto& p :
       cuda::linear_mxfp4_candidates(c.max_rows, c.n, c.k, static_cast<int>(c.experts.size())))
    if (keep(p)) out.push_back(p);
  return out;
}

// check_grouped of case c under plan p.
void check_grouped_case(Rng& rng, const GroupedCase& c, cuda::LinearPlan p) {
  p.active_groups = c.busy;
  check_grouped(rng, c.n, c.k, c.experts, c.counts, c.max_rows, c.n_experts, c.busy, &p);
}

// The grouped launch under warpgroup plans: skipped and empty slots, expert reuse, fewer rows of
// CTAs than busy slots, slots with fewer rows than the plan's token tiles.
TEST(CudaLinearMxfp4, GroupedExpertsWarpgroupPlans) {
  const gpu_test::Mxfp4WgmmaScope wgmma_on;
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const GroupedCase cases[] = {{200, 512, {3, -1, 0, 3, 1}, {2, 1, 0, 5, 1}, 5, 5, 0},
                               {200, 512, {3, -1, 0, 3, 1}, {2, 1, 0, 5, 1}, 5, 5, 2},
                               {3072, 3584, {2, 0}, {17, 3}, 17, 3, 0},
                               {3584, 3072, {1, -1, 0}, {40, 2, 64}, 64, 2, 1}};
  for (const GroupedCase& c : cases) {
    const auto wg = grouped_plans(c, [](const cuda::LinearPlan& p) { return p.wg; });
    ASSERT_FALSE(wg.empty());
    check_grouped_case(rng, c, wg.front());
    check_grouped_case(rng, c, wg.back());
  }
}

// Every MXFP4 GEMV plan (1..8 rows, 1, 2 or 4 pieces per warp) against the oracle: the expert
// shapes, ragged N (rows past N in the last CTA), K with fewer pieces than a warp takes, raw
// codes (every nibble, s = 0 and the two-multiply scales), bf16 and fp32 out. Every plan of a
// shape gives the same bits (each 128-k piece is summed on its own, then the pieces in order).
TEST(CudaLinearMxfp4, EveryGemvPlan) {
  const gpu_test::Mxfp4GemvScope gemv_on;
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t shapes[][2] = {{3072, 3584}, {3584, 3072}, {40, 256}, {257, 1024}, {130, 768}};
  int n = 0;
  for (const int64_t M : {1, 2, 3, 5, 8})
    for (const auto& s : shapes)
      for (const auto& p : cuda::linear_mxfp4_candidates(static_cast<int>(M), s[0], s[1])) {
        if (!p.gemv_fp4()) continue;
        ++n;
        check_fp4_linear(rng, M, s[0], s[1], n % 3 == 0, n % 2 == 0, &p);
      }
  EXPECT_EQ(n, 5 * 5 * 3);
  for (const int64_t M : {1, 3}) {
    const int64_t N = 3584, K = 3072;
    const Bf16Data x = make_bf16(rng, static_cast<size_t>(M * K), 1.0f);
    const Fp4Weight w = make_fp4_weight(rng, N, K, true);
    std::vector<uint16_t> first;
    for (const auto& p : cuda::linear_mxfp4_candidates(static_cast<int>(M), N, K)) {
      if (!p.gemv_fp4()) continue;
      DeviceBuffer<bf16> y(static_cast<size_t>(M * N));
      cuda::linear_mxfp4(p, x.dev.data(), K, w.dp.data(), w.ds.data(), M, y.data(), N, false,
                         nullptr);
      const auto bits = cuda::to_host<uint16_t>(y);
      if (first.empty())
        first = bits;
      else
        EXPECT_EQ(bits, first) << p.str() << ": another GEMV plan's bits";
    }
  }
}

// The grouped launch under every MXFP4 GEMV plan: skipped and empty slots, expert reuse, fewer
// rows of CTAs than busy slots, one and several rows per slot.
TEST(CudaLinearMxfp4, GroupedExpertsEveryGemvPlan) {
  const gpu_test::Mxfp4GemvScope gemv_on;
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const GroupedCase cases[] = {{200, 512, {3, -1, 0, 3, 1}, {2, 1, 0, 5, 1}, 5, 5, 0},
                               {200, 512, {3, -1, 0, 3, 1}, {2, 1, 0, 5, 1}, 5, 5, 1},
                               {3072, 3584, {1, 2, 0}, {1, 1, 1}, 1, 3, 1},
                               {3584, 3072, {-1, 0, 1, -1}, {1, 1, 1, 0}, 1, 2, 2},
                               {3072, 3584, {2, 0}, {1, 8}, 8, 3, 0}};
  for (const GroupedCase& c : cases) {
    const auto gemv = grouped_plans(c, [](const cuda::LinearPlan& p) { return p.gemv_fp4(); });
    EXPECT_EQ(gemv.size(), 3u);
    for (const auto& p : gemv) check_grouped_case(rng, c, p);
  }
}

// A CUDA graph replay of a launch is bit-identical to the eager launch (and to itself).
TEST(CudaGraph, ReplayEqualsEager) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  cudaStream_t st;
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int64_t M = 8, N = 768, K = 7168;
  const Bf16Data x = make_bf16(rng, M * K, 1.0f);
  const Bf16Weight w = make_bf16_weight(rng, N, K);
  const Fp4Weight w4 = make_fp4_weight(rng, 3072, 3584, false);
  const Bf16Data x4 = make_bf16(rng, M * 3584, 1.0f);
  Out y(M * N, false), y4(M * 3072, true);
  auto launch = [&] {
    cuda::linear_bf16(x.dev.data(), K, w.d.dev.data(), M, N, K, y.ptr(), N, false, st);
    cuda::linear_mxfp4(x4.dev.data(), 3584, w4.dp.data(), w4.ds.data(), M, 3072, 3584, y4.ptr(),
                       3072, true, st);
  };
  launch();
  const auto eager = y.get(), eager4 = y4.get();
  y.poison();
  y4.poison();
  launch();
  EXPECT_EQ(y.get(), eager) << "two eager launches differ";
  EXPECT_EQ(y4.get(), eager4) << "two eager launches differ (mxfp4)";

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  K3_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  launch();
  K3_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  K3_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) {
    y.poison();
    y4.poison();
    K3_CUDA_CHECK(cudaGraphLaunch(exec, st));
    K3_CUDA_CHECK(cudaStreamSynchronize(st));
    const auto g = y.get(), g4 = y4.get();
    expect_all_finite(g, "graph replay");
    // Compare bits (NaN-free, so float equality is bit equality up to the sign of zero).
    EXPECT_EQ(0, std::memcmp(g.data(), eager.data(), g.size() * sizeof(float))) << "replay " << rep;
    EXPECT_EQ(0, std::memcmp(g4.data(), eager4.data(), g4.size() * sizeof(float)))
        << "replay " << rep;
  }
  K3_CUDA_CHECK(cudaGraphExecDestroy(exec));
  K3_CUDA_CHECK(cudaGraphDestroy(graph));
  K3_CUDA_CHECK(cudaStreamDestroy(st));
}

}  // namespace
}  // namespace k3
