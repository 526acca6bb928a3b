// DSA lightning indexer kernels. Key append and query preparation mirror the CPU's fp32
// operation order with explicit round-to-nearest intrinsics (no FMA contraction; the host
// reference is compiled without FMA), so their bytes match the CPU's exactly.
#include "cuda/dsa_indexer.h"

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/dsa_query.cuh"
#include "cuda/pdl.cuh"
#include "cuda/quant_util.cuh"

namespace k3::cuda {
namespace {

using namespace detail;
using namespace detail::dsa;

constexpr int kKeyThreads = 128;
constexpr int kScoreThreads = 256;  // 8 warps, one token per warp at a time
constexpr int kTokensPerCta = 256;
constexpr int kMaxQElems = 12288;  // nh * hd floats in shared memory (48 KB)

// Activations, caches, page tables, positions and lengths: no __restrict__ (PDL: their producer
// may still run when a kernel starts, so no ld.global.nc; see mma.cuh ld_act128). Weights keep it.
__global__ void key_append_kernel(const __nv_bfloat16* key, int hd,
                                  const float* __restrict__ norm_w,
                                  const float* __restrict__ norm_b, float eps,
                                  const int32_t* block_table, int max_pages,
                                  const int32_t* position, int page_size,
                                  uint8_t* __restrict__ key_cache,
                                  float* __restrict__ scale_cache) {
  K3_PDL_ENTRY();
  extern __shared__ float x[];  // [hd]
  __shared__ float stats[2];    // mean (LayerNorm), inv
  const int64_t r = blockIdx.x;
  const int pos = position[r];
  if (pos < 0 || pos / page_size >= max_pages) return;
  const int page = block_table[r * max_pages + pos / page_size];
  if (page < 0) return;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) x[i] = __bfloat162float(key[r * hd + i]);
  __syncthreads();
  // The norm statistics in the CPU's sequential order (hd <= 1024 adds: ~1 us, once per row).
  if (threadIdx.x == 0) {
    const float n = static_cast<float>(hd);
    float mean = 0.0f, ss = 0.0f;
    if (norm_b) {
      float sum = 0.0f;
      for (int i = 0; i < hd; ++i) sum = __fadd_rn(sum, x[i]);
      mean = __fdiv_rn(sum, n);
      for (int i = 0; i < hd; ++i) {
        const float d = __fsub_rn(x[i], mean);
        ss = __fadd_rn(ss, __fmul_rn(d, d));
      }
    } else {
      for (int i = 0; i < hd; ++i) ss = __fadd_rn(ss, __fmul_rn(x[i], x[i]));
    }
    stats[0] = mean;
    stats[1] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, n), eps)));
  }
  __syncthreads();
  const float mean = stats[0], inv = stats[1];
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    if (norm_b)  // layer_norm: ((x - mean) * inv) * w + b
      x[i] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(x[i], mean), inv), norm_w[i]), norm_b[i]);
    else  // rms_norm: x * inv * w
      x[i] = __fmul_rn(__fmul_rn(x[i], inv), norm_w[i]);
  }
  __syncthreads();
  hadamard_shared(x, hd, 1);
  const int64_t slot = static_cast<int64_t>(page) * page_size + pos % page_size;
  const int nb = scale_blocks(hd), B = scale_block(hd);
  uint8_t* kq = key_cache + slot * hd;  // [hd] E4M3
  float* ks = scale_cache + slot * nb;  // [nb] fp32
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int b = warp; b < nb; b += nwarps) {  // quantize_fp8_blocks, one warp per block
    const int b0 = b * B, len = min(B, hd - b0);
    const float scale = fp8_block_scale(warp_amax(x + b0, len));
    for (int i = lane; i < len; i += 32) kq[b0 + i] = f32_to_e4m3(__fdiv_rn(x[b0 + i], scale));
    if (lane == 0) ks[b] = scale;
  }
}

// KPL: key values per lane (hd / 32), so each lane dequantizes its part of a key once into
// registers and reuses it for every head.
template <int KPL>
__global__ void scores_kernel(const __nv_bfloat16* q, const __nv_bfloat16* head_w, float head_scale,
                              int nh, int hd, const uint8_t* key_cache, const float* scale_cache,
                              const int32_t* block_table, int max_pages, const int32_t* seq_len,
                              int page_size, float* __restrict__ scores, int64_t max_tokens) {
  K3_PDL_ENTRY();
  extern __shared__ float sq[];  // [nh][hd] dequantized rotated queries, then [nh] head weights
  float* sw = sq + nh * hd;
  const int64_t r = blockIdx.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTokensPerCta;
  const int64_t T = min(static_cast<int64_t>(seq_len[r]), max_tokens);
  if (t0 >= T) return;

  // Queries as dsa_select prepares them: Hadamard per head, fp8 block round trip.
  rotated_queries(q, head_w, head_scale, r, nh, hd, sq, sw);
  const int nb = scale_blocks(hd), B = scale_block(hd);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int hb = warp; hb < nh * nb; hb += nwarps) {  // one warp per (head, block)
    float* x = sq + (hb / nb) * hd + (hb % nb) * B;
    const int len = min(B, hd - (hb % nb) * B);
    const float scale = fp8_block_scale(warp_amax(x, len));
    __syncwarp();
    for (int i = lane; i < len; i += 32)
      x[i] = __fmul_rn(e4m3_to_f32(f32_to_e4m3(__fdiv_rn(x[i], scale))), scale);
  }
  __syncthreads();

  // One token per warp: lane holds key elements lane + 32 i (dequantized as the CPU does);
  // per head a partial dot product and a warp sum.
  const int64_t t1 = min(T, t0 + kTokensPerCta);
  for (int64_t s = t0 + warp; s < t1; s += nwarps) {
    const int page = block_table[r * max_pages + s / page_size];
    const int64_t slot = static_cast<int64_t>(page) * page_size + s % page_size;
    const uint8_t* kq = key_cache + slot * hd;  // [hd] E4M3
    const float* ks = scale_cache + slot * nb;  // [nb]
    float k[KPL];
#pragma unroll
    for (int i = 0; i < KPL; ++i) {
      const int j = lane + 32 * i;
      k[i] = __fmul_rn(e4m3_to_f32(kq[j]), ks[j / B]);
    }
    float acc = 0.0f;
    for (int h = 0; h < nh; ++h) {
      const float* qh = sq + h * hd + lane;
      float d = 0.0f;
#pragma unroll
      for (int i = 0; i < KPL; ++i) d += qh[32 * i] * k[i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      acc += sw[h] * fmaxf(d, 0.0f);
    }
    if (lane == 0) scores[r * max_tokens + s] = acc;
  }
}

}  // namespace

void dsa_index_key_append(const __nv_bfloat16* key, int64_t rows, int hd, const float* norm_w,
                          const float* norm_b, float eps, const int32_t* block_table, int max_pages,
                          const int32_t* position, int page_size, uint8_t* key_cache,
                          float* scale_cache, cudaStream_t stream) {
  K3_CHECK(hd >= 32 && hd <= 1024 && (hd & (hd - 1)) == 0,
           "dsa_index_key_append: index_head_dim must be a power of two in [32, 1024], got ", hd);
  K3_CHECK(rows >= 0 && rows <= 0x7fffffff && page_size > 0 && max_pages > 0,
           "dsa_index_key_append: bad rows=", rows, " page_size=", page_size,
           " max_pages=", max_pages);
  K3_CHECK(norm_w != nullptr, "dsa_index_key_append: the key norm weight is required");
  if (rows == 0) return;
  key_append_kernel<<<static_cast<unsigned>(rows), kKeyThreads, hd * sizeof(float), stream>>>(
      key, hd, norm_w, norm_b, eps, block_table, max_pages, position, page_size, key_cache,
      scale_cache);
  K3_CUDA_CHECK_LAUNCH();
}

void dsa_index_scores(const __nv_bfloat16* q, const __nv_bfloat16* head_w, float head_scale,
                      int64_t rows, int nh, int hd, const uint8_t* key_cache,
                      const float* scale_cache, const int32_t* block_table, int max_pages,
                      const int32_t* seq_len, int page_size, float* scores, int64_t max_tokens,
                      bool tensor_cores, cudaStream_t stream) {
  K3_CHECK(hd >= 32 && hd <= 1024 && (hd & (hd - 1)) == 0,
           "dsa_index_scores: index_head_dim must be a power of two in [32, 1024], got ", hd);
  K3_CHECK(nh >= 1 && static_cast<int64_t>(nh) * hd + nh <= kMaxQElems,
           "dsa_index_scores: index_n_heads x index_head_dim = ", nh, " x ", hd,
           " exceeds the shared-memory query buffer (", kMaxQElems, " values)");
  K3_CHECK(rows >= 0 && rows <= 0x7fffffff && page_size > 0 && max_pages > 0 && max_tokens >= 0,
           "dsa_index_scores: bad rows=", rows, " page_size=", page_size, " max_pages=", max_pages,
           " max_tokens=", max_tokens);
  const int64_t chunks = (max_tokens + kTokensPerCta - 1) / kTokensPerCta;
  K3_CHECK(chunks <= 65535, "dsa_index_scores: max_tokens ", max_tokens, " too large");
  if (rows == 0 || chunks == 0) return;
  if (tensor_cores && scores_mma_shape(nh, hd)) {
    scores_mma(q, head_w, head_scale, rows, nh, key_cache, scale_cache, block_table, max_pages,
               seq_len, page_size, scores, max_tokens, stream);
    return;
  }
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(chunks));
  const size_t smem = (static_cast<size_t>(nh) * hd + nh) * sizeof(float);
  const auto launch = [&](auto kernel) {
    kernel<<<grid, kScoreThreads, smem, stream>>>(q, head_w, head_scale, nh, hd, key_cache,
                                                  scale_cache, block_table, max_pages, seq_len,
                                                  page_size, scores, max_tokens);
  };
  switch (hd) {  // a power of two in [32, 1024] (checked above)
    case 32:
      launch(scores_kernel<1>);
      break;
    case 64:
      launch(scores_kernel<2>);
      break;
    case 128:
      launch(scores_kernel<4>);
      break;
    case 256:
      launch(scores_kernel<8>);
      break;
    case 512:
      launch(scores_kernel<16>);
      break;
    default:
      launch(scores_kernel<32>);
      break;
  }
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
