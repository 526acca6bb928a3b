// k3_bench_step: the whole stock CUDA decode step (cuda::CudaBackbone) on a synthetic K3
// checkpoint with real per-rank layer shapes and reduced depth, against the byte floor.
//
// Model: the k3 (or k3.1 with --dsa) preset, --layers deep (K3 schedule: every 4th layer and the
// last are MLA), sharded as one TP rank of --tp: attention heads, KDA heads, the dense FFN and the
// lm_head vocabulary divided by tp; routed experts --experts per rank (EP: 896 / 16 = 56); shared
// experts and latent projections whole (replicated, as under EP). Collectives are not run.
// Context: every row's cache is made --context long (deterministic synthetic latents).
// Timing: CUDA-graph replays of the step for each batch, L2 flushed (256 MB write) before each,
// events around the step, median of --replays.
// Floor: bytes the step must read (every weight of the layers' attention, router, latent and
// shared projections, lm_head; the routed experts a batch touches, expected distinct
// E (1 - (1 - k/E)^rows) under uniform routing; each row's latent cache min(ctx, topk) x W x 2 B
// per MLA layer; KDA state read + write) / 4.3 TB/s.
// Correctness beside the number: the same step is checked against the CPU reference on the
// tiny models by k3_gpu_tests (CudaBackbone.*); here every logit must be finite.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/backbone.h"
#include "cuda/check.h"
#include "cuda/device_buffer.h"
#include "model/loaded_model.h"
#include "synth/presets.h"
#include "synth/synthesize.h"

namespace k3 {
namespace {

constexpr double kPeakTBps = 4.3;

struct Args {
  int layers = 8, tp = 16, experts = 56, replays = 20;
  bool dsa = false;
  std::vector<int> batches = {1, 8, 64};
  std::vector<int64_t> contexts = {1024, 32768};
  std::string dir;
};

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    out.push_back(std::strtoll(p, &end, 10));
    p = (*end == ',') ? end + 1 : end;
    if (end == p && *p) break;
  }
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : "";
    if (k == "--layers")
      a.layers = std::atoi(v), ++i;
    else if (k == "--tp")
      a.tp = std::atoi(v), ++i;
    else if (k == "--experts")
      a.experts = std::atoi(v), ++i;
    else if (k == "--replays")
      a.replays = std::atoi(v), ++i;
    else if (k == "--dir")
      a.dir = v, ++i;
    else if (k == "--dsa")
      a.dsa = true;
    else if (k == "--batch") {
      a.batches.clear();
      for (int64_t b : parse_list(v)) a.batches.push_back(static_cast<int>(b));
      ++i;
    } else if (k == "--context")
      a.contexts = parse_list(v), ++i;
    else
      fail("unknown argument ", k);
  }
  return a;
}

ModelConfig rank_config(const Args& a) {
  ModelConfig c = synth_preset(a.dsa ? "k3.1" : "k3");
  set_k3_layer_schedule(c, a.layers);
  K3_CHECK(c.num_attention_heads % a.tp == 0 && c.linear_attn_config.num_heads % a.tp == 0,
           "--tp must divide the head counts");
  c.num_attention_heads /= a.tp;
  c.linear_attn_config.num_heads /= a.tp;
  c.intermediate_size /= a.tp;
  c.vocab_size /= a.tp;  // vocab-parallel embedding / lm_head: this rank's shard
  // Special ids of the full vocabulary fall outside a shard; any ids inside it do for timing.
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  c.pad_token_id = 3;
  c.num_experts = a.experts;
  c.num_experts_per_token = std::min(c.num_experts_per_token, a.experts);
  return c;
}

struct Floor {
  double fixed = 0;   // weights every step reads
  double expert = 0;  // one routed expert (w1 + w3 + w2)
  int moe_layers = 0, mla_layers = 0, kda_layers = 0;
  double kda_state = 0;   // per row per KDA layer, read + write
  double latent_row = 0;  // per cached token per MLA layer
};

Floor floor_of(const ModelConfig& c, const ModelWeights& w) {
  Floor f;
  const auto add = [&](const WeightMatrix& m) {
    if (!m.empty()) f.fixed += static_cast<double>(m.storage_bytes());
  };
  add(w.lm_head);
  for (const LayerWeights& L : w.layers) {
    if (L.kind == LayerKind::KDA) {
      ++f.kda_layers;
      for (const WeightMatrix* m :
           {&L.kda.q_proj, &L.kda.k_proj, &L.kda.v_proj, &L.kda.f_a, &L.kda.f_b, &L.kda.b_proj,
            &L.kda.g_proj, &L.kda.g_a, &L.kda.g_b, &L.kda.o_proj})
        add(*m);
    } else {
      ++f.mla_layers;
      for (const WeightMatrix* m : {&L.mla.q_a, &L.mla.q_b, &L.mla.q_proj, &L.mla.kv_a, &L.mla.kv_b,
                                    &L.mla.g_proj, &L.mla.o_proj})
        add(*m);
      if (L.mla.indexer)
        for (const WeightMatrix* m :
             {&L.mla.indexer->wq_b, &L.mla.indexer->wk, &L.mla.indexer->weights_proj})
          add(*m);
    }
    if (L.moe) {
      ++f.moe_layers;
      for (const WeightMatrix* m : {&L.moe_w.gate, &L.moe_w.latent_down, &L.moe_w.latent_up,
                                    &L.moe_w.shared_gate, &L.moe_w.shared_up, &L.moe_w.shared_down})
        add(*m);
      const ExpertWeights& e = L.moe_w.experts[0];
      f.expert =
          static_cast<double>(e.w1.storage_bytes() + e.w3.storage_bytes() + e.w2.storage_bytes());
    } else {
      for (const WeightMatrix* m : {&L.dense.gate, &L.dense.up, &L.dense.down}) add(*m);
    }
  }
  const double D = c.linear_attn_config.head_dim;
  f.kda_state = 2.0 * c.linear_attn_config.num_heads * D * D * 4;
  f.latent_row = (c.kv_lora_rank + c.qk_rope_head_dim) * 2.0 +
                 (c.dsa_config.enabled ? c.dsa_config.index_head_dim + 4.0 : 0.0);
  return f;
}

double floor_bytes(const Floor& f, const ModelConfig& c, int rows, int64_t ctx) {
  const double E = c.num_experts, k = c.num_experts_per_token;
  const double distinct = E * (1.0 - std::pow(1.0 - k / E, rows));
  const double attended =
      c.dsa_config.enabled ? std::min<double>(ctx, c.dsa_config.index_topk) : ctx;
  return f.fixed + f.moe_layers * distinct * f.expert + rows * f.kda_layers * f.kda_state +
         rows * f.mla_layers * attended * f.latent_row;
}

int run(const Args& a) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no GPU: skipped\n");
    return 77;
  }
  const ModelConfig cfg = rank_config(a);
  const std::string dir =
      a.dir.empty()
          ? (std::filesystem::temp_directory_path() /
             ("k3_bench_step_l" + std::to_string(a.layers) + "_tp" + std::to_string(a.tp) + "_e" +
              std::to_string(a.experts) + (a.dsa ? "_dsa" : "")))
                .string()
          : a.dir;
  const auto t0 = std::chrono::steady_clock::now();
  if (!std::filesystem::exists(std::filesystem::path(dir) / "config.json")) {
    SynthOptions so;
    so.seed = 3;
    synthesize_checkpoint(cfg, dir, so);
  }
  const auto model = LoadedModel::load(dir);
  const auto t1 = std::chrono::steady_clock::now();
  const int max_rows = *std::max_element(a.batches.begin(), a.batches.end());
  const int64_t max_ctx = *std::max_element(a.contexts.begin(), a.contexts.end());
  cuda::CudaBackboneOptions o;
  o.max_rows = max_rows;
  o.pool.slots = max_rows;
  o.pool.max_context = max_ctx + 4 * a.replays + 16;
  cuda::CudaBackbone bb(model->config, model->weights, o);
  const auto t2 = std::chrono::steady_clock::now();
  const Floor fl = floor_of(model->config, model->weights);
  std::printf(
      "k3_bench_step: %s, %d layers (%d KDA, %d MLA), TP%d rank, %d experts, top-%d, "
      "weights on GPU %.2f GB; synth+load %.1f s, upload %.1f s\n",
      a.dsa ? "k3.1" : "k3", cfg.num_hidden_layers, fl.kda_layers, fl.mla_layers, a.tp,
      static_cast<int>(cfg.num_experts), cfg.num_experts_per_token, bb.weight_bytes() / 1e9,
      std::chrono::duration<double>(t1 - t0).count(),
      std::chrono::duration<double>(t2 - t1).count());

  cuda::DeviceBuffer<uint8_t> flush(256u << 20);
  cudaEvent_t e0, e1;
  K3_CUDA_CHECK(cudaEventCreate(&e0));
  K3_CUDA_CHECK(cudaEventCreate(&e1));
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  std::vector<float> logits(V * static_cast<size_t>(max_rows));
  std::printf("\n%-8s %6s %8s %10s %10s %8s %9s  %s\n", "kernel", "batch", "context", "ms/step",
              "floor ms", "%floor", "GB/s", "check");
  for (const int64_t ctx : a.contexts) {
    for (const int rows : a.batches) {
      std::vector<int32_t> slots(static_cast<size_t>(rows)), toks(static_cast<size_t>(rows));
      for (int r = 0; r < rows; ++r) {
        slots[static_cast<size_t>(r)] = r;
        toks[static_cast<size_t>(r)] = static_cast<int32_t>((r * 7919 + 17) % cfg.vocab_size);
      }
      for (int r = 0; r < rows; ++r) bb.assume_context(r, ctx);
      bb.step(slots, toks);  // eager (attributes, plans)
      bb.step(slots, toks);  // captured
      std::vector<double> ms;
      for (int i = 0; i < a.replays; ++i) {
        flush.fill_bytes(i & 0xff, bb.stream());
        K3_CUDA_CHECK(cudaEventRecord(e0, bb.stream()));
        bb.step(slots, toks);
        K3_CUDA_CHECK(cudaEventRecord(e1, bb.stream()));
        K3_CUDA_CHECK(cudaEventSynchronize(e1));
        float t = 0;
        K3_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
      }
      bb.logits_to_host(rows, logits.data());
      const bool finite = std::all_of(logits.begin(), logits.begin() + V * rows,
                                      [](float v) { return std::isfinite(v); });
      std::sort(ms.begin(), ms.end());
      const double med = ms[ms.size() / 2];
      const double bytes = floor_bytes(fl, cfg, rows, ctx);
      const double floor_ms = bytes / (kPeakTBps * 1e12) * 1e3;
      std::printf("%-8s %6d %8lld %10.3f %10.3f %7.1f%% %9.0f  %s\n", "step", rows,
                  static_cast<long long>(ctx), med, floor_ms, 100.0 * floor_ms / med,
                  bytes / (med * 1e-3) / 1e9, finite ? "logits finite" : "NON-FINITE LOGITS");
      std::fflush(stdout);
      if (!finite) return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  try {
    return k3::run(k3::parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "k3_bench_step: %s\n", e.what());
    return 1;
  }
}
