#include "bench_dsa.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "cpu/ops_dsa.h"
#include "cuda/check.h"
#include "cuda/device_buffer.h"
#include "cuda/dsa_indexer.h"

namespace k3::bench {
namespace {

using cuda::bf16;
using cuda::DeviceBuffer;

constexpr int kNh = 32, kHd = 128, kPage = 64, kTopk = 2048;
constexpr int kCheckTokens = 4096;

std::string ctx_name(int ctx) {
  return "ctx" + std::to_string(ctx / 1024) + "k";
}

}  // namespace

void bench_dsa_scores(Timer& t, int rows, int ctx, bool mma, Rng& rng) {
  const int ppr = (ctx + kPage - 1) / kPage;  // pages per row
  const double key_bytes = static_cast<double>(rows) * ctx * (kHd + 4);
  const double bytes = key_bytes + rows * (kNh * kHd + kNh) * 2.0 + rows * ctx * 4.0;
  const int R = copies_for(key_bytes);
  // One row's keys as the cache holds them (normal, rotated, fp8 per 128), replicated into every
  // (copy, row) run of pages on the device.
  const size_t row_slots = static_cast<size_t>(ppr) * kPage;
  std::vector<uint8_t> kc(row_slots * kHd);
  std::vector<float> ks(row_slots), x(kHd);
  for (size_t s = 0; s < row_slots; ++s) {
    for (float& v : x) v = rng.normal();
    cpu::hadamard_transform(x.data(), kHd);
    cpu::quantize_fp8_blocks(x.data(), kHd, kHd, &kc[s * kHd], &ks[s]);
  }
  const size_t runs = static_cast<size_t>(R) * rows;
  const auto d_kc = replicated<uint8_t>(kc, runs);
  const auto d_ks = replicated<float>(ks, runs);
  const auto d_bt = run_page_tables(runs, ppr);  // [copy][row][ppr]
  const auto d_seq = cuda::to_device<int32_t>(std::vector<int32_t>(rows, ctx));
  const auto q = random_bf16(rng, static_cast<size_t>(rows) * kNh * kHd, 1.0f);
  const auto w = random_bf16(rng, static_cast<size_t>(rows) * kNh, 1.0f);
  const auto d_q = cuda::to_device<bf16>(q);
  const auto d_w = cuda::to_device<bf16>(w);
  DeviceBuffer<float> scores(static_cast<size_t>(rows) * ctx);
  const float head_scale = 1.0f / std::sqrt(static_cast<float>(kNh * kHd));
  auto op = [&](int c, cudaStream_t s) {
    cuda::dsa_index_scores(d_q.data(), d_w.data(), head_scale, rows, kNh, kHd, d_kc.data(),
                           d_ks.data(), d_bt.data() + static_cast<size_t>(c) * rows * ppr, ppr,
                           d_seq.data(), kPage, scores.data(), ctx, mma, s);
  };
  Result r{"dsa", "scores " + ctx_name(ctx) + (mma ? " mma" : " fp32"), "", rows, bytes};
  r.us = t.batched_us(op, R);

  scores.fill_bytes(0xff);
  op(0, t.stream());
  K3_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
  const int T = std::min(ctx, kCheckTokens);
  std::vector<float> got(static_cast<size_t>(T));
  K3_CUDA_CHECK(cudaMemcpy(got.data(), scores.data(), 4 * got.size(), cudaMemcpyDeviceToHost));
  std::vector<float> qf = floats(std::vector<uint16_t>(q.begin(), q.begin() + kNh * kHd));
  cpu::dsa_prepare_queries(qf.data(), kNh, kHd, kHd);
  std::vector<float> wf = floats(std::vector<uint16_t>(w.begin(), w.begin() + kNh));
  for (float& v : wf) v *= head_scale;
  std::vector<float> keys(static_cast<size_t>(T) * kHd), ref(static_cast<size_t>(T));
  cpu::dequantize_fp8_blocks(kc.data(), ks.data(), static_cast<int64_t>(T) * kHd, kHd, keys.data());
  cpu::dsa_index_scores(qf.data(), wf.data(), keys.data(), T, kNh, kHd, ref.data());
  double worst = 0;
  for (int s = 0; s < T; ++s) {
    double mag = 0;
    for (int h = 0; h < kNh; ++h) {
      double m = 0;
      for (int j = 0; j < kHd; ++j)
        m += std::fabs(static_cast<double>(qf[static_cast<size_t>(h) * kHd + j]) *
                       keys[static_cast<size_t>(s) * kHd + j]);
      mag += std::fabs(static_cast<double>(wf[h])) * m;
    }
    const double d = std::fabs(static_cast<double>(got[s]) - ref[s]);
    worst = std::isfinite(d) ? std::max(worst, d / (mag + 1e-30)) : INFINITY;
  }
  r.check = fmt("scores %.1e of mag", worst);
  record(r);
}

void bench_dsa_topk(Timer& t, int rows, int ctx, bool split, Rng& rng) {
  const double bytes = static_cast<double>(rows) * ctx * 4 + rows * kTopk * 4.0;
  const int R = copies_for(static_cast<double>(rows) * ctx * 4);
  std::vector<float> sc(static_cast<size_t>(ctx));
  for (float& v : sc) v = rng.normal();
  const auto d_sc = replicated<float>(sc, static_cast<size_t>(R) * rows);
  const auto d_seq = cuda::to_device<int32_t>(std::vector<int32_t>(rows, ctx));
  DeviceBuffer<int32_t> sel(static_cast<size_t>(rows) * kTopk), nsel(rows);
  DeviceBuffer<uint8_t> ws(cuda::dsa_topk_workspace_bytes(rows, ctx, kTopk));
  ws.fill_bytes(0);
  auto op = [&](int c, cudaStream_t s) {
    cuda::dsa_topk(d_sc.data() + static_cast<size_t>(c) * rows * ctx, ctx, d_seq.data(), rows,
                   kTopk, sel.data(), nsel.data(), ws.data(), split, s);
  };
  Result r{"dsa", "top2048 " + ctx_name(ctx) + (split ? " split" : " 1cta"), "", rows, bytes};
  r.us = t.batched_us(op, R);
  sel.fill_bytes(0xff);
  op(0, t.stream());
  K3_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
  std::vector<int32_t> got(kTopk);
  K3_CUDA_CHECK(cudaMemcpy(got.data(), sel.data(), 4 * got.size(), cudaMemcpyDeviceToHost));
  std::vector<int64_t> want(kTopk);
  cpu::dsa_topk(sc.data(), ctx, kTopk, want.data());
  int same = 0;
  for (int i = 0; i < kTopk; ++i) same += got[i] == want[i];
  r.check = fmt("ids %.0f/%.0f", same, kTopk);
  record(r);
}

}  // namespace k3::bench
