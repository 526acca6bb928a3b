// Every CUDA stock-path op against its CPU oracle (src/cpu/ops_*.h), on fresh random inputs
// (the seed is printed; K3_TEST_SEED replays it). Outputs are poisoned with NaN before each
// launch and every element must be written. main() is in gpu_main.cu (exit 77 without a GPU).
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
#include "cuda/linear_bf16.h"
#include "cuda/linear_mxfp4.h"
#include "cuda/rms_norm.h"
#include "gpu/gpu_check_util.h"
#include "model/weight_matrix.h"
#include "test_util.h"

namespace k3 {
namespace {

using gpu_test::bf16_ulp;
using gpu_test::expect_close;
using gpu_test::rms;
using gpu_test::Tol;

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

using cuda::bf16;
using cuda::DeviceBuffer;

// Every got[i] finite and within tol of ref[i].
void expect_all_finite(const std::vector<float>& v, const std::string& what) {
  int64_t n = 0;
  for (float x : v) n += !std::isfinite(x);
  EXPECT_EQ(n, 0) << what << ": " << n << " of " << v.size() << " elements not written";
}

// bf16 data on both sides: bits on the device, values on the host.
struct Bf16Data {
  std::vector<uint16_t> bits;
  std::vector<float> val;
  DeviceBuffer<bf16> dev;
};
Bf16Data make_bf16(Rng& rng, size_t n, float scale) {
  Bf16Data d;
  d.bits = test::random_bf16(rng, n, scale);
  d.val.resize(n);
  for (size_t i = 0; i < n; ++i) d.val[i] = bf16_to_float(d.bits[i]);
  d.dev = cuda::to_device<bf16>(d.bits);
  return d;
}

std::vector<float> bf16_to_floats(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_float(b[i]);
  return f;
}

// Output buffer poisoned with NaN (all-ones bytes), read back as floats.
struct Out {
  DeviceBuffer<uint8_t> buf;
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

// ============================== skinny GEMMs ==============================

// Weight rows checked against the CPU: all of them for small N, else random 16-row blocks plus
// the last block (the ragged tile), at most max_rows.
std::vector<int64_t> sample_rows(Rng& rng, int64_t n, int64_t max_rows = 512) {
  std::vector<int64_t> rows;
  if (n <= max_rows) {
    for (int64_t r = 0; r < n; ++r) rows.push_back(r);
    return rows;
  }
  std::vector<int64_t> starts;
  for (int64_t b = 0; b < max_rows / 16 - 1; ++b)
    starts.push_back(static_cast<int64_t>(rng.uniform() * static_cast<double>(n - 16)));
  starts.push_back(n - 16);
  std::sort(starts.begin(), starts.end());
  for (int64_t s0 : starts)
    for (int64_t r = s0; r < s0 + 16; ++r)
      if (rows.empty() || r > rows.back()) rows.push_back(r);
  return rows;
}

// CPU oracle y[m][rows[i]] (cpu::linear_rows), rounded to bf16 when the GPU stores bf16.
std::vector<float> ref_linear(const WeightMatrix& w, const std::vector<float>& x, int64_t ldx,
                              int64_t m_count, const std::vector<int64_t>& rows, bool round) {
  std::vector<float> out(static_cast<size_t>(m_count) * rows.size());
  for (int64_t m = 0; m < m_count; ++m) {
    size_t i = 0;
    while (i < rows.size()) {
      size_t j = i + 1;  // a run of consecutive rows in one call
      while (j < rows.size() && rows[j] == rows[j - 1] + 1) ++j;
      cpu::linear_rows(w, rows[i], static_cast<int64_t>(j - i), x.data() + m * ldx,
                       out.data() + m * rows.size() + i);
      i = j;
    }
  }
  if (round) round_bf16(out);
  return out;
}

std::vector<float> gather(const std::vector<float>& y, int64_t ldy, int64_t m_count,
                          const std::vector<int64_t>& rows) {
  std::vector<float> g;
  for (int64_t m = 0; m < m_count; ++m)
    for (int64_t r : rows) g.push_back(y[m * ldy + r]);
  return g;
}

std::string shape_str(const char* what, int64_t M, int64_t N, int64_t K, bool f32,
                      const cuda::LinearPlan* p) {
  return std::string(what) + " M" + std::to_string(M) + " N" + std::to_string(N) + " K" +
         std::to_string(K) + (f32 ? " fp32-out" : " bf16-out") + (p ? " plan " + p->str() : "");
}

struct Bf16Weight {
  Bf16Data d;
  WeightMatrix wm;
};
Bf16Weight make_bf16_weight(Rng& rng, int64_t N, int64_t K) {
  Bf16Weight w;
  w.d = make_bf16(rng, static_cast<size_t>(N * K), 1.0f / std::sqrt(static_cast<float>(K)));
  w.wm.name = "w";
  w.wm.format = WeightFormat::BF16;
  w.wm.rows = N;
  w.wm.cols = K;
  w.wm.data = w.d.bits.data();
  return w;
}

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
  const std::vector<float> got = y.get();
  expect_all_finite(got, what);
  const auto rows = sample_rows(rng, N);
  expect_close(gather(got, N, M, rows), ref_linear(w.wm, x.val, K, M, rows, !f32),
               f32 ? kGemmF32Out : kGemmBf16Out, what);
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

// A spread of tilings (cluster sizes, warps along K, ring depths, row tiles) and the generic
// kernel, all against the oracle.
std::vector<cuda::LinearPlan> diverse_plans(const std::vector<cuda::LinearPlan>& c) {
  std::vector<cuda::LinearPlan> out;
  auto add = [&](auto pred) {
    for (const auto& p : c)
      if (pred(p)) {
        for (const auto& q : out)
          if (q.str() == p.str()) return;
        out.push_back(p);
        return;
      }
  };
  for (size_t i = 0; i < std::min<size_t>(3, c.size()); ++i) out.push_back(c[i]);
  using P = const cuda::LinearPlan&;
  add([](P p) { return p.ck == 1 && p.wk == 1; });
  add([](P p) { return p.ck == 2; });
  add([](P p) { return p.ck >= 5; });
  add([](P p) { return p.wk >= 3; });
  add([](P p) { return p.stages == 2; });
  add([](P p) { return p.stages == 6; });
  add([](P p) { return p.mt == 2; });
  add([](P p) { return p.wn >= 5; });
  return out;
}

TEST(CudaLinearBf16, EveryKindOfPlan) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
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

struct Fp4Weight {
  std::vector<uint8_t> packed, scales;
  DeviceBuffer<uint8_t> dp, ds;
  WeightMatrix wm;
};
// raw: every nibble and a range of scales, including s > 128 (two-multiply path) and s = 0;
// otherwise quantized N(0, 1/K) rows as the synthetic checkpoints.
Fp4Weight make_fp4_weight(Rng& rng, int64_t N, int64_t K, bool raw) {
  Fp4Weight w;
  w.packed.resize(static_cast<size_t>(N * K / 2));
  w.scales.resize(static_cast<size_t>(N * K / 32));
  if (raw) {
    for (auto& b : w.packed) b = static_cast<uint8_t>(rng.next_u64());
    for (auto& s : w.scales)
      s = static_cast<uint8_t>(rng.uniform() < 0.02 ? 0 : 112 + rng.next_u64() % 28);
  } else {
    const auto f = test::random_normal(rng, static_cast<size_t>(N * K),
                                       1.0f / std::sqrt(static_cast<float>(K)));
    quantize_mxfp4(f.data(), N, K, w.packed.data(), w.scales.data());
  }
  w.dp = cuda::to_device<uint8_t>(w.packed);
  w.ds = cuda::to_device<uint8_t>(w.scales);
  w.wm.name = "w";
  w.wm.format = WeightFormat::MXFP4;
  w.wm.rows = N;
  w.wm.cols = K;
  w.wm.data = w.packed.data();
  w.wm.scales = w.scales.data();
  return w;
}

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
  const std::vector<float> got = y.get();
  expect_all_finite(got, what);
  const auto rows = sample_rows(rng, N);
  expect_close(gather(got, N, M, rows), ref_linear(w.wm, x.val, K, M, rows, !f32),
               f32 ? kGemmF32Out : kGemmBf16Out, what);
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
