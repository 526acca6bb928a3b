// k3_bench_step: the whole CUDA decode step (cuda::CudaBackbone), stock and specialized paths in
// the same run, on a synthetic K3 checkpoint with real per-rank layer shapes, against the byte
// floor, with a per-stage breakdown of both.
//
// Model: the k3 (or k3.1 with --dsa) preset, --layers deep (K3 schedule: every 4th layer and the
// last are MLA; 93 is the full model), sharded as one TP rank of --tp: attention heads, KDA heads,
// the dense FFN and the lm_head vocabulary divided by tp; routed experts --experts per rank (EP:
// 896 / 16 = 56); shared experts and latent projections whole (replicated, as under EP).
// Collectives are not run. A full-depth rank (~97 GB) does not fit this host's disk as a
// checkpoint: a --template-layers deep checkpoint (same schedule) is synthesized, and layer l of
// the rank uses the weights of a template layer of the same kind (KDA / MLA, dense / MoE), each
// uploaded to its own device memory, so every layer streams its own ~1 GB as a real rank does.
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
#include <map>
#include <string>
#include <utility>
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
  int layers = 8, tp = 16, experts = 56, replays = 20, template_layers = 8;
  bool dsa = false, profile = true, tuning = true;
  std::vector<std::string> paths = {"stock", "specialized"};
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
    else if (k == "--template-layers")
      a.template_layers = std::atoi(v), ++i;
    else if (k == "--no-profile")
      a.profile = false;
    else if (k == "--no-tuning")
      a.tuning = false;
    else if (k == "--paths") {
      a.paths.clear();
      for (std::string p = v; !p.empty();) {
        const size_t c = p.find(',');
        a.paths.push_back(p.substr(0, c));
        p = c == std::string::npos ? "" : p.substr(c + 1);
      }
      ++i;
    } else if (k == "--batch") {
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

ModelConfig rank_config(const Args& a, int layers) {
  ModelConfig c = synth_preset(a.dsa ? "k3.1" : "k3");
  set_k3_layer_schedule(c, layers);
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

// The rank's weights: the template's layers, layer l taking the i-th template layer of its kind
// (round robin), so the rank has cfg.num_hidden_layers layers of real shapes.
ModelWeights replicate_layers(const ModelWeights& tmpl, const ModelConfig& cfg) {
  ModelWeights w = tmpl;
  w.layers.clear();
  std::map<std::pair<int, bool>, int> used;
  for (int l = 0; l < cfg.num_hidden_layers; ++l) {
    const std::pair<int, bool> kind{static_cast<int>(cfg.layer_kind(l)), cfg.is_moe_layer(l)};
    std::vector<size_t> same;
    for (size_t j = 0; j < tmpl.layers.size(); ++j)
      if (static_cast<int>(tmpl.layers[j].kind) == kind.first && tmpl.layers[j].moe == kind.second)
        same.push_back(j);
    K3_CHECK(!same.empty(), "the template checkpoint has no layer of layer ", l, "'s kind");
    w.layers.push_back(tmpl.layers[same[static_cast<size_t>(used[kind]++) % same.size()]]);
  }
  return w;
}

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median over replays of one step of `path`, L2 flushed before each, events around the step.
double time_step(cuda::CudaBackbone& bb, const std::vector<int32_t>& slots,
                 const std::vector<int32_t>& toks, cuda::StepPath path, int replays,
                 cuda::DeviceBuffer<uint8_t>& flush) {
  cudaEvent_t e0, e1;
  K3_CUDA_CHECK(cudaEventCreate(&e0));
  K3_CUDA_CHECK(cudaEventCreate(&e1));
  bb.step(slots, toks, path);  // eager on first use (attributes, plans) or replay
  bb.step(slots, toks, path);  // captured
  std::vector<double> ms;
  for (int i = 0; i < replays; ++i) {
    flush.fill_bytes(i & 0xff, bb.stream());
    K3_CUDA_CHECK(cudaEventRecord(e0, bb.stream()));
    bb.step(slots, toks, path);
    K3_CUDA_CHECK(cudaEventRecord(e1, bb.stream()));
    K3_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    K3_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  K3_CUDA_CHECK(cudaEventDestroy(e0));
  K3_CUDA_CHECK(cudaEventDestroy(e1));
  return median_ms(ms);
}

bool finite_logits(cuda::CudaBackbone& bb, int rows, size_t V) {
  std::vector<float> logits(V * static_cast<size_t>(rows));
  bb.logits_to_host(rows, logits.data());
  return std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); });
}

// Logits of the two paths on the same state and tokens: rel L2 (the speed numbers' check).
double paths_rel_l2(cuda::CudaBackbone& bb, int rows, int64_t ctx, size_t V,
                    const std::vector<int32_t>& slots, const std::vector<int32_t>& toks) {
  std::vector<float> a(V * rows), b(V * rows);
  for (int r = 0; r < rows; ++r) bb.assume_context(r, ctx);
  bb.step(slots, toks, cuda::StepPath::Stock);
  bb.logits_to_host(rows, a.data());
  for (int r = 0; r < rows; ++r) bb.assume_context(r, ctx);
  bb.step(slots, toks, cuda::StepPath::Specialized);
  bb.logits_to_host(rows, b.data());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(b[i]) - a[i]) * (static_cast<double>(b[i]) - a[i]);
    den += static_cast<double>(a[i]) * a[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

int run(const Args& a) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no GPU: skipped\n");
    return 77;
  }
  const ModelConfig cfg = rank_config(a, a.layers);
  const int tl = std::min(a.layers, a.template_layers);
  const ModelConfig tcfg = rank_config(a, tl);
  const std::string dir =
      a.dir.empty() ? (std::filesystem::temp_directory_path() /
                       ("k3_bench_step_l" + std::to_string(tl) + "_tp" + std::to_string(a.tp) +
                        "_e" + std::to_string(a.experts) + (a.dsa ? "_dsa" : "")))
                          .string()
                    : a.dir;
  const auto t0 = std::chrono::steady_clock::now();
  if (!std::filesystem::exists(std::filesystem::path(dir) / "config.json")) {
    SynthOptions so;
    so.seed = 3;
    synthesize_checkpoint(tcfg, dir, so);
  }
  const auto model = LoadedModel::load(dir);
  const ModelWeights weights = replicate_layers(model->weights, cfg);
  const auto t1 = std::chrono::steady_clock::now();
  const int max_rows = *std::max_element(a.batches.begin(), a.batches.end());
  const int64_t max_ctx = *std::max_element(a.contexts.begin(), a.contexts.end());
  const bool want_spec = std::find(a.paths.begin(), a.paths.end(), "specialized") != a.paths.end();
  const bool want_stock = std::find(a.paths.begin(), a.paths.end(), "stock") != a.paths.end();
  const int64_t margin = 4 * a.replays + 64;
  cuda::CudaBackboneOptions o;
  o.max_rows = max_rows;
  o.pool.slots = max_rows;
  o.pool.max_context = std::min<int64_t>(a.contexts.front(), max_ctx) + margin;
  if (want_spec) {
    o.capture_sizes = a.batches;
    std::sort(o.capture_sizes.begin(), o.capture_sizes.end());
    o.capture_sizes.erase(std::unique(o.capture_sizes.begin(), o.capture_sizes.end()),
                          o.capture_sizes.end());
  }
  cuda::CudaBackbone bb(cfg, weights, o);
  const auto t2 = std::chrono::steady_clock::now();
  const Floor fl = floor_of(cfg, weights);
  std::printf(
      "k3_bench_step: %s, %d layers (%d KDA, %d MLA), TP%d rank, %d experts, top-%d, "
      "weights on GPU %.2f GB; synth+load %.1f s, upload + capture %.1f s\n",
      a.dsa ? "k3.1" : "k3", cfg.num_hidden_layers, fl.kda_layers, fl.mla_layers, a.tp,
      static_cast<int>(cfg.num_experts), cfg.num_experts_per_token, bb.weight_bytes() / 1e9,
      std::chrono::duration<double>(t1 - t0).count(),
      std::chrono::duration<double>(t2 - t1).count());

  cuda::DeviceBuffer<uint8_t> flush(256u << 20);
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  struct Row {
    int rows;
    int64_t ctx;
    double stock = 0, spec = 0, floor_ms = 0, rel = 0;
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
    shape.slots = static_cast<int>(std::min<double>(max_rows, std::floor(have / per_slot)));
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
      const double bytes = floor_bytes(fl, cfg, rows, ctx);
      row.floor_ms = bytes / (kPeakTBps * 1e12) * 1e3;
      for (const auto& name : a.paths) {
        const cuda::StepPath path =
            name == "specialized" ? cuda::StepPath::Specialized : cuda::StepPath::Stock;
        for (int r = 0; r < rows; ++r) bb.assume_context(r, ctx);
        const double med = time_step(bb, slots, toks, path, a.replays, flush);
        const bool finite = finite_logits(bb, rows, V);
        (path == cuda::StepPath::Stock ? row.stock : row.spec) = med;
        std::printf("%-12s %6d %8lld %10.3f %10.3f %7.1f%% %9.0f  %s\n", name.c_str(), rows,
                    static_cast<long long>(ctx), med, row.floor_ms, 100.0 * row.floor_ms / med,
                    bytes / (med * 1e-3) / 1e9, finite ? "logits finite" : "NON-FINITE LOGITS");
        std::fflush(stdout);
        if (!finite) return 1;
        if (a.profile) {
          for (int r = 0; r < rows; ++r) bb.assume_context(r, ctx);
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
      if (want_spec && want_stock) row.rel = paths_rel_l2(bb, rows, ctx, V, slots, toks);
      if (want_spec && a.tuning && rows == a.batches.front()) {
        // The specialized path with its PDL edges off, then with the L2 prefetch on (it is off
        // by default), one change at a time.
        const size_t l2_default = cuda::CudaBackboneOptions{}.l2_prefetch_bytes;
        for (const auto& [pdl, l2] : {std::pair<bool, size_t>{false, l2_default},
                                      std::pair<bool, size_t>{true, cuda::kL2PrefetchTrialBytes}}) {
          bb.set_specialized_tuning(pdl, l2);
          for (int r = 0; r < rows; ++r) bb.assume_context(r, ctx);
          const double med =
              time_step(bb, slots, toks, cuda::StepPath::Specialized, a.replays, flush);
          std::printf("%-12s %6d %8lld %10.3f %10.3f %7.1f%%            (%s)\n", "spec-tuning",
                      rows, static_cast<long long>(ctx), med, row.floor_ms,
                      100.0 * row.floor_ms / med, !pdl ? "PDL edges off" : "L2 prefetch on, 24 MB");
        }
        bb.set_specialized_tuning(true, l2_default);
      }
      table.push_back(row);
    }
  }
  for (const auto& p : profiles) std::printf("%s\n", p.c_str());
  std::printf("\n================ summary (%d layers) ================\n", cfg.num_hidden_layers);
  std::printf("%6s %8s %10s %10s %10s %9s %9s %10s\n", "batch", "context", "stock ms", "spec ms",
              "floor ms", "spec/flr", "speedup", "rel L2");
  for (const Row& r : table)
    std::printf("%6d %8lld %10.3f %10.3f %10.3f %8.2fx %8.2fx %10.2e\n", r.rows,
                static_cast<long long>(r.ctx), r.stock, r.spec, r.floor_ms,
                r.spec > 0 ? r.spec / r.floor_ms : 0.0, r.spec > 0 ? r.stock / r.spec : 0.0, r.rel);
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
