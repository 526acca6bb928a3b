// k3_bench_step: the whole CUDA decode step (cuda::CudaBackbone), stock and specialized paths in
// the same run, on a synthetic K3 checkpoint with real per-rank layer shapes, against the byte
// floor, with a per-stage breakdown of both.
//
// Model: one TP --tp / EP --ep rank of the k3 (or k3.1 with --dsa) preset, --layers deep (K3
// schedule: every 4th layer and the last are MLA; 93 is the full model), laid out as
// bench/bench_rank.h says: attention, dense FFN, shared experts and lm_head sharded by tp; the
// router ranks all 896 experts; the rank holds experts [0, 896 / ep) and the pairs routed to
// other ranks' experts drop out of its sum; latent projections whole. Collectives are not run
// (CudaBackboneOptions::stub_collectives). A full-depth rank (~107 GB) does not fit this host's
// disk as a checkpoint: a --template-layers deep checkpoint (same schedule, the rank's experts
// only) is synthesized, and layer l of the rank uses the weights of a template layer of the
// same kind (KDA / MLA, dense / MoE), each uploaded to its own device memory, so every layer
// streams its own weights as a real rank does.
// Context: every row's cache is made --context long (deterministic synthetic latents).
// Verify: --verify-q (default 2,4,8) times one request's q tokens as one step at batch 1.
// Flips: with tuning, the specialized path's SpecializedTuning choices are timed one by one
// (--no-flips skips them: a second run under another environment switch; --flips-matching TEXT
// times only those whose description contains TEXT; --flip-repeats N times each flip N times,
// each between two timings of the defaults, and judges the median of those ratios).
// Trace: --trace prints each path's kernel timeline of one more replay (CUPTI; kernel_trace.h).
// Timing: CUDA-graph replays of the step for each batch, L2 flushed (256 MB write) before each,
// events around the step, median of --replays.
// Floor: bytes the step must read (every weight of the layers' attention, router, latent and
// shared projections, lm_head; the local experts a batch touches, expected distinct
// (E / ep) (1 - (1 - k/E)^rows) under uniform routing; each row's latent cache min(ctx, topk) x
// W x 2 B per MLA layer; KDA state read + write) / 4.3 TB/s.
// Correctness beside the number: the same step is checked against the CPU reference on the
// tiny models by k3_gpu_tests (CudaBackbone.*, CudaExpertParallel.* for the rank slice); here
// every logit must be finite and the two paths' logits are compared.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench_rank.h"
#include "step_args.h"
#include "step_flips.h"
#include "step_timing.h"
#include "step_verify.h"
#ifdef K3_HAVE_CUPTI
#include "kernel_trace.h"
#endif
#include "core/error.h"
#include "cuda/backbone.h"
#include "cuda/check.h"
#include "cuda/device_buffer.h"
#include "model/loaded_model.h"
#include "read_curve.h"
#include "synth/presets.h"
#include "synth/synthesize.h"

namespace k3 {
namespace {

#ifdef K3_HAVE_CUPTI
using Tracer = bench::KernelTrace;
#else
struct Tracer {};
#endif

// One more replay of the captured step, from a cold L2, with its kernels' timeline printed
// (--trace): the summary by kernel, then layers 1..3 (from the second AttnRes mix + norm, the
// first layer's attention input, to the eighth).
void trace_step(Tracer& tracer, cuda::CudaBackbone& bb, const std::vector<int32_t>& slots,
                const std::vector<int32_t>& toks, cuda::StepPath path, const std::string& title,
                cuda::DeviceBuffer<uint8_t>& flush) {
#ifdef K3_HAVE_CUPTI
  flush.fill_bytes(0x5a, bb.stream());
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  tracer.clear();
  bb.step(slots, toks, path);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  bench::print_trace(tracer.take(), title, "attn_res_norm_kernel", 1, 7);
#else
  (void)tracer, (void)bb, (void)slots, (void)toks, (void)path, (void)title, (void)flush;
#endif
}

// The 93-layer rank holds ~108 GB: an H100 (80 GB) cannot take it. Say so before the upload
// fails deep inside, with the layer count that would fit.
void refuse_if_too_big(const bench::Floor& fl, const ModelWeights& w, int layers) {
  const double need = fl.fixed + fl.expert * fl.local_experts * fl.moe_layers +
                      static_cast<double>(w.embed.storage_bytes());
  size_t free_b = 0, total_b = 0;
  K3_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const double room = static_cast<double>(free_b) - 4e9;  // caches, workspaces, the L2 flush
  if (need <= room) return;
  const int fit = static_cast<int>(layers * room / need);
  fail("the rank's weights need ", need / 1e9, " GB and the GPU has ", free_b / 1e9,
       " GB free: pass --layers ", std::max(fit, 1), " or fewer");
}

int run(const bench::StepArgs& a) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no GPU: skipped\n");
    return 77;
  }
  const bench::RankShape shape_of_rank{a.layers, a.tp, a.ep, a.dsa};
  const ModelConfig cfg = bench::rank_config(shape_of_rank);
  const int tl = std::min(a.layers, a.template_layers);
  const ModelConfig tcfg = bench::template_config(shape_of_rank, tl);
  const std::string dir =
      a.dir.empty() ? (std::filesystem::temp_directory_path() /
                       ("k3_bench_step_l" + std::to_string(tl) + "_tp" + std::to_string(a.tp) +
                        "_ep" + std::to_string(a.ep) + (a.dsa ? "_dsa" : "")))
                          .string()
                    : a.dir;
  // Kernel tracing is on before any graph is built (graph kernels are traced only then).
  std::unique_ptr<Tracer> tracer;
  if (a.trace) {
#ifdef K3_HAVE_CUPTI
    tracer = std::make_unique<Tracer>();
#else
    fail("--trace: this k3_bench_step was built without CUPTI");
#endif
  }
  // This GPU's read ceiling, before the rank fills its memory: the floor at the H200's 4.3 TB/s
  // is the issue's mark, the floor at this card's measured rate the fair one on another card.
  cudaStream_t curve_stream = nullptr;
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&curve_stream, cudaStreamNonBlocking));
  const bench::ReadCurve card = bench::ReadCurve::measure(curve_stream);
  K3_CUDA_CHECK(cudaStreamDestroy(curve_stream));
  card.print();
  const auto t0 = std::chrono::steady_clock::now();
  if (!std::filesystem::exists(std::filesystem::path(dir) / "config.json")) {
    SynthOptions so;
    so.seed = 3;
    synthesize_checkpoint(tcfg, dir, so);
  }
  const auto model = LoadedModel::load(dir);
  std::deque<std::vector<uint8_t>> rank_storage;
  const ModelWeights weights =
      bench::rank_weights(model->weights, cfg, shape_of_rank, rank_storage);
  const auto t1 = std::chrono::steady_clock::now();
  const int max_q =
      a.verify_q.empty() ? 1 : *std::max_element(a.verify_q.begin(), a.verify_q.end());
  const int max_batch = *std::max_element(a.batches.begin(), a.batches.end());
  const int max_rows = std::max(max_batch, max_q);
  const int64_t max_ctx = *std::max_element(a.contexts.begin(), a.contexts.end());
  const bool want_spec = std::find(a.paths.begin(), a.paths.end(), "specialized") != a.paths.end();
  const bool want_stock = std::find(a.paths.begin(), a.paths.end(), "stock") != a.paths.end();
  // Positions advance by the rows of a slot every replay (time_step: replays + 2 steps).
  const int64_t margin = std::max(4, max_q) * (a.replays + 8) + 64;
  cuda::CudaBackboneOptions o;
  o.stub_collectives = true;
  o.max_rows = max_rows;
  o.pool.slots = max_batch;
  o.pool.max_context = std::min<int64_t>(a.contexts.front(), max_ctx) + margin;
  if (want_spec) {
    o.capture_sizes = a.batches;
    o.capture_sizes.insert(o.capture_sizes.end(), a.verify_q.begin(), a.verify_q.end());
    std::sort(o.capture_sizes.begin(), o.capture_sizes.end());
    o.capture_sizes.erase(std::unique(o.capture_sizes.begin(), o.capture_sizes.end()),
                          o.capture_sizes.end());
  }
  const bench::Floor fl = bench::floor_of(cfg, weights);
  refuse_if_too_big(fl, weights, a.layers);
  cuda::CudaBackbone bb(cfg, weights, o);
  const auto t2 = std::chrono::steady_clock::now();
  std::printf(
      "k3_bench_step: %s, %d layers (%d KDA, %d MLA), TP%d / EP%d rank: experts [0, %d) of %d "
      "held, top-%d, weights on GPU %.2f GB; synth+load %.1f s, upload + capture %.1f s\n",
      a.dsa ? "k3.1" : "k3", cfg.num_hidden_layers, fl.kda_layers, fl.mla_layers, a.tp, a.ep,
      fl.local_experts, static_cast<int>(cfg.num_experts), cfg.num_experts_per_token,
      bb.weight_bytes() / 1e9, std::chrono::duration<double>(t1 - t0).count(),
      std::chrono::duration<double>(t2 - t1).count());

  cuda::DeviceBuffer<uint8_t> flush(256u << 20);
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  struct Row {
    int rows;
    int64_t ctx;
    double stock = 0, spec = 0, floor_ms = 0, card_floor_ms = 0, rel = 0, replay = 0;
  };
  std::vector<Row> table;
  std::vector<std::string> profiles;
  std::printf("\n%-12s %6s %8s %10s %10s %8s %9s  %s\n", "path", "batch", "context", "ms/step",
              "floor ms", "%floor", "GB/s", "check");
  for (const int64_t ctx : a.contexts) {
    // Bind a cache of this context for as many slots as fit beside the weights.
    const auto slot_bytes = [&](int64_t max_context) {
      return max_context * (fl.mla_layers * fl.latent_row) + fl.kda_layers * fl.kda_state / 2 +
             (1 << 20);
    };
    const double per_slot = slot_bytes(ctx + margin);
    size_t free_b = 0, total_b = 0;
    K3_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    cuda::SlotPoolShape shape = o.pool;
    shape.max_context = ctx + margin;
    // The bound pool is freed before the new one is made: count it at its own context.
    const double bound = bb.pool().slots() * slot_bytes(bb.pool().max_context());
    const double have = static_cast<double>(free_b) + bound - 4e9;
    shape.slots = static_cast<int>(std::min<double>(max_batch, std::floor(have / per_slot)));
    if (shape.slots < 1) {
      std::printf("context %lld: no slot fits in memory, skipped\n", static_cast<long long>(ctx));
      continue;
    }
    bb.rebind_cache(shape);
    for (const int rows : a.batches) {
      if (rows > shape.slots) {
        std::printf(
            "%-12s %6d %8lld   skipped: %d rows x %lld tokens of cache (%.1f GB) do not "
            "fit beside %.1f GB of weights\n",
            "-", rows, static_cast<long long>(ctx), rows, static_cast<long long>(ctx),
            rows * per_slot / 1e9, bb.weight_bytes() / 1e9);
        continue;
      }
      std::vector<int32_t> slots(static_cast<size_t>(rows)), toks(static_cast<size_t>(rows));
      for (int r = 0; r < rows; ++r) {
        slots[static_cast<size_t>(r)] = r;
        toks[static_cast<size_t>(r)] = static_cast<int32_t>((r * 7919 + 17) % cfg.vocab_size);
      }
      Row row{rows, ctx};
      const double bytes = bench::floor_bytes(fl, cfg, rows, ctx);
      row.floor_ms = bytes / (bench::kPeakTBps * 1e12) * 1e3;
      row.card_floor_ms = bytes / (card.peak_tbps() * 1e12) * 1e3;
      for (const auto& name : a.paths) {
        const cuda::StepPath path =
            name == "specialized" ? cuda::StepPath::Specialized : cuda::StepPath::Stock;
        bench::rewind(bb, rows, ctx);
        const double med = bench::time_step(bb, slots, toks, path, a.replays, flush);
        const bool finite = bench::finite_logits(bb, rows, V);
        (path == cuda::StepPath::Stock ? row.stock : row.spec) = med;
        std::printf("%-12s %6d %8lld %10.3f %10.3f %7.1f%% %9.0f  %s\n", name.c_str(), rows,
                    static_cast<long long>(ctx), med, row.floor_ms, 100.0 * row.floor_ms / med,
                    bytes / (med * 1e-3) / 1e9, finite ? "logits finite" : "NON-FINITE LOGITS");
        std::fflush(stdout);
        if (!finite) return 1;
        if (tracer) {
          bench::rewind(bb, rows, ctx);
          trace_step(*tracer, bb, slots, toks, path,
                     name + " batch " + std::to_string(rows) + " ctx " + std::to_string(ctx),
                     flush);
        }
        if (path == cuda::StepPath::Specialized && a.tuning && rows == a.batches.front()) {
          // The same graphs timed again at once: run 17 timed the headline 7% above the defaults
          // between the flips (recaptured graphs); this line separates order from capture.
          bench::rewind(bb, rows, ctx);
          std::printf("%-12s %6d %8lld %10.3f   (the same graphs timed again)\n", "spec-again",
                      rows, static_cast<long long>(ctx),
                      bench::time_step(bb, slots, toks, path, a.replays, flush));
        }
        if (a.profile) {
          bench::rewind(bb, rows, ctx);
          std::string p = "  " + name + " batch " + std::to_string(rows) + " ctx " +
                          std::to_string(ctx) + " per stage (ms):";
          for (const auto& st : bb.profile_step(slots, toks, path, 5)) {
            char buf[64];
            std::snprintf(buf, sizeof buf, " %s %.3f", st.stage.c_str(), st.ms);
            p += buf;
          }
          profiles.push_back(p);
        }
      }
      if (want_spec && want_stock) {
        const bench::PathsCheck c = bench::paths_rel_l2(bb, rows, ctx, V, slots, toks);
        row.rel = c.paths;
        row.replay = c.replay;
      }
      if (want_spec && a.tuning && a.flips)
        bench::time_tuning_flips(bb, a, rows, ctx, row.floor_ms, slots, toks, flush);
      table.push_back(row);
    }
  }
  const bench::VerifyResult verify = bench::time_verify(a, bb, cfg, fl, margin, flush);
  for (const auto& p : profiles) std::printf("%s\n", p.c_str());
  std::printf("\n================ summary (%d layers) ================\n", cfg.num_hidden_layers);
  std::printf("floor ms: the bytes at 4.3 TB/s; card flr: at this GPU's measured %.2f TB/s\n",
              card.peak_tbps());
  std::printf("%6s %8s %10s %10s %10s %9s %9s %9s %9s %10s %10s %9s\n", "batch", "context",
              "stock ms", "spec ms", "floor ms", "spec/flr", "card flr", "spec/card", "speedup",
              "rel L2", "replay", "exp/layer");
  for (const Row& r : table)
    std::printf("%6d %8lld %10.3f %10.3f %10.3f %8.2fx %9.3f %8.2fx %8.2fx %10.2e %10.2e %9.1f\n",
                r.rows, static_cast<long long>(r.ctx), r.stock, r.spec, r.floor_ms,
                r.spec > 0 ? r.spec / r.floor_ms : 0.0, r.card_floor_ms,
                r.spec > 0 ? r.spec / r.card_floor_ms : 0.0, r.spec > 0 ? r.stock / r.spec : 0.0,
                r.rel, r.replay, bench::expected_local_experts(fl, cfg, r.rows));
  bench::print_verify(verify);
  return 0;
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  try {
    return k3::run(k3::bench::parse_step_args(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k3_bench_step: %s\n", e.what());
    return 1;
  }
}
