#include <algorithm>
#include <cstdio>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "cpu/backbone.h"
#include "cpu/generate.h"
#include "model/loaded_model.h"
#include "parallel/parallel_generate.h"
#include "runtime/deploy_config.h"
#include "serve/backend_generate.h"
#include "serve/step_backend.h"
#include "spec/draft_model.h"
#include "spec/drafter.h"
#include "spec/spec_generate.h"
#include "text/byte_tokenizer.h"
#include "text/tokenizer.h"

namespace k3::cli {
namespace {

GpuProbe g_probe = nullptr;

struct GenerateOpts {
  std::string model, prompt = "The Kimi K3 model", prompt_ids, device = "auto";
  std::string decode_backend = "auto", kv_cache_dtype = "auto";
  std::string mamba_cache_dtype = "auto", mamba_ssm_cache_dtype = "auto";
  std::string speculative_config;  // JSON, vLLM's --speculative-config
  int max_tokens = 32;
  int64_t max_model_len = 0;
  float temperature = 0.0f, top_p = 1.0f;
  int top_k = 0;
  uint64_t seed = 0;
  bool ignore_eos = false, show_ids = false, fp32 = false;
  parallel::ParallelLayout layout;  // --tp / --dp / --ep / --dcp: the multi-rank backbones
};

void run_generate(const GenerateOpts& o) {
  DeployConfig dc;
  dc.decode_backend = parse_decode_backend(o.decode_backend);
  dc.kv_cache_dtype = parse_kv_cache_dtype(o.kv_cache_dtype);
  dc.mamba_cache_dtype = parse_state_dtype("mamba_cache_dtype", o.mamba_cache_dtype);
  dc.mamba_ssm_cache_dtype = parse_state_dtype("mamba_ssm_cache_dtype", o.mamba_ssm_cache_dtype);
  dc.max_model_len = o.max_model_len;
  dc.tensor_parallel_size = o.layout.tp;
  dc.data_parallel_size = o.layout.dp;
  dc.enable_expert_parallel = o.layout.ep;
  dc.decode_context_parallel_size = o.layout.dcp;
  if (!o.speculative_config.empty()) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(o.speculative_config);
    } catch (const nlohmann::json::parse_error& e) {
      fail("--speculative-config is not valid JSON: ", e.what());
    }
    // The deployment parser checks its keys and types (the only key given here).
    dc.speculative_config = parse_deploy_config({{"speculative_config", j}}).speculative_config;
  }

  const std::string device = choose_device(o.device);
  const std::string dir = o.model.empty() ? builtin_tiny_model_dir() : o.model;
  const auto model = LoadedModel::load(dir);
  const ModelConfig& cfg = model->config;
  validate_deploy_config(cfg, dc);
  if (device == "cuda" && follower_process()) {  // rank 0 of this launch generates
    serve::run_cuda_follower(LoadedModel::load(dir), dc);
    return;
  }
  // Refusals of the specialized path come first, with their reason, even on the CPU.
  if (specialized_decode_config(cfg, dc) && device != "cuda")
    fail(
        "decode_backend latency_specialized runs on the CUDA executor; this run is on the CPU "
        "(no GPU, a build without CUDA, or --device cpu)");
  const KdaDtypes kd = kda_dtypes(cfg, dc);
  cpu::Numerics num;
  num.bf16_activations = !o.fp32;
  // The latent cache holds exactly what the kv_cache_dtype format holds (cpu/latent_format.h).
  const cpu::CpuBackbone backbone(cfg, model->weights,
                                  {kd.conv, kd.recurrent, cpu::latent_format_of(dc.kv_cache_dtype)},
                                  num, dc.max_model_len);

  // The model's tokenizer (the byte-level fallback when it ships none). Its ids must cover
  // everything the model can sample.
  const auto tok = Tokenizer::load(dir);
  K3_CHECK(tok->byte_fallback() || tok->vocab_size() >= cfg.vocab_size, "the tokenizer in ", dir,
           " has ", tok->vocab_size(), " ids but the model's vocab_size is ", cfg.vocab_size);
  cpu::GenerateRequest req;
  // Special-token strings in --prompt are special tokens, as in tokenization_kimi.py's encode.
  req.prompt = o.prompt_ids.empty() ? tok->encode(o.prompt, /*allow_special=*/true)
                                    : parse_token_ids(o.prompt_ids);
  if (o.prompt_ids.empty() && cfg.bos_token_id >= 0)
    req.prompt.insert(req.prompt.begin(), cfg.bos_token_id);
  req.max_new_tokens = o.max_tokens;
  req.sampling = {o.temperature, o.top_k, o.top_p, o.seed};
  req.ignore_eos = o.ignore_eos;

  std::fprintf(stderr, "k3: model %s (%d layers), device %s, tokenizer %s, prompt %zu tokens\n",
               dir.c_str(), cfg.num_hidden_layers, device.c_str(),
               tok->byte_fallback() ? "byte-level" : "tiktoken BPE", req.prompt.size());
  StreamDecoder text(*tok);  // holds bytes of a character split across tokens
  const auto print = [&](int64_t id) {
    if (o.show_ids)
      std::printf("%lld ", static_cast<long long>(id));
    else
      std::fputs(text.push(id).c_str(), stdout);
    std::fflush(stdout);
  };
  const SpeculativeConfig& sc = dc.speculative_config;
  const bool multi_rank = o.layout.multi_rank();
  K3_CHECK(!multi_rank || device == "cuda" || sc.num_speculative_tokens == 0,
           "--tp / --dp / --ep / --dcp on the CPU reference (src/parallel) run without "
           "speculative decoding; the CUDA backend runs both");
  cpu::GenerateResult res;
  spec::SpecStats stats;
  if (sc.num_speculative_tokens > 0) {
    // On the GPU the verify steps run on the CUDA backend (q tokens as one step) and a draft
    // model drafts on the GPU beside it (the backend's drafter); on the CPU both run there.
    spec::SpecGenerateResult r;
    if (device == "cuda") {
      const auto backend = serve::make_cuda_backend(LoadedModel::load(dir), dc);
      const auto drafter = backend->make_drafter(sc, req.sampling);
      const auto fallback = drafter ? nullptr : spec::make_drafter(sc, nullptr, req.sampling);
      r = serve::speculative_generate_on(*backend, req, drafter ? *drafter : *fallback,
                                         sc.num_speculative_tokens, print);
    } else {
      const std::unique_ptr<spec::DraftModel> draft =
          sc.method == "draft_model" ? spec::DraftModel::load(sc.model, cfg) : nullptr;
      const auto drafter = spec::make_drafter(sc, draft.get(), req.sampling);
      r = spec::speculative_generate(backbone, req, *drafter, sc.num_speculative_tokens, print);
    }
    res = std::move(r.result);
    stats = r.stats;
  } else if (multi_rank && device == "cpu") {
    const parallel::ParallelCpuBackbone par(
        cfg, model->weights, {kd.conv, kd.recurrent, cpu::latent_format_of(dc.kv_cache_dtype)},
        o.layout, num, dc.max_model_len);
    std::fprintf(stderr, "k3: %d CPU ranks (tp %d, dp %d, ep %s, dcp %d)\n", o.layout.world(),
                 o.layout.tp, o.layout.dp, o.layout.ep ? "on" : "off", o.layout.dcp);
    res = parallel::generate(par, req, print);
  } else if (device == "cuda") {
    // The CUDA StepBackend (stock path, or latency_specialized's routing; the ranks of a
    // multi-rank layout) on its own copy of the checkpoint mapping.
    if (multi_rank)
      std::fprintf(stderr, "k3: %d CUDA ranks (tp %d, dp %d, ep %s, dcp %d)\n", o.layout.world(),
                   o.layout.tp, o.layout.dp, o.layout.ep ? "on" : "off", o.layout.dcp);
    const auto backend = serve::make_cuda_backend(LoadedModel::load(dir), dc);
    res = serve::generate_on(*backend, req, print);
  } else {
    res = cpu::generate(backbone, req, print);
  }
  if (!o.show_ids) std::fputs(text.flush().c_str(), stdout);
  std::printf("\n");
  const double tps = res.decode_seconds > 0 ? res.tokens.size() / res.decode_seconds : 0.0;
  std::fprintf(stderr, "k3: %zu tokens (%s), prefill %.1f ms, decode %.1f tok/s\n",
               res.tokens.size(), res.finish_reason.c_str(), res.prefill_seconds * 1e3, tps);
  if (sc.num_speculative_tokens > 0)
    std::fprintf(stderr,
                 "k3: speculative %s: %lld/%lld draft tokens accepted (%.1f%%), mean acceptance "
                 "length %.2f over %lld verify steps\n",
                 sc.method.c_str(), static_cast<long long>(stats.accepted),
                 static_cast<long long>(stats.draft_tokens),
                 stats.draft_tokens > 0 ? 100.0 * stats.accepted / stats.draft_tokens : 0.0,
                 stats.mean_acceptance_length(), static_cast<long long>(stats.steps));
}

}  // namespace

void set_gpu_probe(GpuProbe probe) {
  g_probe = probe;
}
std::vector<std::string> probe_gpus() {
  return g_probe ? g_probe() : std::vector<std::string>{};
}

void register_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOpts>();
  CLI::App* sub = app.add_subcommand("generate", "generate text (built-in tiny model by default)");
  sub->add_option("--model", o->model, "checkpoint directory (default: the built-in tiny model)");
  sub->add_option("--prompt", o->prompt, "prompt text (special-token strings allowed)")
      ->capture_default_str();
  sub->add_option("--prompt-ids", o->prompt_ids, "prompt as comma-separated token ids");
  sub->add_option("--max-tokens", o->max_tokens, "tokens to generate")->capture_default_str();
  sub->add_option("--temperature", o->temperature, "0: greedy")->capture_default_str();
  sub->add_option("--top-k", o->top_k, "0: off")->capture_default_str();
  sub->add_option("--top-p", o->top_p, "1: off")->capture_default_str();
  sub->add_option("--seed", o->seed, "sampling seed")->capture_default_str();
  sub->add_option("--device", o->device, "auto | cpu | cuda")->capture_default_str();
  sub->add_option("--decode-backend", o->decode_backend, "auto | latency_specialized")
      ->capture_default_str();
  sub->add_option("--kv-cache-dtype", o->kv_cache_dtype,
                  "auto | bfloat16 | fp8 | fp8_ds_mla | nvfp4_ds_mla")
      ->capture_default_str();
  sub->add_option("--mamba-cache-dtype", o->mamba_cache_dtype, "KDA conv state dtype")
      ->capture_default_str();
  sub->add_option("--mamba-ssm-cache-dtype", o->mamba_ssm_cache_dtype, "KDA recurrent state dtype")
      ->capture_default_str();
  sub->add_option("--max-model-len", o->max_model_len, "context limit (0: the model's)");
  sub->add_option("--speculative-config", o->speculative_config,
                  "JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": N, ...}");
  sub->add_flag("--ignore-eos", o->ignore_eos, "do not stop at the end-of-sequence token");
  sub->add_flag("--show-ids", o->show_ids, "print token ids instead of text");
  sub->add_flag("--fp32", o->fp32, "pure fp32 activations (no bf16 rounding at boundaries)");
  sub->add_option("--tp", o->layout.tp,
                  "tensor_parallel_size (ranks as threads, or processes under launch_ranks.sh)")
      ->capture_default_str();
  sub->add_option("--dp", o->layout.dp, "data_parallel_size")->capture_default_str();
  sub->add_flag("--ep", o->layout.ep, "enable_expert_parallel (experts over all ranks)");
  sub->add_option("--dcp", o->layout.dcp, "decode_context_parallel_size (1 or --tp)")
      ->capture_default_str();
  sub->callback([o] { run_generate(*o); });
}

}  // namespace k3::cli
