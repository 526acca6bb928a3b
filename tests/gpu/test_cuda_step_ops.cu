// The decode step's glue ops (cuda/step_ops.h) against float64 / exact host loops on fresh
// random bf16-valued inputs (the seed is printed; K3_TEST_SEED replays it), at the tiny test
// model's shapes and at K3's. Outputs are poisoned with NaN before each launch, so every element
// must be written (and elements that must not be written must still be NaN).
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "core/rng.h"
#include "cuda/device_buffer.h"
#include "cuda/step_ops.h"
#include "gpu/gpu_check_util.h"
#include "test_util.h"

namespace k3 {
namespace {

using cuda::bf16;
using cuda::DeviceBuffer;
using gpu_test::expect_close;
using gpu_test::Tol;

// ---- Tolerances: |gpu - ref| <= ulps * ulp_bf16(|ref|) + rel * RMS(ref), ref in float64 on the
// same bf16 inputs. Copies (embed, q_pe, cache append) and the bf16 add are compared bit for bit
// against the same fp32 arithmetic on the host. ----
// fp32 sums of <= 7168 products of unit-normal values stay within ~1e-6 of the RMS; one bf16
// rounding of the result may land on the other side of a tie point: 1 ulp.
constexpr Tol kDotBf16{1.0, 1e-5};
constexpr Tol kDotF32{0.0, 1e-5};
// Gated output: o is rounded to bf16 before the gate, so a flipped rounding of o (1 ulp of o) is
// scaled by sigmoid and rounded again: up to ~2 ulps of the result.
constexpr Tol kGated{2.5, 1e-5};
// MoE combine: <= 8 fp32 products per element (order as the CPU); the rms_norm scale comes from
// an fp32 sum of squares over the width.
constexpr Tol kCombine{1.0, 1e-6};
constexpr Tol kCombineNorm{1.0, 1e-5};

struct MlaShape {
  const char* name;
  int heads, nope, rope, v, kv_lora;
};
const MlaShape kTiny2{"tiny h2", 2, 16, 8, 16, 32};
const MlaShape kTiny4{"tiny h4", 4, 16, 8, 16, 32};
const MlaShape kK3Tp{"K3 h6", 6, 128, 64, 128, 512};
const MlaShape kK3Full{"K3 h96", 96, 128, 64, 128, 512};

std::vector<float> bf16_host(const DeviceBuffer<bf16>& d) {
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> h = cuda::to_host<uint16_t>(d);
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = bf16_to_float(h[i]);
  return f;
}
std::vector<uint16_t> bits_host(const DeviceBuffer<bf16>& d) {
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  return cuda::to_host<uint16_t>(d);
}
double f(uint16_t b) {
  return static_cast<double>(bf16_to_float(b));
}
double sigmoid64(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// ============================== embed_rows ==============================

TEST(CudaStepOps, EmbedRowsCopiesAndZeroesOutOfRange) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int64_t hidden : {128, 7168, 100}) {  // 100: not a multiple of 8 (scalar path)
    const int64_t vocab = 777;
    const std::vector<uint16_t> emb = test::random_bf16(rng, static_cast<size_t>(vocab * hidden));
    std::vector<int32_t> tok{0, 776, -1, 777, 5, 300, 300, 123456};
    for (int i = 0; i < 9; ++i) tok.push_back(static_cast<int32_t>(rng.next_u64() % vocab));
    const int64_t rows = static_cast<int64_t>(tok.size());
    auto d_emb = cuda::to_device<bf16>(emb);
    auto d_tok = cuda::to_device<int32_t>(tok);
    DeviceBuffer<bf16> out(static_cast<size_t>(rows * hidden));
    out.fill_bytes(0xff);
    cuda::embed_rows(d_emb.data(), vocab, hidden, d_tok.data(), rows, out.data(), nullptr);
    K3_CUDA_CHECK_LAUNCH();
    const std::vector<uint16_t> got = bits_host(out);
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < hidden; ++c) {
        const bool ok = tok[r] >= 0 && tok[r] < vocab;
        const uint16_t want = ok ? emb[static_cast<size_t>(tok[r] * hidden + c)] : 0;
        bad += got[static_cast<size_t>(r * hidden + c)] != want;
      }
    EXPECT_EQ(bad, 0) << "hidden " << hidden;
  }
}

// ============================== add_bf16 ==============================

TEST(CudaStepOps, AddBf16MatchesFp32AddAndAliases) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int64_t n : {int64_t{128}, int64_t{7168} * 13, int64_t{1001}}) {
    const std::vector<uint16_t> a = test::random_bf16(rng, static_cast<size_t>(n));
    const std::vector<uint16_t> b = test::random_bf16(rng, static_cast<size_t>(n), 3.0f);
    std::vector<uint16_t> want(a.size());
    for (size_t i = 0; i < a.size(); ++i)
      want[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
    auto da = cuda::to_device<bf16>(a);
    auto db = cuda::to_device<bf16>(b);
    DeviceBuffer<bf16> out(a.size());
    out.fill_bytes(0xff);
    cuda::add_bf16(da.data(), db.data(), n, out.data(), nullptr);
    EXPECT_TRUE(bits_host(out) == want) << "n " << n;
    cuda::add_bf16(da.data(), db.data(), n, da.data(), nullptr);  // out aliases a
    EXPECT_TRUE(bits_host(da) == want) << "n " << n << " in place";
    // Misaligned by one element: the scalar path (da now holds the sum: a fresh copy of a).
    if (n > 8) {
      out.fill_bytes(0xff);
      auto da2 = cuda::to_device<bf16>(a);
      cuda::add_bf16(da2.data() + 1, db.data() + 1, n - 1, out.data() + 1, nullptr);
      const std::vector<uint16_t> g = bits_host(out);
      int64_t bad = 0;
      for (int64_t i = 1; i < n; ++i)
        bad += g[static_cast<size_t>(i)] != want[static_cast<size_t>(i)];
      EXPECT_EQ(bad, 0) << "n " << n << " offset 1";
    }
  }
}

// The fused pair sum = a + b, res += sum equals the two add_bf16 launches bit for bit.
TEST(CudaStepOps, AddBf16ResidualEqualsTwoAdds) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int64_t n : {int64_t{7168} * 3, int64_t{1001}}) {
    const std::vector<uint16_t> a = test::random_bf16(rng, static_cast<size_t>(n));
    const std::vector<uint16_t> b = test::random_bf16(rng, static_cast<size_t>(n), 3.0f);
    const std::vector<uint16_t> p = test::random_bf16(rng, static_cast<size_t>(n), 2.0f);
    auto da = cuda::to_device<bf16>(a);
    auto db = cuda::to_device<bf16>(b);
    auto p_two = cuda::to_device<bf16>(p);
    auto p_one = cuda::to_device<bf16>(p);
    DeviceBuffer<bf16> s_two(a.size()), s_one(a.size());
    s_one.fill_bytes(0xff);
    cuda::add_bf16(da.data(), db.data(), n, s_two.data(), nullptr);
    cuda::add_bf16(p_two.data(), s_two.data(), n, p_two.data(), nullptr);
    cuda::add_bf16_residual(da.data(), db.data(), n, s_one.data(), p_one.data(), nullptr);
    EXPECT_TRUE(bits_host(s_one) == bits_host(s_two)) << "sum, n " << n;
    EXPECT_TRUE(bits_host(p_one) == bits_host(p_two)) << "residual, n " << n;
    EXPECT_FALSE(bits_host(p_one) == p) << "the residual must change";
  }
}

// ============================== mla_absorb_q ==============================

void check_absorb(const MlaShape& s, int64_t rows) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int qhd = s.nope + s.rope;
  const std::vector<uint16_t> q = test::random_bf16(rng, static_cast<size_t>(rows) * s.heads * qhd);
  const std::vector<uint16_t> kv_b =
      test::random_bf16(rng, static_cast<size_t>(s.heads) * (s.nope + s.v) * s.kv_lora, 0.1f);
  std::vector<double> ref(static_cast<size_t>(rows) * s.heads * s.kv_lora, 0.0);
  std::vector<uint16_t> pe_want(static_cast<size_t>(rows) * s.heads * s.rope);
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < s.heads; ++h) {
      const size_t qh = static_cast<size_t>(r) * s.heads + h;
      for (int c = 0; c < s.kv_lora; ++c) {
        double acc = 0;
        for (int i = 0; i < s.nope; ++i)
          acc += f(q[qh * qhd + i]) *
                 f(kv_b[(static_cast<size_t>(h) * (s.nope + s.v) + i) * s.kv_lora + c]);
        ref[qh * s.kv_lora + c] = acc;
      }
      for (int i = 0; i < s.rope; ++i) pe_want[qh * s.rope + i] = q[qh * qhd + s.nope + i];
    }
  auto dq = cuda::to_device<bf16>(q);
  auto dkv = cuda::to_device<bf16>(kv_b);
  DeviceBuffer<bf16> q_abs(ref.size()), q_pe(pe_want.size());
  q_abs.fill_bytes(0xff);
  q_pe.fill_bytes(0xff);
  cuda::mla_absorb_q(dq.data(), dkv.data(), rows, s.heads, s.nope, s.rope, s.v, s.kv_lora,
                     q_abs.data(), q_pe.data(), nullptr);
  K3_CUDA_CHECK_LAUNCH();
  const std::string what = std::string(s.name) + " rows " + std::to_string(rows);
  expect_close(bf16_host(q_abs), ref, kDotBf16, what + " q_abs");
  EXPECT_TRUE(bits_host(q_pe) == pe_want) << what << " q_pe";
}

TEST(CudaStepOps, MlaAbsorbQ) {
  for (const MlaShape& s : {kTiny2, kTiny4, kK3Tp, kK3Full})
    for (int64_t rows : {1, 13}) check_absorb(s, rows);
}

// ============================== mla_unabsorb_v ==============================

void check_unabsorb(const MlaShape& s, int64_t rows, bool gated) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const std::vector<float> ol =
      test::random_normal(rng, static_cast<size_t>(rows) * s.heads * s.kv_lora);
  const std::vector<uint16_t> kv_b =
      test::random_bf16(rng, static_cast<size_t>(s.heads) * (s.nope + s.v) * s.kv_lora, 0.1f);
  const std::vector<uint16_t> gate =
      test::random_bf16(rng, static_cast<size_t>(rows) * s.heads * s.v, 2.0f);
  std::vector<double> ref(static_cast<size_t>(rows) * s.heads * s.v);
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < s.heads; ++h)
      for (int j = 0; j < s.v; ++j) {
        const size_t wrow = static_cast<size_t>(h) * (s.nope + s.v) + s.nope + j;
        double acc = 0;
        for (int c = 0; c < s.kv_lora; ++c)
          acc += f(kv_b[wrow * s.kv_lora + c]) *
                 ol[(static_cast<size_t>(r) * s.heads + h) * s.kv_lora + c];
        const size_t e = static_cast<size_t>(r) * s.heads * s.v + static_cast<size_t>(h) * s.v + j;
        // The CPU rounds o to bf16 before the gate.
        ref[e] = gated ? round_bf16(static_cast<float>(acc)) * sigmoid64(f(gate[e])) : acc;
      }
  auto dol = cuda::to_device<float>(ol);
  auto dkv = cuda::to_device<bf16>(kv_b);
  auto dg = cuda::to_device<bf16>(gate);
  DeviceBuffer<bf16> o(ref.size());
  o.fill_bytes(0xff);
  cuda::mla_unabsorb_v(dol.data(), dkv.data(), gated ? dg.data() : nullptr, rows, s.heads, s.nope,
                       s.v, s.kv_lora, o.data(), nullptr);
  K3_CUDA_CHECK_LAUNCH();
  expect_close(bf16_host(o), ref, gated ? kGated : kDotBf16,
               std::string(s.name) + " rows " + std::to_string(rows) + (gated ? " gated" : ""));
}

TEST(CudaStepOps, MlaUnabsorbV) {
  for (const MlaShape& s : {kTiny2, kTiny4, kK3Tp, kK3Full})
    for (int64_t rows : {1, 13})
      for (bool gated : {false, true}) check_unabsorb(s, rows, gated);
}

// ============================== mla_cache_append ==============================

void check_append(int width, int page_size, int rows) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int max_pages = 5, pool = rows * max_pages + 2;
  std::vector<int32_t> perm(static_cast<size_t>(pool));
  std::iota(perm.begin(), perm.end(), 0);
  for (int i = pool - 1; i > 0; --i)
    std::swap(perm[static_cast<size_t>(i)], perm[rng.next_u64() % static_cast<uint64_t>(i + 1)]);
  std::vector<int32_t> bt(static_cast<size_t>(rows) * max_pages), pos(static_cast<size_t>(rows));
  for (size_t i = 0; i < bt.size(); ++i) bt[i] = perm[i];
  for (int r = 0; r < rows; ++r)
    pos[static_cast<size_t>(r)] = static_cast<int32_t>(rng.next_u64() % (max_pages * page_size));
  pos[0] = max_pages * page_size - 1;  // the last slot of the last page
  const std::vector<uint16_t> kv = test::random_bf16(rng, static_cast<size_t>(rows) * width);
  std::vector<uint16_t> cache =
      test::random_bf16(rng, static_cast<size_t>(pool) * page_size * width);
  auto d_kv = cuda::to_device<bf16>(kv);
  auto d_bt = cuda::to_device<int32_t>(bt);
  auto d_pos = cuda::to_device<int32_t>(pos);
  auto d_cache = cuda::to_device<bf16>(cache);
  for (int r = 0; r < rows; ++r) {
    const int p = pos[static_cast<size_t>(r)];
    const size_t page = static_cast<size_t>(bt[static_cast<size_t>(r) * max_pages + p / page_size]);
    std::copy_n(kv.begin() + static_cast<int64_t>(r) * width, width,
                cache.begin() + static_cast<int64_t>((page * page_size + p % page_size) * width));
  }
  cuda::mla_cache_append(d_kv.data(), rows, width, d_bt.data(), max_pages, d_pos.data(), page_size,
                         d_cache.data(), nullptr);
  K3_CUDA_CHECK_LAUNCH();
  EXPECT_TRUE(bits_host(d_cache) == cache) << "width " << width << " page " << page_size;
}

TEST(CudaStepOps, MlaCacheAppendWritesOnlyItsSlot) {
  check_append(32 + 8, 16, 3);  // tiny
  check_append(512 + 64, 64, 11);
  check_append(512 + 64, 1, 4);
}

// ============================== moe_combine ==============================

// ep: the choices sit at shuffled positions (the expert-grouped order) and about a third of
// them belong to other ranks' experts (position -1), which drop out of the sum.
void check_combine(int64_t rows, int top_k, int64_t width, bool norm, bool ep = false) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const std::vector<uint16_t> y = test::random_bf16(rng, static_cast<size_t>(rows * top_k * width));
  std::vector<float> w(static_cast<size_t>(rows * top_k));
  for (float& x : w) x = rng.uniform(0.05f, 2.5f);
  std::vector<float> nw(static_cast<size_t>(width));
  for (float& x : nw) x = rng.uniform(0.5f, 1.5f);
  std::vector<int32_t> pos(static_cast<size_t>(rows * top_k));
  std::iota(pos.begin(), pos.end(), 0);
  if (ep) {
    for (size_t i = pos.size() - 1; i > 0; --i)
      std::swap(pos[i], pos[rng.next_u64() % static_cast<uint64_t>(i + 1)]);
    for (int32_t& p : pos)
      if (rng.next_u64() % 3 == 0) p = -1;
  }
  const float eps = 1e-5f;
  std::vector<double> ref(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < width; ++c) {
      double a = 0;
      for (int j = 0; j < top_k; ++j) {
        const int32_t p = pos[static_cast<size_t>(r * top_k + j)];
        if (p >= 0)
          a += static_cast<double>(w[static_cast<size_t>(r * top_k + j)]) *
               f(y[static_cast<size_t>(p * width + c)]);
      }
      ref[static_cast<size_t>(r * width + c)] = a;
      ss += a * a;
    }
    if (norm) {
      const double inv = 1.0 / std::sqrt(ss / static_cast<double>(width) + eps);
      for (int64_t c = 0; c < width; ++c) ref[static_cast<size_t>(r * width + c)] *= inv * nw[c];
    }
  }
  auto dy = cuda::to_device<bf16>(y);
  auto dw = cuda::to_device<float>(w);
  auto dnw = cuda::to_device<float>(nw);
  auto dpos = cuda::to_device<int32_t>(pos);
  DeviceBuffer<bf16> out(ref.size());
  out.fill_bytes(0xff);
  cuda::moe_combine(dy.data(), dw.data(), rows, top_k, width, norm ? dnw.data() : nullptr, eps,
                    out.data(), nullptr, ep ? dpos.data() : nullptr);
  K3_CUDA_CHECK_LAUNCH();
  expect_close(bf16_host(out), ref, norm ? kCombineNorm : kCombine,
               "rows " + std::to_string(rows) + " top_k " + std::to_string(top_k) + " width " +
                   std::to_string(width) + (norm ? " norm" : "") + (ep ? " ep" : ""));
}

TEST(CudaStepOps, MoeCombine) {
  for (bool norm : {false, true}) {
    check_combine(3, 2, 128, norm);    // tiny
    check_combine(11, 8, 7168, norm);  // K3 width
    check_combine(5, 6, 1000, norm);
    check_combine(9, 16, 3584, norm, /*ep=*/true);  // grouped order, other ranks' choices out
  }
}

// ============================== grouped bf16 GEMM / fp32-weight linear
// ==============================

void check_grouped(int64_t N, int64_t K, int64_t ldx, int64_t ldy, bool y_fp32) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int n_experts = 5;
  // Slots: expert ids (one skipped), row counts including an empty slot and a slot of 9 rows.
  const std::vector<int32_t> slot_expert{3, -1, 0, 4, 2, 1};
  const std::vector<int32_t> counts{2, 3, 0, 9, 1, 5};
  std::vector<int32_t> offs{0};
  for (int32_t c : counts) offs.push_back(offs.back() + c);
  const int64_t rows = offs.back(), x_rows = 7;
  std::vector<int32_t> row_index(static_cast<size_t>(rows));
  for (auto& r : row_index) r = static_cast<int32_t>(rng.next_u64() % x_rows);
  std::vector<std::vector<uint16_t>> w(n_experts);
  std::vector<DeviceBuffer<bf16>> dw;
  std::vector<const bf16*> ptrs;
  for (auto& e : w) {
    e = test::random_bf16(rng, static_cast<size_t>(N * K), 0.1f);
    dw.push_back(cuda::to_device<bf16>(e));
    ptrs.push_back(dw.back().data());
  }
  const std::vector<uint16_t> x = test::random_bf16(rng, static_cast<size_t>(x_rows * ldx));
  for (bool with_index : {false, true}) {
    std::vector<double> ref(static_cast<size_t>(rows * N), 0.0);
    std::vector<bool> written(static_cast<size_t>(rows), false);
    for (size_t s = 0; s < slot_expert.size(); ++s) {
      if (slot_expert[s] < 0) continue;
      const auto& W = w[static_cast<size_t>(slot_expert[s])];
      for (int32_t r = offs[s]; r < offs[s + 1]; ++r) {
        written[static_cast<size_t>(r)] = true;
        const int64_t xr = with_index ? row_index[static_cast<size_t>(r)] : r % x_rows;
        for (int64_t n = 0; n < N; ++n) {
          double a = 0;
          for (int64_t k = 0; k < K; ++k)
            a += f(W[static_cast<size_t>(n * K + k)]) * f(x[static_cast<size_t>(xr * ldx + k)]);
          ref[static_cast<size_t>(r * N + n)] = a;
        }
      }
    }
    // Without row_index the kernel reads x row r: give it `rows` rows (row r = x row r % 7).
    std::vector<uint16_t> xs(static_cast<size_t>(rows * ldx));
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(x.begin() + (r % x_rows) * ldx, ldx, xs.begin() + r * ldx);
    auto dx = cuda::to_device<bf16>(with_index ? x : xs);
    auto d_ptrs = cuda::to_device<const bf16*>(ptrs);
    auto d_se = cuda::to_device<int32_t>(slot_expert);
    auto d_off = cuda::to_device<int32_t>(offs);
    auto d_ri = cuda::to_device<int32_t>(row_index);
    cuda::Bf16Grouped g;
    g.w = d_ptrs.data();
    g.slot_expert = d_se.data();
    g.slot_offsets = d_off.data();
    g.row_index = with_index ? d_ri.data() : nullptr;
    g.n_slots = static_cast<int>(slot_expert.size());
    DeviceBuffer<uint8_t> y(static_cast<size_t>(rows * ldy) * 4);
    y.fill_bytes(0xff);
    cuda::linear_bf16_grouped(g, dx.data(), ldx, N, K, y.data(), ldy, y_fp32, nullptr);
    K3_CUDA_CHECK_LAUNCH();
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint8_t> raw = cuda::to_host<uint8_t>(y);
    std::vector<float> got, want_unwritten;
    std::vector<double> ref_w;
    int64_t touched = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < N; ++n) {
        float v;
        if (y_fp32) {
          std::memcpy(&v, raw.data() + (r * ldy + n) * 4, 4);
        } else {
          uint16_t b;
          std::memcpy(&b, raw.data() + (r * ldy + n) * 2, 2);
          v = bf16_to_float(b);
        }
        if (written[static_cast<size_t>(r)]) {
          got.push_back(v);
          ref_w.push_back(ref[static_cast<size_t>(r * N + n)]);
        } else {
          touched += !std::isnan(v);
        }
      }
    const std::string what = "N " + std::to_string(N) + " K " + std::to_string(K) +
                             (y_fp32 ? " fp32" : " bf16") + (with_index ? " row_index" : "");
    expect_close(got, ref_w, y_fp32 ? kDotF32 : kDotBf16, what);
    EXPECT_EQ(touched, 0) << what << ": rows of the skipped slot were written";
  }
}

TEST(CudaStepOps, LinearBf16Grouped) {
  check_grouped(96, 128, 128, 96, false);      // tiny, vector path
  check_grouped(40, 100, 104, 43, true);       // K % 8 != 0: scalar path, padded strides
  check_grouped(512, 7168, 7168, 512, false);  // K3-sized expert
  check_grouped(512, 7168, 7168, 520, true);
}

void check_f32w(int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldy, bool y_fp32) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const std::vector<uint16_t> x = test::random_bf16(rng, static_cast<size_t>(M * ldx));
  const std::vector<float> w = test::random_normal(rng, static_cast<size_t>(N * K), 0.1f);
  std::vector<double> ref(static_cast<size_t>(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double a = 0;
      for (int64_t k = 0; k < K; ++k)
        a += static_cast<double>(w[static_cast<size_t>(n * K + k)]) *
             f(x[static_cast<size_t>(m * ldx + k)]);
      ref[static_cast<size_t>(m * N + n)] = a;
    }
  auto dx = cuda::to_device<bf16>(x);
  auto dw = cuda::to_device<float>(w);
  DeviceBuffer<uint8_t> y(static_cast<size_t>(M * ldy) * 4);
  y.fill_bytes(0xff);
  cuda::linear_f32w(dx.data(), ldx, dw.data(), M, N, K, y.data(), ldy, y_fp32, nullptr);
  K3_CUDA_CHECK_LAUNCH();
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> raw = cuda::to_host<uint8_t>(y);
  std::vector<float> got;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float v;
      if (y_fp32) {
        std::memcpy(&v, raw.data() + (m * ldy + n) * 4, 4);
      } else {
        uint16_t b;
        std::memcpy(&b, raw.data() + (m * ldy + n) * 2, 2);
        v = bf16_to_float(b);
      }
      got.push_back(v);
    }
  expect_close(got, ref, y_fp32 ? kDotF32 : kDotBf16,
               "M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K));
}

TEST(CudaStepOps, LinearF32Weight) {
  check_f32w(7, 32, 7168, 7168, 32, true);  // router-like
  check_f32w(64, 384, 7168, 7168, 384, false);
  check_f32w(3, 16, 128, 128, 17, true);  // tiny
  check_f32w(5, 9, 100, 103, 9, false);   // scalar path
}

}  // namespace
}  // namespace k3
