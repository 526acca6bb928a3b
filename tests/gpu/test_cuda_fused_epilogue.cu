// What the specialized step folds into its GEMMs must give the bits of the separate launches it
// replaces: the residual adds in a bf16 GEMM's store (LinearEpilogue: o-projection + residual,
// latent up + shared experts + residual), and the GLU applied while the expert down-projection
// stages its input. Fresh random inputs per run (the seed is printed; K3_TEST_SEED replays it),
// tiled and generic kernels.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "cuda/check.h"
#include "cuda/device_buffer.h"
#include "cuda/glu.h"
#include "cuda/linear_bf16.h"
#include "cuda/linear_mxfp4.h"
#include "cuda/step_ops.h"
#include "gpu/gpu_check_util.h"
#include "model/weight_matrix.h"
#include "test_util.h"

namespace k3 {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;

// y = x W^T with (add, res) folded in, against linear_bf16 then add_bf16 (then add_bf16 or a
// copy into res): y and res bit for bit.
void check_epilogue(Rng& rng, int64_t M, int64_t N, int64_t K, bool with_add, bool with_res,
                    bool res_copy) {
  const std::string what = "M" + std::to_string(M) + " N" + std::to_string(N) + " K" +
                           std::to_string(K) + (with_add ? " add" : "") +
                           (with_res ? (res_copy ? " res=y" : " res+=y") : "");
  SCOPED_TRACE(what);
  const auto x = cuda::to_device<bf16>(test::random_bf16(rng, static_cast<size_t>(M * K), 1.0f));
  const auto w = cuda::to_device<bf16>(
      test::random_bf16(rng, static_cast<size_t>(N * K), 1.0f / std::sqrt(static_cast<float>(K))));
  const auto add_h = test::random_bf16(rng, static_cast<size_t>(M * N), 1.0f);
  const auto res_h = test::random_bf16(rng, static_cast<size_t>(M * N), 2.0f);
  const auto add = cuda::to_device<bf16>(add_h);

  // Reference: the separate launches.
  DeviceBuffer<bf16> y_ref(static_cast<size_t>(M * N)), res_ref = cuda::to_device<bf16>(res_h);
  cuda::linear_bf16(x.data(), K, w.data(), M, N, K, y_ref.data(), N, false, nullptr);
  if (with_add) cuda::add_bf16(y_ref.data(), add.data(), M * N, y_ref.data(), nullptr);
  if (with_res && res_copy)
    K3_CUDA_CHECK(
        cudaMemcpy(res_ref.data(), y_ref.data(), y_ref.size() * 2, cudaMemcpyDeviceToDevice));
  else if (with_res)
    cuda::add_bf16(res_ref.data(), y_ref.data(), M * N, res_ref.data(), nullptr);

  DeviceBuffer<bf16> y(static_cast<size_t>(M * N)), res = cuda::to_device<bf16>(res_h);
  y.fill_bytes(0xff);
  cuda::LinearEpilogue epi;
  epi.add = with_add ? add.data() : nullptr;
  epi.res = with_res ? res.data() : nullptr;
  epi.res_copy = res_copy;
  cuda::linear_bf16(x.data(), K, w.data(), M, N, K, y.data(), N, epi, nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(cuda::to_host<uint16_t>(y), cuda::to_host<uint16_t>(y_ref)) << "y";
  EXPECT_EQ(cuda::to_host<uint16_t>(res), cuda::to_host<uint16_t>(res_ref)) << "res";
}

TEST(CudaFusedEpilogue, ResidualAddsEqualTheSeparateAdds) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  // The K3 rank's o-projections and latent up-projection (tiled), and an odd K (generic kernel).
  for (const auto& [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 7168, 768},
                                {3, 7168, 3584},
                                {8, 7168, 768},
                                {2, 100, 36}})
    for (const bool with_add : {false, true})
      for (const bool with_res : {false, true})
        for (const bool res_copy : {false, true}) {
          if (!with_res && res_copy) continue;
          check_epilogue(rng, M, N, K, with_add, with_res, res_copy);
        }
}

// The expert down-projection on glu(g, u) computed in the GEMM against cuda::glu into bf16 h
// and the grouped GEMM on h: bit for bit, over skipped, empty and multi-row slots.
// counts: rows per slot; max_rows: the launch's bound on them.
void check_glu_gemm(Rng& rng, const cuda::GluAct& act, int64_t N, int64_t K,
                    const std::vector<int32_t>& counts = {1, 2, 0, 3, 2}, int max_rows = 3) {
  const std::string what = "glu kind " + std::to_string(static_cast<int>(act.kind)) + " N" +
                           std::to_string(N) + " K" + std::to_string(K) + " max_rows " +
                           std::to_string(max_rows);
  SCOPED_TRACE(what);
  const int n_experts = 3;
  std::vector<std::vector<uint8_t>> packed, scales;
  std::vector<DeviceBuffer<uint8_t>> dp, ds;
  std::vector<const uint8_t*> tp, ts;
  for (int e = 0; e < n_experts; ++e) {
    const auto f = test::random_normal(rng, static_cast<size_t>(N * K),
                                       1.0f / std::sqrt(static_cast<float>(K)));
    packed.emplace_back(static_cast<size_t>(N * K / 2));
    scales.emplace_back(static_cast<size_t>(N * K / 32));
    quantize_mxfp4(f.data(), N, K, packed.back().data(), scales.back().data());
    dp.push_back(cuda::to_device<uint8_t>(packed.back()));
    ds.push_back(cuda::to_device<uint8_t>(scales.back()));
    tp.push_back(dp.back().data());
    ts.push_back(ds.back().data());
  }
  const std::vector<int32_t> slot_expert = {2, -1, 0, 1, 0};
  std::vector<int32_t> offsets{0};
  for (int32_t c : counts) offsets.push_back(offsets.back() + c);
  const int64_t rows = offsets.back();
  // g | u side by side per grouped row, as the fused w1|w3 GEMM writes them (fp32).
  const std::vector<float> gu = test::random_normal(rng, static_cast<size_t>(rows * 2 * K), 2.5f);
  const auto d_gu = cuda::to_device<float>(gu);
  const auto d_tp = cuda::to_device<const uint8_t*>(tp);
  const auto d_ts = cuda::to_device<const uint8_t*>(ts);
  const auto d_exp = cuda::to_device<int32_t>(slot_expert);
  const auto d_off = cuda::to_device<int32_t>(offsets);
  cuda::Mxfp4Grouped g;
  g.packed = d_tp.data();
  g.scales = d_ts.data();
  g.slot_expert = d_exp.data();
  g.slot_offsets = d_off.data();
  g.n_slots = static_cast<int>(slot_expert.size());
  g.max_rows_per_slot = max_rows;
  g.expected_active = 1;  // the EP rank's plan: one busy slot spread over the GPU

  DeviceBuffer<bf16> h(static_cast<size_t>(rows * K)), y_ref(static_cast<size_t>(rows * N));
  DeviceBuffer<bf16> y(static_cast<size_t>(rows * N));
  y_ref.fill_bytes(0xff);
  y.fill_bytes(0xff);
  cuda::glu(act, d_gu.data(), 2 * K, d_gu.data() + K, 2 * K, rows, K, h.data(), K, nullptr);
  cuda::linear_mxfp4_grouped(g, h.data(), K, N, K, y_ref.data(), N, false, nullptr);
  ASSERT_TRUE(cuda::grouped_glu_supported(g, K, d_gu.data(), 2 * K, K));
  cuda::linear_mxfp4_grouped_glu(g, d_gu.data(), 2 * K, K, act, N, K, y.data(), N, false, nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  // Rows of the skipped slot stay poisoned in both.
  EXPECT_EQ(cuda::to_host<uint16_t>(y), cuda::to_host<uint16_t>(y_ref));
  EXPECT_FALSE(cuda::grouped_glu_supported(g, 96, d_gu.data(), 2 * K, K)) << "K % 256 != 0";
  EXPECT_FALSE(cuda::grouped_glu_supported(g, K, d_gu.data() + 1, 2 * K, K)) << "misaligned";
}

TEST(CudaFusedGlu, ExpertDownWithGluEqualsGluThenGemm) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  cuda::GluAct situ{cuda::GluAct::Kind::SiTU, 4.0f, true, 25.0f};
  cuda::GluAct situ_nolin{cuda::GluAct::Kind::SiTU, 3.0f, false, 0.0f};
  cuda::GluAct silu;
  for (const cuda::GluAct& act : {situ, situ_nolin, silu}) {
    check_glu_gemm(rng, act, 3584, 3072);  // K3's expert down-projection
    check_glu_gemm(rng, act, 200, 512);
  }
}

// One row per slot under the model's plans: the MXFP4 GEMV, staging glu(g, u) itself.
TEST(CudaFusedGlu, OneRowGemvWithGluEqualsGluThenGemv) {
  const gpu_test::Mxfp4GemvScope gemv_on;
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const bool tuning = cuda::linear_tuning();
  cuda::set_linear_tuning(false);
  for (const auto& [N, K] : {std::pair<int64_t, int64_t>{3584, 3072}, {144, 768}}) {
    const auto plans = cuda::linear_candidates(cuda::LinearWeight::MXFP4, 1, N, K, 5,
                                               cuda::device_limits(), nullptr, 1);
    ASSERT_TRUE(!plans.empty() && plans.front().gemv_fp4()) << "the model's one-row pick";
    check_glu_gemm(rng, cuda::GluAct{cuda::GluAct::Kind::SiTU, 4.0f, true, 25.0f}, N, K,
                   {1, 1, 0, 1, 1}, 1);
  }
  cuda::set_linear_tuning(tuning);
}

// The latent up GEMV computing its input as the MoE combine (+ latent norm) of the expert
// outputs (linear_bf16_combined) against moe_combine then the same GEMV: y (and res) bit for
// bit. plan: an explicit GEMV plan (no epilogue), or null: the shape's own plan with the
// residual epilogue. ep: shuffled positions, about a third of them other ranks' experts (-1).
void check_combined(Rng& rng, int64_t M, int64_t N, int64_t K, int top_k, bool norm, bool ep,
                    const cuda::LinearPlan* plan) {
  const std::string what = "M" + std::to_string(M) + " N" + std::to_string(N) + " K" +
                           std::to_string(K) + " top_k " + std::to_string(top_k) +
                           (norm ? " norm" : "") + (ep ? " ep" : "") +
                           (plan ? " plan " + plan->str() : " planned");
  SCOPED_TRACE(what);
  const int64_t pairs = M * top_k;
  const auto ey = cuda::to_device<bf16>(test::random_bf16(rng, static_cast<size_t>(pairs * K)));
  std::vector<float> wh(static_cast<size_t>(pairs)), nwh(static_cast<size_t>(K));
  for (float& v : wh) v = rng.uniform(0.05f, 2.5f);
  for (float& v : nwh) v = rng.uniform(0.5f, 1.5f);
  std::vector<int32_t> pos(static_cast<size_t>(pairs));
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i);
  if (ep) {
    for (size_t i = pos.size() - 1; i > 0; --i)
      std::swap(pos[i], pos[rng.next_u64() % static_cast<uint64_t>(i + 1)]);
    for (int32_t& p : pos)
      if (rng.next_u64() % 3 == 0) p = -1;
  }
  const auto ew = cuda::to_device<float>(wh);
  const auto enw = cuda::to_device<float>(nwh);
  const auto epos = cuda::to_device<int32_t>(pos);
  const auto w = cuda::to_device<bf16>(
      test::random_bf16(rng, static_cast<size_t>(N * K), 1.0f / std::sqrt(static_cast<float>(K))));
  const auto add = cuda::to_device<bf16>(test::random_bf16(rng, static_cast<size_t>(M * N), 1.0f));
  const auto res_h = test::random_bf16(rng, static_cast<size_t>(M * N), 2.0f);
  cuda::CombinedInput c;
  c.y = ey.data();
  c.y_pos = ep ? epos.data() : nullptr;
  c.weights = ew.data();
  c.top_k = top_k;
  c.norm_w = norm ? enw.data() : nullptr;
  c.eps = 1e-5f;

  // Reference: the combine kernel into x, then the GEMM (with the epilogue where planned).
  DeviceBuffer<bf16> x(static_cast<size_t>(M * K)), y_ref(static_cast<size_t>(M * N));
  DeviceBuffer<bf16> res_ref = cuda::to_device<bf16>(res_h), res = cuda::to_device<bf16>(res_h);
  cuda::moe_combine(c.y, c.weights, M, top_k, K, c.norm_w, c.eps, x.data(), nullptr, c.y_pos);
  cuda::LinearEpilogue epi;
  epi.add = add.data();
  epi.res = res_ref.data();
  if (plan)
    cuda::linear_bf16(*plan, x.data(), K, w.data(), M, y_ref.data(), N, false, nullptr);
  else
    cuda::linear_bf16(x.data(), K, w.data(), M, N, K, y_ref.data(), N, epi, nullptr);

  DeviceBuffer<bf16> y(static_cast<size_t>(M * N));
  y.fill_bytes(0xff);
  epi.res = res.data();
  x.fill_bytes(0xff);  // not read: the fused launch stages the combine itself
  if (plan)
    cuda::linear_bf16_combined(*plan, c, w.data(), M, y.data(), N, nullptr);
  else
    ASSERT_TRUE(
        cuda::linear_bf16_combined(c, x.data(), w.data(), M, N, K, y.data(), N, epi, nullptr))
        << "the shape's plan is the GEMV (checked by the caller)";
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(cuda::to_host<uint16_t>(y), cuda::to_host<uint16_t>(y_ref)) << "y";
  if (!plan) EXPECT_EQ(cuda::to_host<uint16_t>(res), cuda::to_host<uint16_t>(res_ref)) << "res";
}

TEST(CudaFusedEpilogue, CombineInGemvEqualsCombineThenGemv) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const bool tuning = cuda::linear_tuning();
  cuda::set_linear_tuning(false);  // the model's picks: the GEMV at one row
  // The shape's own plan with the residual epilogue: K3's latent up (7168 x 3584, top-16).
  ASSERT_TRUE(cuda::plan_linear_bf16(1, 7168, 3584).gemv()) << "the model's one-row pick";
  for (const bool norm : {true, false})
    for (const bool ep : {false, true}) check_combined(rng, 1, 7168, 3584, 16, norm, ep, nullptr);
  check_combined(rng, 1, 7168, 3584, 64, true, true, nullptr);  // the widest top-k
  // Every k split of the GEMV at 1..4 rows: the latent up, a small odd N, the widest one-pass K.
  for (const auto& [M, N, K] : {std::tuple<int64_t, int64_t, int64_t>{1, 7168, 3584},
                                {2, 7168, 3584},
                                {3, 200, 264},
                                {4, 96, 4096}}) {
    int last_ks = 0;
    for (const cuda::LinearPlan& p : cuda::linear_bf16_candidates(static_cast<int>(M), N, K)) {
      if (!p.gemv() || p.gemv_ks == last_ks) continue;
      last_ks = p.gemv_ks;
      check_combined(rng, M, N, K, 16, /*norm=*/true, /*ep=*/M % 2 == 0, &p);
    }
    EXPECT_GT(last_ks, 0) << "no GEMV plan for " << M << "x" << N << "x" << K;
  }
  // Not the GEMV's (more rows than it takes, or K past one pass): nothing launched.
  cuda::CombinedInput c;
  DeviceBuffer<bf16> buf(8 * 4104);
  DeviceBuffer<float> wts(8 * 16);
  c.y = buf.data(), c.weights = wts.data(), c.top_k = 16;
  EXPECT_FALSE(
      cuda::linear_bf16_combined(c, buf.data(), buf.data(), 8, 8, 512, buf.data(), 8, {}, nullptr));
  EXPECT_FALSE(cuda::linear_bf16_combined(c, buf.data(), buf.data(), 1, 8, 4104, buf.data(), 8, {},
                                          nullptr));
  cuda::set_linear_tuning(tuning);
}

}  // namespace
}  // namespace k3
