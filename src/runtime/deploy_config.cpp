// Deployment options: string spellings, JSON parsing, backend-independent validation, and the KDA
// state dtypes. The latency-specialized rules are in specialized_decode.cpp.
#include "runtime/deploy_config.h"

#include <array>
#include <set>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace k3 {
namespace {

using json = nlohmann::json;

template <typename E>
struct Spelling {
  std::string_view name;
  E value;
};

// The first spelling of each value is its canonical name; later ones are accepted aliases
// (vLLM's bf16 / fp8_e4m3).
constexpr std::array<Spelling<KvCacheDtype>, 7> kKvNames = {{
    {"auto", KvCacheDtype::Auto},
    {"bfloat16", KvCacheDtype::BFloat16},
    {"fp8", KvCacheDtype::Fp8},
    {"fp8_ds_mla", KvCacheDtype::Fp8DsMla},
    {"nvfp4_ds_mla", KvCacheDtype::Nvfp4DsMla},
    {"bf16", KvCacheDtype::BFloat16},
    {"fp8_e4m3", KvCacheDtype::Fp8},
}};
constexpr std::array<Spelling<StateDtype>, 4> kStateNames = {{
    {"auto", StateDtype::Auto},
    {"float32", StateDtype::Float32},
    {"bfloat16", StateDtype::BFloat16},
    {"float16", StateDtype::Float16},
}};

template <typename E, size_t N>
std::string_view canonical(const std::array<Spelling<E>, N>& names, E v) {
  for (const auto& s : names)
    if (s.value == v) return s.name;
  fail("internal: unnamed enum value ", static_cast<int>(v));
}

std::string shown(const json& v) {
  const std::string s = v.dump();
  return s.size() > 48 ? s.substr(0, 45) + "..." : s;
}

[[noreturn]] void type_error(const std::string& key, const char* expected, const json& v) {
  fail("deploy config key \"", key, "\" must be ", expected, ", got ", v.type_name(), " ",
       shown(v));
}

int64_t as_int(const json& v, const std::string& key) {
  if (!v.is_number_integer()) type_error(key, "an integer", v);
  const int64_t x = v.get<int64_t>();
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
    fail("deploy config key \"", key, "\" is out of range: ", shown(v));
  return x;
}
int as_int32(const json& v, const std::string& key) {
  const int64_t x = as_int(v, key);
  if (x < INT32_MIN || x > INT32_MAX) fail("deploy config key \"", key, "\" is out of range: ", x);
  return static_cast<int>(x);
}
std::string as_string(const json& v, const std::string& key) {
  if (!v.is_string()) type_error(key, "a string", v);
  return v.get<std::string>();
}

// Every key of `obj` must be in `known`; names the first one that is not.
void check_keys(const json& obj, const std::string& prefix,
                std::initializer_list<const char*> known) {
  const std::set<std::string> k(known.begin(), known.end());
  for (const auto& [key, v] : obj.items())
    if (!k.count(key)) fail("unknown deploy config key \"", prefix, key, "\"");
}

SpeculativeConfig parse_speculative(const json& j) {
  const std::string p = "speculative_config.";
  if (!j.is_object()) type_error("speculative_config", "an object or null", j);
  check_keys(
      j, p,
      {"num_speculative_tokens", "method", "model", "prompt_lookup_min", "prompt_lookup_max"});
  SpeculativeConfig s;
  for (const auto& [key, v] : j.items()) {
    const std::string path = p + key;
    if (key == "num_speculative_tokens") s.num_speculative_tokens = as_int32(v, path);
    if (key == "method") s.method = v.is_null() ? "" : as_string(v, path);
    if (key == "model") s.model = v.is_null() ? "" : as_string(v, path);
    if (key == "prompt_lookup_min") s.prompt_lookup_min = as_int32(v, path);
    if (key == "prompt_lookup_max") s.prompt_lookup_max = as_int32(v, path);
  }
  return s;
}

}  // namespace

DecodeBackend parse_decode_backend(std::string_view s) {
  if (s == "auto") return DecodeBackend::Auto;
  if (s == "latency_specialized") return DecodeBackend::LatencySpecialized;
  fail("Supported decode_backend values are auto/latency_specialized, got \"", s, "\"");
}

KvCacheDtype parse_kv_cache_dtype(std::string_view s) {
  for (const auto& n : kKvNames)
    if (n.name == s) return n.value;
  fail("kv_cache_dtype \"", s,
       "\" is not supported (supported: auto, bfloat16/bf16, fp8/fp8_e4m3, fp8_ds_mla, "
       "nvfp4_ds_mla)");
}

StateDtype parse_state_dtype(std::string_view field, std::string_view s) {
  for (const auto& n : kStateNames)
    if (n.name == s) return n.value;
  fail(field, " \"", s, "\" is not supported (supported: auto, float32, bfloat16, float16)");
}

std::string_view name(DecodeBackend b) {
  return b == DecodeBackend::Auto ? "auto" : "latency_specialized";
}
std::string_view name(KvCacheDtype t) {
  return canonical(kKvNames, t);
}
std::string_view name(StateDtype t) {
  return canonical(kStateNames, t);
}
std::string_view name(SparseMlaKernels k) {
  switch (k) {
    case SparseMlaKernels::None:
      return "none";
    case SparseMlaKernels::Fp8DsMla:
      return "fp8_ds_mla";
    case SparseMlaKernels::Nvfp4DsMla:
      return "nvfp4_ds_mla";
  }
  fail("internal: unnamed SparseMlaKernels value ", static_cast<int>(k));
}

DeployConfig parse_deploy_config(const json& doc) {
  if (!doc.is_object()) fail("deploy config must be a JSON object, got ", doc.type_name());
  check_keys(doc, "",
             {"decode_backend", "kv_cache_dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
              "max_model_len", "tensor_parallel_size", "data_parallel_size",
              "enable_expert_parallel", "decode_context_parallel_size", "speculative_config",
              "cudagraph_capture_sizes", "max_num_seqs"});
  DeployConfig d;
  for (const auto& [key, v] : doc.items()) {
    if (key == "decode_backend") d.decode_backend = parse_decode_backend(as_string(v, key));
    if (key == "kv_cache_dtype") d.kv_cache_dtype = parse_kv_cache_dtype(as_string(v, key));
    if (key == "mamba_cache_dtype") d.mamba_cache_dtype = parse_state_dtype(key, as_string(v, key));
    if (key == "mamba_ssm_cache_dtype")
      d.mamba_ssm_cache_dtype = parse_state_dtype(key, as_string(v, key));
    if (key == "max_model_len") d.max_model_len = as_int(v, key);
    if (key == "tensor_parallel_size") d.tensor_parallel_size = as_int32(v, key);
    if (key == "data_parallel_size") d.data_parallel_size = as_int32(v, key);
    if (key == "enable_expert_parallel") {
      if (!v.is_boolean()) type_error(key, "a boolean", v);
      d.enable_expert_parallel = v.get<bool>();
    }
    if (key == "decode_context_parallel_size") d.decode_context_parallel_size = as_int32(v, key);
    if (key == "max_num_seqs") d.max_num_seqs = as_int32(v, key);
    if (key == "speculative_config" && !v.is_null()) d.speculative_config = parse_speculative(v);
    if (key == "cudagraph_capture_sizes") {
      if (!v.is_array()) type_error(key, "a list of integers", v);
      for (size_t i = 0; i < v.size(); ++i)
        d.cudagraph_capture_sizes.push_back(as_int32(v[i], key + "[" + std::to_string(i) + "]"));
    }
  }
  return d;
}

json deploy_config_to_json(const DeployConfig& d) {
  const auto& s = d.speculative_config;
  return {{"decode_backend", name(d.decode_backend)},
          {"kv_cache_dtype", name(d.kv_cache_dtype)},
          {"mamba_cache_dtype", name(d.mamba_cache_dtype)},
          {"mamba_ssm_cache_dtype", name(d.mamba_ssm_cache_dtype)},
          {"max_model_len", d.max_model_len},
          {"tensor_parallel_size", d.tensor_parallel_size},
          {"data_parallel_size", d.data_parallel_size},
          {"enable_expert_parallel", d.enable_expert_parallel},
          {"decode_context_parallel_size", d.decode_context_parallel_size},
          {"speculative_config",
           {{"num_speculative_tokens", s.num_speculative_tokens},
            {"method", s.method},
            {"model", s.model},
            {"prompt_lookup_min", s.prompt_lookup_min},
            {"prompt_lookup_max", s.prompt_lookup_max}}},
          {"cudagraph_capture_sizes", d.cudagraph_capture_sizes},
          {"max_num_seqs", d.max_num_seqs}};
}

void validate_deploy_config(const ModelConfig& m, const DeployConfig& d) {
  if (d.max_model_len < 0)
    fail("max_model_len must be >= 0 (0: the model's), got ", d.max_model_len);
  if (d.max_model_len > m.max_position_embeddings)
    fail("max_model_len ", d.max_model_len, " exceeds the model's max_position_embeddings ",
         m.max_position_embeddings);
  if (d.tensor_parallel_size < 1)
    fail("tensor_parallel_size must be >= 1, got ", d.tensor_parallel_size);
  if (d.data_parallel_size < 1) fail("data_parallel_size must be >= 1, got ", d.data_parallel_size);
  if (d.decode_context_parallel_size < 1)
    fail("decode_context_parallel_size must be >= 1, got ", d.decode_context_parallel_size);
  if (d.max_num_seqs < 1) fail("max_num_seqs must be >= 1, got ", d.max_num_seqs);
  for (int s : d.cudagraph_capture_sizes)
    if (s < 1) fail("cudagraph_capture_sizes entries must be positive, got ", s);

  const auto& s = d.speculative_config;
  if (s.num_speculative_tokens < 0)
    fail("speculative_config.num_speculative_tokens must be >= 0, got ", s.num_speculative_tokens);
  if (!s.method.empty() && s.method != "ngram" && s.method != "draft_model")
    fail("speculative_config.method \"", s.method,
         "\" is not supported (supported: ngram, draft_model)");
  if (s.num_speculative_tokens > 0 && s.method.empty())
    fail("speculative_config.method is required when num_speculative_tokens = ",
         s.num_speculative_tokens, " (ngram or draft_model)");
  if (!s.method.empty() && s.num_speculative_tokens == 0)
    fail("speculative_config.method \"", s.method, "\" needs num_speculative_tokens >= 1");
  if (s.method == "draft_model" && s.model.empty())
    fail(
        "speculative_config.model (the draft checkpoint path) is required for method "
        "draft_model");
  if (s.method == "ngram" && (s.prompt_lookup_min < 1 || s.prompt_lookup_min > s.prompt_lookup_max))
    fail(
        "speculative_config.prompt_lookup_min/prompt_lookup_max must satisfy 1 <= min <= max, got ",
        s.prompt_lookup_min, "/", s.prompt_lookup_max);
}

KdaDtypes kda_dtypes(const ModelConfig& m, const DeployConfig& d) {
  auto explicit_dtype = [](StateDtype t, DType fallback) {
    switch (t) {
      case StateDtype::Auto:
        return fallback;
      case StateDtype::Float32:
        return DType::F32;
      case StateDtype::BFloat16:
        return DType::BF16;
      case StateDtype::Float16:
        return DType::F16;
    }
    return fallback;
  };
  // The conv state holds pre-conv projection outputs (model dtype); the recurrent delta-rule
  // state accumulates over the whole context, so it defaults to fp32 as in the FLA reference.
  return {explicit_dtype(d.mamba_cache_dtype, m.dtype),
          explicit_dtype(d.mamba_ssm_cache_dtype, DType::F32)};
}

}  // namespace k3
