// Speculative verify at batch 1 and a prompt's prefill (step_verify.h).
#include "step_verify.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "core/error.h"
#include "step_timing.h"

namespace k3::bench {

namespace {

// Prefill of one `tokens`-long prompt on the stock path (as CudaStepBackend feeds it: runs of
// up to 64 rows of the slot per step), after one untimed pass (graph capture); ms for the whole
// prompt.
double time_prefill(cuda::CudaBackbone& bb, const ModelConfig& cfg, int64_t tokens) {
  const int chunk = std::min(64, bb.max_rows());
  cudaEvent_t e0, e1;
  K3_CUDA_CHECK(cudaEventCreate(&e0));
  K3_CUDA_CHECK(cudaEventCreate(&e1));
  float ms = 0;
  for (int pass = 0; pass < 2; ++pass) {
    bb.reset_slot(0);
    K3_CUDA_CHECK(cudaEventRecord(e0, bb.stream()));
    for (int64_t t = 0; t < tokens; t += chunk) {
      const int n = static_cast<int>(std::min<int64_t>(chunk, tokens - t));
      const std::vector<int32_t> slots(static_cast<size_t>(n), 0);
      std::vector<int32_t> toks(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r)
        toks[static_cast<size_t>(r)] = static_cast<int32_t>(((t + r) * 7919 + 17) % cfg.vocab_size);
      bb.step(slots, toks, cuda::StepPath::Stock);
    }
    K3_CUDA_CHECK(cudaEventRecord(e1, bb.stream()));
    K3_CUDA_CHECK(cudaEventSynchronize(e1));
    K3_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  }
  K3_CUDA_CHECK(cudaEventDestroy(e0));
  K3_CUDA_CHECK(cudaEventDestroy(e1));
  return ms;
}

}  // namespace

VerifyResult time_verify(const StepArgs& a, cuda::CudaBackbone& bb, const ModelConfig& cfg,
                         const bench::Floor& fl, int64_t margin,
                         cuda::DeviceBuffer<uint8_t>& flush) {
  VerifyResult res;
  std::vector<VerifyRow>& out = res.rows;
  if (a.verify_q.empty()) return res;
  const int64_t ctx = a.contexts.front();
  cuda::SlotPoolShape shape;
  shape.slots = 1;
  shape.max_context = ctx + margin;
  shape.page_size = bb.pool().page_size();
  shape.recurrent = bb.pool().recurrent_dtype();
  shape.latent = bb.pool().latent_format();
  bb.rebind_cache(shape);
  const int max_q = *std::max_element(a.verify_q.begin(), a.verify_q.end());
  bb.reserve_snapshots(max_q - 1);
  std::vector<int> qs = {1};
  qs.insert(qs.end(), a.verify_q.begin(), a.verify_q.end());
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  for (const int q : qs) {
    VerifyRow row;
    row.q = q;
    // Rows of one request: its cache is read once, its experts are those q rows pick.
    row.floor_ms =
        (bench::floor_bytes(fl, cfg, q, ctx) -
         (q - 1) * (bench::floor_bytes(fl, cfg, 1, ctx) - bench::floor_bytes(fl, cfg, 1, 0))) /
        (kPeakTBps * 1e12) * 1e3;
    const std::vector<int32_t> slots(static_cast<size_t>(q), 0);
    std::vector<int32_t> toks(static_cast<size_t>(q));
    for (int r = 0; r < q; ++r)
      toks[static_cast<size_t>(r)] = static_cast<int32_t>((r * 7919 + 17) % cfg.vocab_size);
    for (const auto& name : a.paths) {
      const cuda::StepPath path =
          name == "specialized" ? cuda::StepPath::Specialized : cuda::StepPath::Stock;
      bb.assume_context(0, ctx);
      const double med = time_step(bb, slots, toks, path, a.replays, flush, /*keep_kda=*/true);
      if (!finite_logits(bb, q, V)) fail("verify q = ", q, ": non-finite logits");
      (path == cuda::StepPath::Stock ? row.stock : row.spec) = med;
      if (a.profile && path == cuda::StepPath::Specialized) {
        bb.assume_context(0, ctx);
        for (const auto& st : bb.profile_step(slots, toks, path, 5)) {
          char buf[64];
          std::snprintf(buf, sizeof buf, " %s %.3f", st.stage.c_str(), st.ms);
          row.spec_stages += buf;
        }
      }
    }
    out.push_back(row);
  }
  // The same slot then prefills a prompt of the context's length in 64-row runs.
  res.prefill_tokens = ctx;
  res.prefill_ms = time_prefill(bb, cfg, ctx);
  return res;
}

void print_verify(const VerifyResult& v) {
  const std::vector<VerifyRow>& rows = v.rows;
  if (rows.empty()) return;
  std::printf("\n======== speculative verify, batch 1, q rows of one request ========\n");
  std::printf("%4s %10s %10s %10s %12s %12s\n", "q", "stock ms", "spec ms", "floor ms", "stock/q=1",
              "spec/q=1");
  for (const VerifyRow& r : rows)
    std::printf("%4d %10.3f %10.3f %10.3f %11.2fx %11.2fx\n", r.q, r.stock, r.spec, r.floor_ms,
                rows[0].stock > 0 ? r.stock / rows[0].stock : 0.0,
                rows[0].spec > 0 ? r.spec / rows[0].spec : 0.0);
  for (const VerifyRow& r : rows)
    if (!r.spec_stages.empty())
      std::printf("  verify q %d specialized per stage (ms):%s\n", r.q, r.spec_stages.c_str());
  std::printf(
      "prefill %lld tokens (stock path, runs of up to 64 rows): %.1f ms, %.0f tokens/s; "
      "token by token: %lld q = 1 steps, %.0f ms\n",
      static_cast<long long>(v.prefill_tokens), v.prefill_ms,
      v.prefill_tokens / (v.prefill_ms * 1e-3), static_cast<long long>(v.prefill_tokens),
      v.prefill_tokens * rows[0].stock);
}

}  // namespace k3::bench
