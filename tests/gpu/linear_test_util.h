// Helpers of the skinny-GEMM suites (test_cuda_linear_bf16.cu, test_cuda_linear_mxfp4.cu): the
// CPU oracle on sampled weight rows, random bf16 and MXFP4 weights, and a spread of plans.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/rng.h"
#include "cpu/ops_basic.h"
#include "cuda/device_buffer.h"
#include "cuda/linear_plan.h"
#include "gpu/op_test_util.h"
#include "model/weight_matrix.h"
#include "test_util.h"

namespace k3::gpu_test {

// Weight rows checked against the CPU: all of them for small N, else random 16-row blocks plus
// the last block (the ragged tile), at most max_rows.
inline std::vector<int64_t> sample_rows(Rng& rng, int64_t n, int64_t max_rows = 512) {
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
inline std::vector<float> ref_linear(const WeightMatrix& w, const std::vector<float>& x,
                                     int64_t ldx, int64_t m_count, const std::vector<int64_t>& rows,
                                     bool round) {
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

inline std::vector<float> gather(const std::vector<float>& y, int64_t ldy, int64_t m_count,
                                 const std::vector<int64_t>& rows) {
  std::vector<float> g;
  for (int64_t m = 0; m < m_count; ++m)
    for (int64_t r : rows) g.push_back(y[m * ldy + r]);
  return g;
}

inline std::string shape_str(const char* what, int64_t M, int64_t N, int64_t K, bool f32,
                             const cuda::LinearPlan* p) {
  return std::string(what) + " M" + std::to_string(M) + " N" + std::to_string(N) + " K" +
         std::to_string(K) + (f32 ? " fp32-out" : " bf16-out") + (p ? " plan " + p->str() : "");
}

struct Bf16Weight {
  Bf16Data d;
  WeightMatrix wm;
};
inline Bf16Weight make_bf16_weight(Rng& rng, int64_t N, int64_t K) {
  Bf16Weight w;
  w.d = make_bf16(rng, static_cast<size_t>(N * K), 1.0f / std::sqrt(static_cast<float>(K)));
  w.wm.name = "w";
  w.wm.format = WeightFormat::BF16;
  w.wm.rows = N;
  w.wm.cols = K;
  w.wm.data = w.d.bits.data();
  return w;
}

// A GEMM's output y [M, N] (bf16 or fp32 as f32 says) against the oracle on sampled rows: every
// element written, then within the GEMM tolerance.
inline void expect_linear_output(Rng& rng, const std::vector<float>& got, const WeightMatrix& w,
                                 const std::vector<float>& x, int64_t M, int64_t N, int64_t K,
                                 bool f32, const std::string& what) {
  expect_all_finite(got, what);
  const auto rows = sample_rows(rng, N);
  expect_close(gather(got, N, M, rows), ref_linear(w, x, K, M, rows, !f32),
               f32 ? kGemmF32Out : kGemmBf16Out, what);
}

// A spread of tilings (cluster sizes, warps along K, ring depths, row tiles) and the generic
// kernel, all against the oracle.
inline std::vector<cuda::LinearPlan> diverse_plans(const std::vector<cuda::LinearPlan>& c) {
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

struct Fp4Weight {
  std::vector<uint8_t> packed, scales;
  cuda::DeviceBuffer<uint8_t> dp, ds;
  WeightMatrix wm;
};
// raw: every nibble and a range of scales, including s > 128 (two-multiply path) and s = 0;
// otherwise quantized N(0, 1/K) rows as the synthetic checkpoints.
inline Fp4Weight make_fp4_weight(Rng& rng, int64_t N, int64_t K, bool raw) {
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

}  // namespace k3::gpu_test
