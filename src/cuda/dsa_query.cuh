// The pieces both DSA index-score kernels share (dsa_indexer.cu on CUDA cores, dsa_scores_mma.cu
// on fp8 tensor cores): the fp8 block shape of a head dim, the shared-memory Walsh-Hadamard
// transform, the warp amax and block scale, and the query preparation as cpu dsa_select does it
// (Hadamard per head in the CPU's operation order, so the rotated values match its bits).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda::detail::dsa {

// Blocks of the fp8 quantizer for head dim hd: cpu::index_scale_blocks and dsa_select's block.
__host__ __device__ inline int scale_blocks(int hd) {
  return (hd + 127) / 128;
}
__host__ __device__ inline int scale_block(int hd) {
  const int nb = scale_blocks(hd);
  return (hd + nb - 1) / nb;
}

// In-place orthonormal WHT of `count` vectors of length n in shared memory (vector v at
// x + v * n), all threads of the CTA. The butterflies are those of cpu::hadamard_transform;
// each output depends only on its pair, so running a pass in parallel gives the same bits.
__device__ inline void hadamard_shared(float* x, int n, int count) {
  const int half = n / 2, total = half * count, lg_half = __ffs(half) - 1;  // n: a power of 2
  for (int h = 1, lg_h = 0; h < n; h *= 2, ++lg_h) {
    for (int t = threadIdx.x; t < total; t += blockDim.x) {
      const int v = t >> lg_half, k = t & (half - 1);
      const int j = ((k >> lg_h) << (lg_h + 1)) | (k & (h - 1));  // the butterfly's lower index
      float* p = x + v * n;
      const float a = p[j], b = p[j + h];
      p[j] = __fadd_rn(a, b);
      p[j + h] = __fsub_rn(a, b);
    }
    __syncthreads();
  }
  const float norm = __fdiv_rn(1.0f, __fsqrt_rn(static_cast<float>(n)));
  for (int t = threadIdx.x; t < n * count; t += blockDim.x) x[t] = __fmul_rn(x[t], norm);
  __syncthreads();
}

// amax over x[0..B) by one warp (order-free, so exact); every lane gets it.
__device__ __forceinline__ float warp_amax(const float* x, int B) {
  const int lane = threadIdx.x & 31;
  float m = 0.0f;
  for (int i = lane; i < B; i += 32) m = fmaxf(m, fabsf(x[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// The fp8 block scale of a block with absolute maximum amax (E4M3's largest finite is 448).
__device__ __forceinline__ float fp8_block_scale(float amax) {
  return amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
}

// Row r's queries rotated into sq [nh][hd] fp32 and its head weights times head_scale into sw
// [nh] fp32 (shared memory), all threads of the CTA; the fp8 block round trip is the caller's.
// q: [rows][nh][hd] bf16; head_w: [rows][nh] bf16 (both activations: plain loads after the PDL
// wait).
__device__ inline void rotated_queries(const __nv_bfloat16* q, const __nv_bfloat16* head_w,
                                       float head_scale, int64_t r, int nh, int hd, float* sq,
                                       float* sw) {
  const __nv_bfloat16* qr = q + r * nh * hd;  // [nh][hd]
  for (int i = threadIdx.x; i < nh * hd; i += blockDim.x) sq[i] = __bfloat162float(qr[i]);
  for (int h = threadIdx.x; h < nh; h += blockDim.x)
    sw[h] = __fmul_rn(__bfloat162float(head_w[r * nh + h]), head_scale);
  __syncthreads();
  hadamard_shared(sq, hd, nh);
}

// The tensor-core score kernel (dsa_scores_mma.cu): the shapes it takes (hd 128, nh a multiple
// of 16 in [16, 64]) and its launch, with dsa_index_scores's arguments (hd = 128).
bool scores_mma_shape(int nh, int hd);
void scores_mma(const __nv_bfloat16* q, const __nv_bfloat16* head_w, float head_scale, int64_t rows,
                int nh, const uint8_t* key_cache, const float* scale_cache,
                const int32_t* block_table, int max_pages, const int32_t* seq_len, int page_size,
                float* scores, int64_t max_tokens, cudaStream_t stream);

}  // namespace k3::cuda::detail::dsa
