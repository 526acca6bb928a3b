// DeployConfig: parsing, validation, the latency-specialized decode shapes and every refusal.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "runtime/deploy_config.h"

namespace k3 {
namespace {

using json = nlohmann::json;

ModelConfig model(const std::string& name) {
  std::ifstream in(std::string(K3_SOURCE_DIR) + "/tests/data/configs/" + name);
  return parse_model_config(json::parse(in));
}
const ModelConfig& k3() {
  static const ModelConfig c = model("k3.json");
  return c;
}
const ModelConfig& k31() {
  static const ModelConfig c = model("k3_1.json");
  return c;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

DeployConfig specialized() {
  DeployConfig d;
  d.decode_backend = DecodeBackend::LatencySpecialized;
  return d;
}
DeployConfig with_spec(int tokens) {
  DeployConfig d = specialized();
  d.speculative_config.num_speculative_tokens = tokens;
  d.speculative_config.method = "ngram";
  return d;
}

const std::string kRefusal = "Kimi K3 specialized decode does not support ";

TEST(DeployConfigParse, AllKeysAndRoundTrip) {
  const json doc = {{"decode_backend", "latency_specialized"},
                    {"kv_cache_dtype", "fp8_ds_mla"},
                    {"mamba_cache_dtype", "float32"},
                    {"mamba_ssm_cache_dtype", "bfloat16"},
                    {"max_model_len", 131072},
                    {"tensor_parallel_size", 8},
                    {"data_parallel_size", 2},
                    {"enable_expert_parallel", true},
                    {"decode_context_parallel_size", 8},
                    {"speculative_config",
                     {{"num_speculative_tokens", 3},
                      {"method", "draft_model"},
                      {"model", "/ckpt/kimi-k3-dspark"},
                      {"prompt_lookup_min", 2},
                      {"prompt_lookup_max", 5}}},
                    {"cudagraph_capture_sizes", {4, 8, 16}},
                    {"max_num_seqs", 32}};
  const DeployConfig d = parse_deploy_config(doc);
  EXPECT_EQ(d.decode_backend, DecodeBackend::LatencySpecialized);
  EXPECT_EQ(d.kv_cache_dtype, KvCacheDtype::Fp8DsMla);
  EXPECT_EQ(d.mamba_cache_dtype, StateDtype::Float32);
  EXPECT_EQ(d.mamba_ssm_cache_dtype, StateDtype::BFloat16);
  EXPECT_EQ(d.max_model_len, 131072);
  EXPECT_EQ(d.tensor_parallel_size, 8);
  EXPECT_EQ(d.data_parallel_size, 2);
  EXPECT_TRUE(d.enable_expert_parallel);
  EXPECT_EQ(d.decode_context_parallel_size, 8);
  EXPECT_EQ(d.speculative_config.num_speculative_tokens, 3);
  EXPECT_EQ(d.speculative_config.method, "draft_model");
  EXPECT_EQ(d.speculative_config.model, "/ckpt/kimi-k3-dspark");
  EXPECT_EQ(d.speculative_config.prompt_lookup_min, 2);
  EXPECT_EQ(d.speculative_config.prompt_lookup_max, 5);
  EXPECT_EQ(d.cudagraph_capture_sizes, (std::vector<int>{4, 8, 16}));
  EXPECT_EQ(d.max_num_seqs, 32);
  EXPECT_EQ(parse_deploy_config(deploy_config_to_json(d)).cudagraph_capture_sizes,
            d.cudagraph_capture_sizes);
  EXPECT_EQ(deploy_config_to_json(parse_deploy_config(deploy_config_to_json(d))),
            deploy_config_to_json(d));

  const DeployConfig e = parse_deploy_config(json::object());
  EXPECT_EQ(e.decode_backend, DecodeBackend::Auto);
  EXPECT_EQ(e.kv_cache_dtype, KvCacheDtype::Auto);
  EXPECT_EQ(e.max_model_len, 0);
  EXPECT_EQ(e.max_num_seqs, 64);
  EXPECT_EQ(e.tensor_parallel_size, 1);
  EXPECT_EQ(e.data_parallel_size, 1);
  EXPECT_FALSE(e.enable_expert_parallel);
  EXPECT_TRUE(e.cudagraph_capture_sizes.empty());
  EXPECT_EQ(parse_deploy_config({{"speculative_config", nullptr}}).speculative_config.method, "");
}

TEST(DeployConfigParse, Errors) {
  auto err = [](const json& j) { return error_of([&] { parse_deploy_config(j); }); };
  EXPECT_EQ(err({{"decode_backend", "fast"}}),
            "Supported decode_backend values are auto/latency_specialized, got \"fast\"");
  EXPECT_EQ(err({{"foo", 1}}), "unknown deploy config key \"foo\"");
  EXPECT_EQ(err({{"speculative_config", {{"draft", 1}}}}),
            "unknown deploy config key \"speculative_config.draft\"");
  EXPECT_EQ(err({{"max_model_len", "1M"}}),
            "deploy config key \"max_model_len\" must be an integer, got string \"1M\"");
  EXPECT_EQ(err({{"decode_backend", 1}}),
            "deploy config key \"decode_backend\" must be a string, got number 1");
  EXPECT_EQ(
      err({{"cudagraph_capture_sizes", {1, "2"}}}),
      "deploy config key \"cudagraph_capture_sizes[1]\" must be an integer, got string \"2\"");
  EXPECT_EQ(
      err({{"cudagraph_capture_sizes", 8}}),
      "deploy config key \"cudagraph_capture_sizes\" must be a list of integers, got number 8");
  EXPECT_EQ(err({{"speculative_config", 5}}),
            "deploy config key \"speculative_config\" must be an object or null, got number 5");
  EXPECT_EQ(err({{"speculative_config", {{"num_speculative_tokens", 1.5}}}}),
            "deploy config key \"speculative_config.num_speculative_tokens\" must be an integer, "
            "got number 1.5");
  EXPECT_NE(err({{"mamba_ssm_cache_dtype", "fp8"}}).find("mamba_ssm_cache_dtype \"fp8\""),
            std::string::npos);
  EXPECT_EQ(err(json::array()), "deploy config must be a JSON object, got array");
  EXPECT_EQ(err({{"enable_expert_parallel", 1}}),
            "deploy config key \"enable_expert_parallel\" must be a boolean, got number 1");
}

TEST(DeployConfigParse, Spellings) {
  EXPECT_EQ(parse_decode_backend("auto"), DecodeBackend::Auto);
  EXPECT_EQ(parse_decode_backend("latency_specialized"), DecodeBackend::LatencySpecialized);
  EXPECT_EQ(error_of([] {
              parse_decode_backend("specialized");
            }).rfind("Supported decode_backend values are auto/latency_specialized", 0),
            0u);
  EXPECT_EQ(parse_kv_cache_dtype("auto"), KvCacheDtype::Auto);
  EXPECT_EQ(parse_kv_cache_dtype("bfloat16"), KvCacheDtype::BFloat16);
  EXPECT_EQ(parse_kv_cache_dtype("bf16"), KvCacheDtype::BFloat16);
  EXPECT_EQ(parse_kv_cache_dtype("fp8"), KvCacheDtype::Fp8);
  EXPECT_EQ(parse_kv_cache_dtype("fp8_e4m3"), KvCacheDtype::Fp8);
  EXPECT_EQ(parse_kv_cache_dtype("fp8_ds_mla"), KvCacheDtype::Fp8DsMla);
  EXPECT_EQ(parse_kv_cache_dtype("nvfp4_ds_mla"), KvCacheDtype::Nvfp4DsMla);
  EXPECT_EQ(error_of([] { parse_kv_cache_dtype("fp8_e5m2"); }),
            "kv_cache_dtype \"fp8_e5m2\" is not supported (supported: auto, bfloat16/bf16, "
            "fp8/fp8_e4m3, fp8_ds_mla, nvfp4_ds_mla)");
  EXPECT_EQ(parse_state_dtype("mamba_cache_dtype", "float16"), StateDtype::Float16);
  EXPECT_EQ(error_of([] { parse_state_dtype("mamba_cache_dtype", "fp32"); }),
            "mamba_cache_dtype \"fp32\" is not supported (supported: auto, float32, bfloat16, "
            "float16)");
  for (auto t : {KvCacheDtype::Auto, KvCacheDtype::BFloat16, KvCacheDtype::Fp8,
                 KvCacheDtype::Fp8DsMla, KvCacheDtype::Nvfp4DsMla})
    EXPECT_EQ(parse_kv_cache_dtype(name(t)), t);
  for (auto t : {StateDtype::Auto, StateDtype::Float32, StateDtype::BFloat16, StateDtype::Float16})
    EXPECT_EQ(parse_state_dtype("x", name(t)), t);
  EXPECT_EQ(name(DecodeBackend::LatencySpecialized), "latency_specialized");
  EXPECT_EQ(name(SparseMlaKernels::None), "none");
  EXPECT_EQ(name(SparseMlaKernels::Fp8DsMla), "fp8_ds_mla");
  EXPECT_EQ(name(SparseMlaKernels::Nvfp4DsMla), "nvfp4_ds_mla");
}

TEST(DeployConfigValidate, GeneralErrorsApplyToAuto) {
  auto err = [](auto mutate) {
    DeployConfig d;  // decode_backend auto
    mutate(d);
    return error_of([&] { specialized_decode_config(k3(), d); });
  };
  EXPECT_EQ(err([](DeployConfig&) {}), "");
  EXPECT_EQ(err([](DeployConfig& d) { d.max_model_len = 2 << 20; }),
            "max_model_len 2097152 exceeds the model's max_position_embeddings 1048576");
  EXPECT_EQ(err([](DeployConfig& d) { d.max_model_len = -1; }),
            "max_model_len must be >= 0 (0: the model's), got -1");
  EXPECT_EQ(err([](DeployConfig& d) { d.decode_context_parallel_size = 0; }),
            "decode_context_parallel_size must be >= 1, got 0");
  EXPECT_EQ(err([](DeployConfig& d) { d.tensor_parallel_size = 0; }),
            "tensor_parallel_size must be >= 1, got 0");
  EXPECT_EQ(err([](DeployConfig& d) { d.data_parallel_size = -2; }),
            "data_parallel_size must be >= 1, got -2");
  EXPECT_EQ(err([](DeployConfig& d) { d.max_num_seqs = 0; }), "max_num_seqs must be >= 1, got 0");
  EXPECT_EQ(err([](DeployConfig& d) {
              d.cudagraph_capture_sizes = {4, 0};
            }),
            "cudagraph_capture_sizes entries must be positive, got 0");
  EXPECT_EQ(err([](DeployConfig& d) { d.speculative_config.num_speculative_tokens = -1; }),
            "speculative_config.num_speculative_tokens must be >= 0, got -1");
  EXPECT_EQ(err([](DeployConfig& d) {
              d.speculative_config = {2, "eagle", "", 1, 4};
            }),
            "speculative_config.method \"eagle\" is not supported (supported: ngram, draft_model)");
  EXPECT_EQ(err([](DeployConfig& d) { d.speculative_config.num_speculative_tokens = 2; }),
            "speculative_config.method is required when num_speculative_tokens = 2 (ngram or "
            "draft_model)");
  EXPECT_EQ(err([](DeployConfig& d) { d.speculative_config.method = "ngram"; }),
            "speculative_config.method \"ngram\" needs num_speculative_tokens >= 1");
  EXPECT_EQ(err([](DeployConfig& d) {
              d.speculative_config = {2, "draft_model", "", 1, 4};
            }),
            "speculative_config.model (the draft checkpoint path) is required for method "
            "draft_model");
  EXPECT_EQ(err([](DeployConfig& d) {
              d.speculative_config = {2, "ngram", "", 5, 4};
            }),
            "speculative_config.prompt_lookup_min/prompt_lookup_max must satisfy 1 <= min <= max, "
            "got 5/4");
  // Backend-specific refusals do not apply to auto.
  EXPECT_EQ(err([](DeployConfig& d) { d.mamba_ssm_cache_dtype = StateDtype::Float16; }), "");
  EXPECT_EQ(err([](DeployConfig& d) { d.decode_context_parallel_size = 3; }), "");
  EXPECT_FALSE(specialized_decode_config(k31(), DeployConfig{}).has_value());
}

TEST(DeployConfigSpecialized, DefaultsQ1) {
  const auto dc = specialized_decode_config(k3(), specialized());
  ASSERT_TRUE(dc.has_value());
  EXPECT_EQ(dc->max_context, 1048576);
  EXPECT_EQ(dc->dcp, 1);
  EXPECT_EQ(dc->q, 1);
  EXPECT_EQ(dc->capture_sizes, (std::vector<int>{1, 2, 4, 8, 16, 32, 64}));
  EXPECT_EQ(dc->prims_ts_rows, (std::vector<int>{1, 2, 4, 8, 16, 32, 64}));
  EXPECT_EQ(dc->fi_kernels, SparseMlaKernels::None);
  EXPECT_FALSE(dc->dsa);

  DeployConfig d = specialized();
  d.max_model_len = 131072;
  d.max_num_seqs = 48;
  d.decode_context_parallel_size = 8;
  const auto capped = specialized_decode_config(k3(), d);
  EXPECT_EQ(capped->max_context, 131072);
  EXPECT_EQ(capped->dcp, 8);
  EXPECT_EQ(capped->capture_sizes, (std::vector<int>{1, 2, 4, 8, 16, 32, 48}));
  EXPECT_EQ(capped->prims_ts_rows, (std::vector<int>{1, 2, 4, 8, 16, 32, 48, 64}));
}

TEST(DeployConfigSpecialized, SpeculativeQ4) {
  const auto dc = specialized_decode_config(k3(), with_spec(3));
  EXPECT_EQ(dc->q, 4);
  EXPECT_EQ(dc->capture_sizes, (std::vector<int>{4, 8, 16, 32, 64, 128, 256}));
  EXPECT_EQ(dc->prims_ts_rows, (std::vector<int>{1, 2, 4, 8, 16, 32, 64, 128, 256}));

  DeployConfig d = with_spec(3);
  d.cudagraph_capture_sizes = {12, 4, 8, 4, 20};
  const auto ex = specialized_decode_config(k3(), d);
  EXPECT_EQ(ex->capture_sizes, (std::vector<int>{4, 8, 12, 20}));
  EXPECT_EQ(ex->prims_ts_rows, (std::vector<int>{1, 2, 4, 8, 12, 16, 20, 32}));
  EXPECT_EQ(specialized_decode_config(k3(), with_spec(15))->q, 16);
}

TEST(DeployConfigSpecialized, Refusals) {
  auto err = [](const ModelConfig& m, DeployConfig d) {
    return error_of([&] { specialized_decode_config(m, d); });
  };
  EXPECT_EQ(err(k3(), with_spec(16)),
            kRefusal + "q = 1 + num_speculative_tokens = 17 rows per request (at most 16)");
  DeployConfig d = with_spec(3);
  d.cudagraph_capture_sizes = {4, 6};
  EXPECT_EQ(err(k3(), d),
            kRefusal + "cudagraph_capture_sizes entry 6 that is not a multiple of q = 4");
  d.cudagraph_capture_sizes = {8, 260};
  EXPECT_EQ(err(k3(), d),
            kRefusal + "cudagraph_capture_sizes entry 260 above max_num_seqs x q = 64 x 4 = 256");
  d = specialized();
  d.mamba_ssm_cache_dtype = StateDtype::Float16;
  EXPECT_EQ(err(k3(), d), kRefusal + "float16 KDA recurrent state (use float32 or bfloat16)");
  d = specialized();
  d.decode_context_parallel_size = 3;
  EXPECT_EQ(err(k3(), d), kRefusal + "decode_context_parallel_size = 3 (a power of two up to 64)");
  d.decode_context_parallel_size = 128;
  EXPECT_EQ(err(k3(), d),
            kRefusal + "decode_context_parallel_size = 128 (a power of two up to 64)");
  ModelConfig no_mla = model("kimi_linear_48b.json");
  auto& la = no_mla.linear_attn_config;
  la.kda_layers.insert(la.kda_layers.end(), la.full_attn_layers.begin(), la.full_attn_layers.end());
  la.full_attn_layers.clear();
  d.decode_context_parallel_size = 2;
  EXPECT_EQ(err(no_mla, d), kRefusal +
                                "decode_context_parallel_size = 2 on a model without MLA "
                                "layers (only the MLA cache is split)");
}

TEST(DeployConfigDsa, UnsupportedReasons) {
  auto refusal = [](auto mutate_model, KvCacheDtype kv = KvCacheDtype::Auto) {
    ModelConfig m = k31();
    mutate_model(m.dsa_config);
    DeployConfig d = specialized();
    d.kv_cache_dtype = kv;
    const auto reason = dsa_unsupported(m, d);
    const std::string full = error_of([&] { specialized_decode_config(m, d); });
    EXPECT_EQ(full, kRefusal + reason.value_or("<none>"));
    return reason.value_or("");
  };
  EXPECT_EQ(refusal([](DsaConfig& x) { x.index_rope_dim = 64; }),
            "a DSA indexer with RoPE (index_rope_dim = 64)");
  EXPECT_EQ(refusal([](DsaConfig& x) { x.index_k_norm_type = "rms"; }),
            "indexer keys not LayerNorm-normed (index_k_norm_type = rms)");
  EXPECT_EQ(refusal([](DsaConfig& x) { x.index_head_dim = 64; }),
            "index_head_dim = 64 (the sparse kernels are built for index_head_dim 128)");
  EXPECT_EQ(refusal([](DsaConfig& x) { x.index_topk = 2000; }),
            "index_topk = 2000 (the sparse kernels need index_topk a multiple of 64)");
  EXPECT_EQ(refusal([](DsaConfig&) {}, KvCacheDtype::Fp8),
            "kv_cache_dtype fp8 (per-tensor scale) with the DSA indexer; the sparse MLA kernels "
            "read bfloat16, fp8_ds_mla or nvfp4_ds_mla caches");

  DeployConfig fp8 = specialized();
  fp8.kv_cache_dtype = KvCacheDtype::Fp8;
  EXPECT_FALSE(dsa_unsupported(k3(), fp8).has_value());  // no DSA: nothing to refuse
  EXPECT_FALSE(dsa_unsupported(k31(), specialized()).has_value());
  EXPECT_TRUE(specialized_decode_config(k3(), fp8).has_value());  // dense MLA reads fp8

  EXPECT_EQ(dsa_weight_unsupported(DType::F8_E4M3),
            "an FP8 DSA indexer query weight (indexer.wq_b is F8_E4M3; the indexer needs it in "
            "bfloat16)");
  EXPECT_EQ(dsa_weight_unsupported(DType::F8_E5M2),
            "an FP8 DSA indexer query weight (indexer.wq_b is F8_E5M2; the indexer needs it in "
            "bfloat16)");
  EXPECT_FALSE(dsa_weight_unsupported(DType::BF16).has_value());
  EXPECT_EQ(specialized_decode_refusal(*dsa_weight_unsupported(DType::F8_E4M3)).rfind(kRefusal, 0),
            0u);
}

TEST(DeployConfigDsa, SparseKernelsFollowTheCache) {
  auto kernels = [](const ModelConfig& m, KvCacheDtype kv) {
    DeployConfig d = specialized();
    d.kv_cache_dtype = kv;
    const auto dc = specialized_decode_config(m, d);
    EXPECT_EQ(dc->dsa, m.has_dsa());
    return dc->fi_kernels;
  };
  EXPECT_EQ(kernels(k31(), KvCacheDtype::Fp8DsMla), SparseMlaKernels::Fp8DsMla);
  EXPECT_EQ(kernels(k31(), KvCacheDtype::Nvfp4DsMla), SparseMlaKernels::Nvfp4DsMla);
  EXPECT_EQ(kernels(k31(), KvCacheDtype::BFloat16), SparseMlaKernels::None);
  EXPECT_EQ(kernels(k31(), KvCacheDtype::Auto), SparseMlaKernels::None);
  // Dense MLA reads the DeepSeek layouts with its own kernels.
  EXPECT_EQ(kernels(k3(), KvCacheDtype::Fp8DsMla), SparseMlaKernels::None);
  EXPECT_EQ(kernels(k3(), KvCacheDtype::Nvfp4DsMla), SparseMlaKernels::None);
  EXPECT_EQ(kernels(k3(), KvCacheDtype::Fp8), SparseMlaKernels::None);
}

TEST(DeployConfigKda, StateDtypesAllCombinations) {
  const StateDtype all[] = {StateDtype::Auto, StateDtype::Float32, StateDtype::BFloat16,
                            StateDtype::Float16};
  auto expect = [](StateDtype t, DType fallback) {
    switch (t) {
      case StateDtype::Float32:
        return DType::F32;
      case StateDtype::BFloat16:
        return DType::BF16;
      case StateDtype::Float16:
        return DType::F16;
      default:
        return fallback;
    }
  };
  for (DType model_dtype : {DType::BF16, DType::F16, DType::F32}) {
    ModelConfig m = k3();
    m.dtype = model_dtype;
    for (StateDtype conv : all)
      for (StateDtype rec : all) {
        DeployConfig d;
        d.mamba_cache_dtype = conv;
        d.mamba_ssm_cache_dtype = rec;
        const KdaDtypes k = kda_dtypes(m, d);
        EXPECT_EQ(k.conv, expect(conv, model_dtype)) << name(conv);
        EXPECT_EQ(k.recurrent, expect(rec, DType::F32)) << name(rec);
      }
  }
  const KdaDtypes def = kda_dtypes(k3(), DeployConfig{});
  EXPECT_EQ(def.conv, DType::BF16);
  EXPECT_EQ(def.recurrent, DType::F32);
}

}  // namespace
}  // namespace k3
