// Deployment configuration: how a model is served (decode backend, cache formats, context length,
// context parallelism, speculative decoding, CUDA-graph capture sizes), as opposed to what the
// model is (ModelConfig). The engine's counterpart of vLLM's Kimi K3 `specialized_decode`
// runtime: `latency_specialized` selects the fixed-shape decode path, and
// specialized_decode_config() either derives its parameters or refuses with a reason.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/dtype.h"
#include "model/config.h"

namespace k3 {

enum class DecodeBackend { Auto, LatencySpecialized };
// MLA latent cache format. Fp8: e4m3 with one per-tensor scale. Fp8DsMla / Nvfp4DsMla: the
// DeepSeek-MLA paged layouts with per-block scales and a bf16 rope part (FlashMLA / FlashInfer).
enum class KvCacheDtype { Auto, BFloat16, Fp8, Fp8DsMla, Nvfp4DsMla };
enum class StateDtype { Auto, Float32, BFloat16, Float16 };
// The sparse-MLA kernel set a DSA model decodes with ("fi_kernels"): chosen by the cache format.
enum class SparseMlaKernels { None, Fp8DsMla, Nvfp4DsMla };

struct SpeculativeConfig {
  int num_speculative_tokens = 0;
  std::string method;         // "" (none), "ngram", "draft_model"
  std::string model;          // draft checkpoint path (draft_model)
  int prompt_lookup_min = 1;  // ngram window
  int prompt_lookup_max = 4;
};

struct DeployConfig {
  DecodeBackend decode_backend = DecodeBackend::Auto;
  KvCacheDtype kv_cache_dtype = KvCacheDtype::Auto;
  StateDtype mamba_cache_dtype = StateDtype::Auto;      // KDA conv state
  StateDtype mamba_ssm_cache_dtype = StateDtype::Auto;  // KDA recurrent state
  int64_t max_model_len = 0;                            // 0: the model's max_position_embeddings
  // The multi-rank layout (vLLM's engine arguments; parallel/layout.h): world = tp x dp ranks.
  int tensor_parallel_size = 1;
  int data_parallel_size = 1;
  bool enable_expert_parallel = false;
  int decode_context_parallel_size = 1;
  SpeculativeConfig speculative_config;
  std::vector<int> cudagraph_capture_sizes;  // rows (requests x q); empty: defaults
  int max_num_seqs = 64;
};

// Parsers for the string options. Errors list the supported spellings.
// decode_backend: "Supported decode_backend values are auto/latency_specialized, got \"x\"".
DecodeBackend parse_decode_backend(std::string_view s);
// auto, bfloat16 (bf16), fp8 (fp8_e4m3), fp8_ds_mla, nvfp4_ds_mla.
KvCacheDtype parse_kv_cache_dtype(std::string_view s);
// auto, float32, bfloat16, float16; `field` names the option in the error.
StateDtype parse_state_dtype(std::string_view field, std::string_view s);

std::string_view name(DecodeBackend b);
std::string_view name(KvCacheDtype t);
std::string_view name(StateDtype t);
std::string_view name(SparseMlaKernels k);

// Keys: decode_backend, kv_cache_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype, max_model_len,
// tensor_parallel_size, data_parallel_size, enable_expert_parallel,
// decode_context_parallel_size, speculative_config {num_speculative_tokens, method, model,
// prompt_lookup_min, prompt_lookup_max} (or null), cudagraph_capture_sizes, max_num_seqs.
// Unknown keys and wrong types raise k3::Error naming the key.
DeployConfig parse_deploy_config(const nlohmann::json& doc);
nlohmann::json deploy_config_to_json(const DeployConfig& d);

// Checks that hold for every backend (auto included), naming the field: max_model_len within
// the model's max_position_embeddings, tp / dp / dcp >= 1, max_num_seqs >= 1, speculative settings
// coherent (known method, tokens <-> method, draft model path, ngram window), capture sizes > 0.
void validate_deploy_config(const ModelConfig& model, const DeployConfig& d);

// Parameters of the latency-specialized decode path.
struct DecodeConfig {
  int64_t max_context = 0;         // tokens per request the caches are sized for
  int dcp = 1;                     // decode context parallel ranks
  int q = 1;                       // query rows per request: 1 + num_speculative_tokens
  std::vector<int> capture_sizes;  // CUDA-graph batch rows, ascending
  SparseMlaKernels fi_kernels = SparseMlaKernels::None;
  std::vector<int> prims_ts_rows;  // row capacities of the primitive workspaces, ascending
  bool dsa = false;                // the model has the DSA indexer
};

// nullopt for decode_backend auto (after validate_deploy_config). Otherwise the DecodeConfig, or
// k3::Error "Kimi K3 specialized decode does not support <reason>".
std::optional<DecodeConfig> specialized_decode_config(const ModelConfig& model,
                                                      const DeployConfig& d);
// The full refusal message for a reason (also for refusals raised later, e.g. at layer build).
std::string specialized_decode_refusal(std::string_view reason);

// Why the DSA sparse path cannot run this model / deployment; nullopt when it can (or the model
// has no DSA). Reasons: indexer RoPE, a key norm other than LayerNorm, kernel shapes, the cache.
std::optional<std::string> dsa_unsupported(const ModelConfig& model, const DeployConfig& d);
// Called when a DSA layer is built from the checkpoint, with the indexer wq_b dtype.
std::optional<std::string> dsa_weight_unsupported(DType indexer_wq_b_dtype);

// KDA state dtypes. conv: auto -> the model dtype; recurrent: auto -> F32. Explicit values kept.
struct KdaDtypes {
  DType conv;
  DType recurrent;
};
KdaDtypes kda_dtypes(const ModelConfig& model, const DeployConfig& d);

}  // namespace k3
