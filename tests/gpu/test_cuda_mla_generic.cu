// The generic-shape path of cuda::mla_decode (kv_lora != 512 or rope != 64, e.g. the tiny test
// model's 32 / 8) against a float64 oracle on fresh random inputs over a shuffled paged cache
// whose unused slots hold NaN: dense and DSA-selected, fp32 and bf16 out, empty rows give 0.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "core/rng.h"
#include "cuda/device_buffer.h"
#include "cuda/mla_decode.h"
#include "gpu/gpu_check_util.h"
#include "test_util.h"

namespace k3 {
namespace {

using cuda::bf16;
using cuda::DeviceBuffer;
using gpu_test::expect_close;
using gpu_test::Tol;

// ---- Tolerances (as test_cuda_mla.cu): fp32 math over <= 1100 tokens x <= 1152 terms stays
// near 1e-6 of the RMS of the float64 result; bf16 out adds one rounding. ----
constexpr Tol kF32Out{0.0, 1e-5};
constexpr Tol kBf16Out{1.0, 1e-6};

struct Case {
  int kv_lora = 0, rope = 0, page = 0, heads = 0, rows = 0, max_pages = 0, max_sel = 0;
  std::vector<int> seq;
  std::vector<std::vector<int>> sel;  // [rows] positions, empty when dense
  std::vector<uint16_t> q_abs, q_pe, cache;
  std::vector<int32_t> bt;
};

Case make_case(Rng& rng, int kv_lora, int rope, int page, int heads, const std::vector<int>& seq,
               bool sparse) {
  Case c;
  c.kv_lora = kv_lora, c.rope = rope, c.page = page, c.heads = heads, c.seq = seq;
  c.rows = static_cast<int>(seq.size());
  const int D = kv_lora + rope;
  int total = 0;
  for (int s : seq) {
    c.max_pages = std::max(c.max_pages, (s + page - 1) / page);
    total += (s + page - 1) / page;
  }
  c.max_pages = std::max(c.max_pages, 1);
  const int pool = total + 2;
  std::vector<int> perm(static_cast<size_t>(pool));
  std::iota(perm.begin(), perm.end(), 0);
  for (int i = pool - 1; i > 0; --i)
    std::swap(perm[static_cast<size_t>(i)], perm[rng.next_u64() % static_cast<uint64_t>(i + 1)]);
  c.cache.assign(static_cast<size_t>(pool) * page * D, 0xffff);  // NaN where nobody wrote
  c.bt.assign(static_cast<size_t>(c.rows) * c.max_pages, -1);
  int next = 0;
  for (int r = 0; r < c.rows; ++r) {
    for (int p = 0; p * page < seq[r]; ++p)
      c.bt[static_cast<size_t>(r) * c.max_pages + p] = perm[static_cast<size_t>(next++)];
    for (int t = 0; t < seq[r]; ++t) {
      const int64_t pg = c.bt[static_cast<size_t>(r) * c.max_pages + t / page];
      const size_t off = (static_cast<size_t>(pg) * page + t % page) * D;
      for (int d = 0; d < D; ++d) c.cache[off + d] = float_to_bf16(rng.normal());
    }
  }
  c.sel.resize(static_cast<size_t>(c.rows));
  if (sparse) {
    for (int r = 0; r < c.rows; ++r) {  // about a third of the tokens, in random order
      std::vector<int> all(static_cast<size_t>(seq[r]));
      std::iota(all.begin(), all.end(), 0);
      for (int i = seq[r] - 1; i > 0; --i)
        std::swap(all[static_cast<size_t>(i)], all[rng.next_u64() % static_cast<uint64_t>(i + 1)]);
      all.resize(static_cast<size_t>(seq[r] == 0 ? 0 : seq[r] / 3 + 1));
      c.sel[static_cast<size_t>(r)] = all;
      c.max_sel = std::max(c.max_sel, static_cast<int>(all.size()));
    }
    c.max_sel = std::max(c.max_sel, 1);
  }
  c.q_abs = test::random_bf16(rng, static_cast<size_t>(c.rows) * heads * kv_lora);
  c.q_pe = test::random_bf16(rng, static_cast<size_t>(c.rows) * heads * std::max(rope, 1));
  return c;
}

std::vector<double> reference(const Case& c, bool sparse, double scale) {
  const int L = c.kv_lora, R = c.rope, D = L + R;
  std::vector<double> o(static_cast<size_t>(c.rows) * c.heads * L, 0.0);
  for (int r = 0; r < c.rows; ++r) {
    std::vector<int> toks = c.sel[static_cast<size_t>(r)];
    if (!sparse) {
      toks.resize(static_cast<size_t>(c.seq[r]));
      std::iota(toks.begin(), toks.end(), 0);
    }
    if (toks.empty()) continue;  // o = 0
    auto row_of = [&](int t) {
      const int64_t pg = c.bt[static_cast<size_t>(r) * c.max_pages + t / c.page];
      return &c.cache[(static_cast<size_t>(pg) * c.page + t % c.page) * D];
    };
    for (int h = 0; h < c.heads; ++h) {
      const size_t qh = static_cast<size_t>(r) * c.heads + h;
      std::vector<double> s(toks.size());
      double mx = -INFINITY;
      for (size_t i = 0; i < toks.size(); ++i) {
        const uint16_t* row = row_of(toks[i]);
        double d = 0;
        for (int k = 0; k < L; ++k)
          d += static_cast<double>(bf16_to_float(c.q_abs[qh * L + k])) * bf16_to_float(row[k]);
        for (int k = 0; k < R; ++k)
          d += static_cast<double>(bf16_to_float(c.q_pe[qh * R + k])) * bf16_to_float(row[L + k]);
        s[i] = d * scale;
        mx = std::max(mx, s[i]);
      }
      double sum = 0;
      for (double& v : s) sum += (v = std::exp(v - mx));
      for (size_t i = 0; i < toks.size(); ++i) {
        const uint16_t* row = row_of(toks[i]);
        for (int k = 0; k < L; ++k) o[qh * L + k] += s[i] / sum * bf16_to_float(row[k]);
      }
    }
  }
  return o;
}

void check_generic(int kv_lora, int rope, int page, int heads, const std::vector<int>& seq,
                   bool sparse) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const Case c = make_case(rng, kv_lora, rope, page, heads, seq, sparse);
  const double scale = 1.0 / std::sqrt(16.0 + rope);
  const std::vector<double> ref = reference(c, sparse, scale);

  auto q_abs = cuda::to_device<bf16>(c.q_abs);
  auto q_pe = cuda::to_device<bf16>(c.q_pe);
  auto cache = cuda::to_device<bf16>(c.cache);
  auto bt = cuda::to_device<int32_t>(c.bt);
  auto d_seq = cuda::to_device<int32_t>(std::vector<int32_t>(seq.begin(), seq.end()));
  std::vector<int32_t> sel(static_cast<size_t>(c.rows) * std::max(c.max_sel, 1), -1), nsel;
  for (int r = 0; r < c.rows; ++r) {
    const auto& v = c.sel[static_cast<size_t>(r)];
    std::copy(v.begin(), v.end(), sel.begin() + static_cast<int64_t>(r) * std::max(c.max_sel, 1));
    nsel.push_back(static_cast<int32_t>(v.size()));
  }
  auto d_sel = cuda::to_device<int32_t>(sel);
  auto d_nsel = cuda::to_device<int32_t>(nsel);
  const int64_t max_tokens =
      sparse ? c.max_sel : std::max<int64_t>(1, *std::max_element(seq.begin(), seq.end()));
  const cuda::MlaDecodePlan p0{.rows = c.rows,
                               .heads = heads,
                               .kv_lora = kv_lora,
                               .rope = rope,
                               .page_size = page,
                               .max_pages = c.max_pages,
                               .max_sel = sparse ? c.max_sel : 0,
                               .max_tokens = max_tokens};
  const cuda::MlaDecodePlan plan = cuda::plan_mla_decode(p0, 132);
  EXPECT_EQ(plan.splits, 1);
  EXPECT_EQ(plan.heads_per_group, 1);
  DeviceBuffer<uint8_t> ws(std::max<size_t>(16, cuda::mla_decode_workspace_bytes(plan)));
  DeviceBuffer<uint8_t> out(static_cast<size_t>(c.rows) * heads * kv_lora * 4);
  const std::string what = "kv_lora " + std::to_string(kv_lora) + " rope " + std::to_string(rope) +
                           " heads " + std::to_string(heads) + (sparse ? " sparse" : " dense");
  for (bool bf16_out : {false, true}) {
    out.fill_bytes(0xff);
    cuda::mla_decode(plan, q_abs.data(), rope > 0 ? q_pe.data() : nullptr, cache.data(), bt.data(),
                     d_seq.data(), sparse ? d_sel.data() : nullptr,
                     sparse ? d_nsel.data() : nullptr, static_cast<float>(scale), ws.data(),
                     out.data(), bf16_out, nullptr);
    K3_CUDA_CHECK_LAUNCH();
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    const size_t n = ref.size();
    std::vector<float> got(n);
    if (bf16_out) {
      std::vector<uint16_t> h(n);
      K3_CUDA_CHECK(cudaMemcpy(h.data(), out.data(), 2 * n, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < n; ++i) got[i] = bf16_to_float(h[i]);
    } else {
      K3_CUDA_CHECK(cudaMemcpy(got.data(), out.data(), 4 * n, cudaMemcpyDeviceToHost));
    }
    expect_close(got, ref, bf16_out ? kBf16Out : kF32Out,
                 what + (bf16_out ? ", bf16 out" : ", fp32 out"));
    // Rows without tokens are exactly 0.
    for (int r = 0; r < c.rows; ++r) {
      const bool empty = sparse ? c.sel[static_cast<size_t>(r)].empty() : seq[r] == 0;
      if (!empty) continue;
      for (size_t i = 0; i < static_cast<size_t>(heads) * kv_lora; ++i)
        ASSERT_EQ(got[static_cast<size_t>(r) * heads * kv_lora + i], 0.0f) << what << " row " << r;
    }
  }
}

const std::vector<int> kSeqs{1, 0, 7, 33, 300, 1100};

TEST(CudaMlaGeneric, TinyModelShape) {
  for (int heads : {2, 4})
    for (bool sparse : {false, true}) check_generic(32, 8, 16, heads, kSeqs, sparse);
}

TEST(CudaMlaGeneric, OtherShapes) {
  check_generic(32, 0, 16, 3, kSeqs, false);  // no rope
  check_generic(8, 1, 7, 2, kSeqs, true);     // smallest latent, odd page size
  check_generic(256, 64, 64, 6, kSeqs, false);
  check_generic(512, 0, 64, 6, kSeqs, true);      // K3 latent without k_pe: generic too
  check_generic(1024, 128, 64, 5, kSeqs, false);  // the largest supported
}

TEST(CudaMlaGeneric, PlanAcceptsTheGenericRange) {
  for (auto [kv_lora, rope] : {std::pair{8, 0}, std::pair{32, 8}, std::pair{1024, 128}}) {
    const cuda::MlaDecodePlan p{
        .rows = 2, .heads = 4, .kv_lora = kv_lora, .rope = rope, .page_size = 16, .max_pages = 1};
    EXPECT_NO_THROW(cuda::plan_mla_decode(p, 132)) << kv_lora << " / " << rope;
  }
  for (auto [kv_lora, rope] : {std::pair{0, 8}, std::pair{36, 8}, std::pair{1032, 8},
                               std::pair{32, -1}, std::pair{32, 129}}) {
    const cuda::MlaDecodePlan p{
        .rows = 2, .heads = 4, .kv_lora = kv_lora, .rope = rope, .page_size = 16, .max_pages = 1};
    EXPECT_THROW(cuda::plan_mla_decode(p, 132), k3::Error) << kv_lora << " / " << rope;
  }
}

}  // namespace
}  // namespace k3
