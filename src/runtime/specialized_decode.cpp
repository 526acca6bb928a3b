// The latency-specialized decode path: which deployments it runs, and its fixed shapes.
// Everything here is decided once at startup, so a refusal is an error with a reason rather than
// a silent fallback: the operator asked for the specialized path and should learn why not.
#include <algorithm>
#include <string>

#include "core/error.h"
#include "runtime/deploy_config.h"

namespace k3 {
namespace {

// The largest q the decode kernels tile for: one request's q rows fit one 16-row MMA tile.
constexpr int kMaxQ = 16;
// Largest decode-context-parallel group: the split-KV combine reduces at most 64 partials.
constexpr int kMaxDcp = 64;
// Requests per CUDA graph in the default capture list (times q rows each).
constexpr int kDefaultRequests[] = {1, 2, 4, 8, 16, 32, 64};

template <typename... Parts>
[[noreturn]] void refuse(Parts&&... parts) {
  throw Error(specialized_decode_refusal(detail::concat(std::forward<Parts>(parts)...)));
}

bool is_pow2(int x) {
  return x > 0 && (x & (x - 1)) == 0;
}

// Rows = requests x q, so a graph's batch must hold whole requests, and never more requests than
// the scheduler runs (max_num_seqs). Empty: q x {1..64 powers of two}, capped at max_num_seqs.
std::vector<int> capture_sizes(const DeployConfig& d, int q) {
  const int64_t cap = int64_t(d.max_num_seqs) * q;
  std::vector<int> out;
  if (d.cudagraph_capture_sizes.empty()) {
    for (int r : kDefaultRequests) out.push_back(std::min(r, d.max_num_seqs) * q);
  } else {
    for (int s : d.cudagraph_capture_sizes) {
      if (s % q != 0)
        refuse("cudagraph_capture_sizes entry ", s, " that is not a multiple of q = ", q);
      if (s > cap)
        refuse("cudagraph_capture_sizes entry ", s, " above max_num_seqs x q = ", d.max_num_seqs,
               " x ", q, " = ", cap);
      out.push_back(s);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// Workspace row capacities: every captured size exactly, plus the powers of two up to (and one
// at or past) the widest, so an uncaptured eager call of any width up to it has a bucket.
std::vector<int> prims_ts_rows(const std::vector<int>& sizes) {
  std::vector<int> out = sizes;
  const int widest = sizes.empty() ? 1 : sizes.back();
  for (int p = 1;; p *= 2) {
    out.push_back(p);
    if (p >= widest) break;
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

std::string specialized_decode_refusal(std::string_view reason) {
  return "Kimi K3 specialized decode does not support " + std::string(reason);
}

std::optional<std::string> dsa_unsupported(const ModelConfig& m, const DeployConfig& d) {
  if (!m.has_dsa()) return std::nullopt;
  const auto& x = m.dsa_config;
  // The indexer kernels score unrotated keys (K3.1 is NoPE like its MLA).
  if (x.index_rope_dim > 0)
    return detail::concat("a DSA indexer with RoPE (index_rope_dim = ", x.index_rope_dim, ")");
  // The fused key path applies LayerNorm (weight and bias) before the FP8 key cache write.
  if (x.index_k_norm_type != "layernorm")
    return detail::concat(
        "indexer keys not LayerNorm-normed (index_k_norm_type = ", x.index_k_norm_type, ")");
  if (x.index_head_dim != 128)
    return detail::concat("index_head_dim = ", x.index_head_dim,
                          " (the sparse kernels are built for index_head_dim 128)");
  // The sparse MLA gathers the selected entries in 64-row tiles.
  if (x.index_topk % 64 != 0)
    return detail::concat("index_topk = ", x.index_topk,
                          " (the sparse kernels need index_topk a multiple of 64)");
  if (d.kv_cache_dtype == KvCacheDtype::Fp8)
    return std::string(
        "kv_cache_dtype fp8 (per-tensor scale) with the DSA indexer; the sparse MLA kernels read "
        "bfloat16, fp8_ds_mla or nvfp4_ds_mla caches");
  return std::nullopt;
}

std::optional<std::string> dsa_weight_unsupported(DType wq_b) {
  // The indexer q projection runs as a bf16 GEMM on the q latent before its own FP8 quantization;
  // an FP8 checkpoint weight would need a block-scaled GEMM this path does not have.
  if (wq_b == DType::F8_E4M3 || wq_b == DType::F8_E5M2)
    return detail::concat("an FP8 DSA indexer query weight (indexer.wq_b is ", dtype_name(wq_b),
                          "; the indexer needs it in bfloat16)");
  return std::nullopt;
}

std::optional<DecodeConfig> specialized_decode_config(const ModelConfig& m, const DeployConfig& d) {
  validate_deploy_config(m, d);
  if (d.decode_backend == DecodeBackend::Auto) return std::nullopt;

  DecodeConfig out;
  out.max_context = d.max_model_len > 0 ? d.max_model_len : m.max_position_embeddings;

  // Speculative rows are verified in the same launch as the base token.
  out.q = 1 + d.speculative_config.num_speculative_tokens;
  if (out.q > kMaxQ)
    refuse("q = 1 + num_speculative_tokens = ", out.q, " rows per request (at most ", kMaxQ, ")");

  // fp16's range (max 65504) is unsafe for the delta-rule state accumulated over the whole
  // context; bf16 keeps fp32's exponent. The auto path allows fp16 (its kernels upcast per step).
  if (d.mamba_ssm_cache_dtype == StateDtype::Float16)
    refuse("float16 KDA recurrent state (use float32 or bfloat16)");

  // Context parallelism splits the MLA cache along the sequence; the KDA state is not split.
  out.dcp = d.decode_context_parallel_size;
  if (out.dcp > 1 && m.num_mla_layers() == 0)
    refuse("decode_context_parallel_size = ", out.dcp,
           " on a model without MLA layers (only the MLA cache is split)");
  if (!is_pow2(out.dcp) || out.dcp > kMaxDcp)
    refuse("decode_context_parallel_size = ", out.dcp, " (a power of two up to ", kMaxDcp, ")");

  // DSA: the sparse MLA kernel set follows the cache format. Dense MLA (no DSA) reads every cache
  // format, the *_ds_mla layouts included, with its own kernels: fi_kernels stays None.
  out.dsa = m.has_dsa();
  if (out.dsa) {
    if (auto reason = dsa_unsupported(m, d)) refuse(*reason);
    if (d.kv_cache_dtype == KvCacheDtype::Fp8DsMla) out.fi_kernels = SparseMlaKernels::Fp8DsMla;
    if (d.kv_cache_dtype == KvCacheDtype::Nvfp4DsMla) out.fi_kernels = SparseMlaKernels::Nvfp4DsMla;
  }

  out.capture_sizes = capture_sizes(d, out.q);
  out.prims_ts_rows = prims_ts_rows(out.capture_sizes);
  return out;
}

}  // namespace k3
