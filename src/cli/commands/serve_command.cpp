// `k3 serve`: the OpenAI-compatible HTTP server. Flags follow vLLM's names, so a vLLM launch
// line for Kimi K3 works here; --additional-config carries the deployment keys
// (decode_backend, ...) as one JSON object, with the dedicated flags layered on top.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "model/loaded_model.h"
#include "parallel/parallel_step_backend.h"
#include "runtime/deploy_config.h"
#include "serve/engine.h"
#include "serve/server.h"
#include "spec/draft_model.h"

namespace k3::cli {
namespace {

using json = nlohmann::json;

struct ServeOpts {
  std::string model, host = "127.0.0.1", served_model_name, device = "auto";
  int port = 8000;
  int max_num_seqs = 16, max_num_batched_tokens = 256, max_queued_requests = 256;
  int cpu_threads = 0;
  int64_t max_model_len = 0;
  std::string kv_cache_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype, decode_backend;
  std::string speculative_config, additional_config;
  bool fp32 = false;
  parallel::ParallelLayout layout;  // vLLM's parallel flags: the multi-rank CPU backbone
};

json parse_json_flag(const char* flag, const std::string& text) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    fail(flag, " is not valid JSON: ", e.what());
  }
}

// The deployment: --additional-config first, then each dedicated flag that was given. A key set
// both ways with different values is an error rather than a silent override.
DeployConfig deploy_config(const ServeOpts& o, const CLI::App& sub) {
  json doc = json::object();
  if (!o.additional_config.empty()) {
    doc = parse_json_flag("--additional-config", o.additional_config);
    K3_CHECK(doc.is_object(), "--additional-config must be a JSON object");
  }
  const auto set = [&](const char* flag, const char* key, const json& v) {
    if (sub.count(flag) == 0) return;
    K3_CHECK(!doc.contains(key) || doc[key] == v, flag, " ", v.dump(),
             " contradicts --additional-config ", key, " ", doc[key].dump());
    doc[key] = v;
  };
  set("--decode-backend", "decode_backend", o.decode_backend);
  set("--kv-cache-dtype", "kv_cache_dtype", o.kv_cache_dtype);
  set("--mamba-cache-dtype", "mamba_cache_dtype", o.mamba_cache_dtype);
  set("--mamba-ssm-cache-dtype", "mamba_ssm_cache_dtype", o.mamba_ssm_cache_dtype);
  set("--max-model-len", "max_model_len", o.max_model_len);
  set("--tensor-parallel-size", "tensor_parallel_size", o.layout.tp);
  set("--data-parallel-size", "data_parallel_size", o.layout.dp);
  set("--enable-expert-parallel", "enable_expert_parallel", o.layout.ep);
  set("--decode-context-parallel-size", "decode_context_parallel_size", o.layout.dcp);
  if (!o.speculative_config.empty())
    set("--speculative-config", "speculative_config",
        parse_json_flag("--speculative-config", o.speculative_config));
  set("--max-num-seqs", "max_num_seqs", o.max_num_seqs);
  if (!doc.contains("max_num_seqs")) doc["max_num_seqs"] = o.max_num_seqs;  // the serve default
  return parse_deploy_config(doc);
}

std::string model_name(const ServeOpts& o, const std::string& dir) {
  if (!o.served_model_name.empty()) return o.served_model_name;
  std::filesystem::path p(dir);
  if (p.filename().empty()) p = p.parent_path();  // "dir/" names "dir"
  return p.filename().string();
}

void run_serve(const ServeOpts& o, const CLI::App& sub) {
  const DeployConfig dc = deploy_config(o, sub);
  const std::string device = choose_device(o.device);
  const std::string dir = o.model.empty() ? builtin_tiny_model_dir() : o.model;
  auto model = LoadedModel::load(dir);
  const ModelConfig& cfg = model->config;
  validate_deploy_config(cfg, dc);
  if (device == "cuda" && follower_process()) {  // rank 0 of this launch serves
    serve::run_cuda_follower(std::move(model), dc);
    return;
  }
  if (specialized_decode_config(cfg, dc) && device != "cuda")
    fail(
        "decode_backend latency_specialized runs on the CUDA executor; this server runs on the "
        "CPU (no GPU, a build without CUDA, or --device cpu)");
  K3_CHECK(o.max_queued_requests >= 0, "--max-queued-requests must be >= 0");

  std::shared_ptr<const serve::TextCodec> codec = serve::TextCodec::load(dir);
  K3_CHECK(device == "cpu" || !o.fp32, "--fp32 runs the CPU reference only; drop --device cuda");
  const parallel::ParallelLayout layout = parallel::layout_of(dc);
  const bool multi_rank = layout.multi_rank();
  K3_CHECK(!multi_rank || !o.fp32, "--fp32 is not supported by the multi-rank backends");
  // The CUDA backend runs a multi-rank layout itself (ranks as threads, or processes under
  // tools/launch_ranks.sh); on the CPU it is the multi-rank reference.
  auto backend = device == "cuda" ? serve::make_cuda_backend(std::move(model), dc)
                 : multi_rank
                     ? parallel::make_parallel_cpu_backend(std::move(model), dc, layout)
                     : serve::make_cpu_backend(std::move(model), dc, o.fp32, o.cpu_threads);
  const int64_t max_len = backend->max_context();

  // SIGINT / SIGTERM are taken by one waiting thread; every thread started from here on
  // inherits the blocked mask, so no handler runs inside the engine or httplib. SIGUSR1 is the
  // internal "the server ended by itself" wake-up.
  sigset_t signals;
  sigemptyset(&signals);
  for (int s : {SIGINT, SIGTERM, SIGUSR1}) sigaddset(&signals, s);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  serve::Metrics metrics;
  serve::EngineOptions eo;
  eo.max_num_seqs = dc.max_num_seqs;
  eo.max_num_batched_tokens = std::max(o.max_num_batched_tokens, dc.max_num_seqs);
  eo.max_waiting = o.max_queued_requests;
  eo.speculative = dc.speculative_config;  // runs on the CPU backend's verify step
  // The CUDA backend drafts with the draft model on its GPU (StepBackend::make_drafter).
  if (dc.speculative_config.method == "draft_model" && device != "cuda")
    eo.draft_model = spec::DraftModel::load(dc.speculative_config.model, cfg);
  serve::Engine engine(std::move(backend), codec, eo, metrics);

  serve::ServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.model_name = model_name(o, dir);
  so.model_path = dir;
  so.max_model_len = max_len;
  // A connection thread per running and queued request, plus idle keep-alive connections.
  so.http_threads = std::min(1024, dc.max_num_seqs + o.max_queued_requests + 16);
  serve::Server server(engine, *codec, metrics, so);
  const int port = server.bind();
  std::fprintf(stderr,
               "k3 serve: model %s as \"%s\" (%d layers, tokenizer: %s), device %s, "
               "max_num_seqs %d, max_model_len %lld\n",
               dir.c_str(), so.model_name.c_str(), cfg.num_hidden_layers, codec->name().c_str(),
               device.c_str(), dc.max_num_seqs, static_cast<long long>(max_len));
  std::fprintf(stderr, "k3 serve: listening on http://%s:%d\n", o.host.c_str(), port);

  std::atomic<bool> served{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    if (sig != SIGUSR1) std::fprintf(stderr, "k3 serve: %s, shutting down\n", strsignal(sig));
    engine.stop();  // ends every request, so open handlers answer and return
    // Repeated, because a stop() that lands before listen() starts is a no-op in httplib.
    // httplib then joins its connection threads, and an idle keep-alive connection holds one
    // for up to its 5 s timeout; every request is answered by then, so that wait is cut short.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (!served.load()) {
      server.stop();
      if (std::chrono::steady_clock::now() > deadline) {
        std::fprintf(stderr, "k3 serve: stopped (idle connections closed)\n");
        std::_Exit(0);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  server.run();
  served = true;
  pthread_kill(waiter.native_handle(), SIGUSR1);
  waiter.join();
  engine.stop();
  std::fprintf(stderr, "k3 serve: stopped\n");
}

}  // namespace

void register_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOpts>();
  CLI::App* sub = app.add_subcommand("serve", "OpenAI-compatible HTTP server");
  sub->add_option("--model", o->model, "checkpoint directory (default: the built-in tiny model)");
  sub->add_option("--host", o->host, "address to listen on")->capture_default_str();
  sub->add_option("--port", o->port, "port to listen on (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  sub->add_option("--served-model-name", o->served_model_name,
                  "model name in the API (default: the model directory's name)");
  sub->add_option("--max-num-seqs", o->max_num_seqs, "requests decoded together")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--max-num-batched-tokens", o->max_num_batched_tokens,
                  "tokens per scheduler step (decode rows + prompt chunks)")
      ->capture_default_str();
  sub->add_option("--max-queued-requests", o->max_queued_requests,
                  "requests waiting for a slot before new ones get 503")
      ->capture_default_str();
  sub->add_option("--max-model-len", o->max_model_len, "context limit (0: the model's)");
  sub->add_option("--kv-cache-dtype", o->kv_cache_dtype,
                  "auto | bfloat16 | fp8 | fp8_ds_mla | nvfp4_ds_mla");
  sub->add_option("--mamba-cache-dtype", o->mamba_cache_dtype, "KDA conv state dtype");
  sub->add_option("--mamba-ssm-cache-dtype", o->mamba_ssm_cache_dtype, "KDA recurrent state dtype");
  sub->add_option("--decode-backend", o->decode_backend, "auto | latency_specialized");
  sub->add_option("--speculative-config", o->speculative_config,
                  "JSON: {\"method\": ..., \"num_speculative_tokens\": N, ...}");
  sub->add_option("--additional-config", o->additional_config,
                  "JSON deployment keys, e.g. {\"decode_backend\": \"auto\"}");
  sub->add_option("--device", o->device, "auto | cpu | cuda")->capture_default_str();
  sub->add_option("--tensor-parallel-size", o->layout.tp,
                  "TP ranks (threads, or processes under tools/launch_ranks.sh)")
      ->capture_default_str();
  sub->add_option("--data-parallel-size", o->layout.dp, "DP replicas")->capture_default_str();
  sub->add_flag("--enable-expert-parallel", o->layout.ep, "experts placed over all ranks (EP)");
  sub->add_option("--decode-context-parallel-size", o->layout.dcp,
                  "latent cache sharded by token over the TP ranks (1 or the TP size)")
      ->capture_default_str();
  sub->add_option("--cpu-threads", o->cpu_threads,
                  "threads the CPU reference runs a step's requests on (0: one per core)")
      ->capture_default_str();
  sub->add_flag("--fp32", o->fp32, "pure fp32 activations (no bf16 rounding at boundaries)");
  sub->callback([o, sub] { run_serve(*o, *sub); });
}

}  // namespace k3::cli
