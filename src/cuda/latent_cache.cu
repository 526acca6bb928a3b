// Latent cache append / dequantize kernels. One CTA per row (append) or per (row, page)
// (dequantize); the formats are a runtime switch, cheap next to the cache traffic.
#include "cuda/latent_cache.h"

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/pdl.cuh"
#include "cuda/quant_util.cuh"

namespace k3::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 128;  // 4 warps

// kv, the cache, page tables, positions and lengths: no __restrict__ (PDL: their producer may
// still run when a kernel starts, so no ld.global.nc; see mma.cuh ld_act128).
__global__ void append_kernel(LatentFormat fmt, const __nv_bfloat16* kv, int kvl, int rope,
                              const int32_t* block_table, int max_pages, const int32_t* position,
                              int page_size, uint8_t* __restrict__ cache, int64_t entry_bytes) {
  K3_PDL_ENTRY();
  const int64_t r = blockIdx.x;
  const int pos = position[r];
  if (pos < 0 || pos / page_size >= max_pages) return;
  const int page = block_table[r * max_pages + pos / page_size];
  if (page < 0) return;
  const int n = kvl + rope;
  const __nv_bfloat16* x = kv + r * n;  // [kvl + rope]
  uint8_t* dst = cache + (static_cast<int64_t>(page) * page_size + pos % page_size) * entry_bytes;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;

  switch (fmt) {
    case LatentFormat::F32:
      for (int i = tid; i < n; i += blockDim.x) store_f32(dst + 4 * i, __bfloat162float(x[i]));
      return;
    case LatentFormat::BF16:
      for (int i = tid; i < n; i += blockDim.x) store_u16(dst + 2 * i, bf16_bits(x[i]));
      return;
    case LatentFormat::FP8:
      for (int i = tid; i < n; i += blockDim.x)
        dst[i] = f32_to_e4m3(__fdiv_rn(__bfloat162float(x[i]), cpu::kFp8LatentScale));
      return;
    case LatentFormat::FP8_DS_MLA: {
      // One warp per scale block: amax (order-free, so exact), scale = amax / 448, codes.
      const int B = kvl < cpu::kFp8DsMlaBlock ? kvl : cpu::kFp8DsMlaBlock, nb = kvl / B;
      for (int b = warp; b < nb; b += nwarps) {
        float amax = 0.0f;
        for (int i = lane; i < B; i += 32)
          amax = fmaxf(amax, fabsf(__bfloat162float(x[b * B + i])));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float scale = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
        for (int i = lane; i < B; i += 32)
          dst[b * B + i] = f32_to_e4m3(__fdiv_rn(__bfloat162float(x[b * B + i]), scale));
        if (lane == 0) store_f32(dst + kvl + 4 * b, scale);
      }
      uint8_t* pe = dst + kvl + 4 * nb;  // [rope] bf16
      for (int i = tid; i < rope; i += blockDim.x) store_u16(pe + 2 * i, bf16_bits(x[kvl + i]));
      return;
    }
    case LatentFormat::NVFP4_DS_MLA: {
      // One thread per 16-value block: the scale is rounded to E4M3 first and the values are
      // divided by the rounded scale, as the CPU encoder does.
      constexpr int B = cpu::kNvfp4Block;
      const int nb = kvl / B;
      uint8_t* sc = dst + kvl / 2;  // [nb] E4M3
      for (int b = tid; b < nb; b += blockDim.x) {
        float v[B];
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < B; ++i) {
          v[i] = __bfloat162float(x[b * B + i]);
          amax = fmaxf(amax, fabsf(v[i]));
        }
        const uint8_t code = f32_to_e4m3(__fdiv_rn(amax, 6.0f));
        const float s = e4m3_to_f32(code);
        sc[b] = code;
#pragma unroll
        for (int i = 0; i < B; i += 2) {
          const uint8_t lo = s > 0.0f ? f32_to_e2m1(__fdiv_rn(v[i], s)) : 0;
          const uint8_t hi = s > 0.0f ? f32_to_e2m1(__fdiv_rn(v[i + 1], s)) : 0;
          dst[(b * B + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
      uint8_t* pe = sc + nb;  // [rope] bf16
      for (int i = tid; i < rope; i += blockDim.x) store_u16(pe + 2 * i, bf16_bits(x[kvl + i]));
      return;
    }
  }
}

// Element i of one cache entry, dequantized.
__device__ __forceinline__ float entry_value(LatentFormat fmt, const uint8_t* e, int kvl, int i) {
  switch (fmt) {
    case LatentFormat::F32:
      return load_f32(e + 4 * i);
    case LatentFormat::BF16:
      return bf16_bits_to_f32(load_u16(e + 2 * i));
    case LatentFormat::FP8:
      return __fmul_rn(e4m3_to_f32(e[i]), cpu::kFp8LatentScale);
    case LatentFormat::FP8_DS_MLA: {
      const int B = kvl < cpu::kFp8DsMlaBlock ? kvl : cpu::kFp8DsMlaBlock, nb = kvl / B;
      if (i < kvl) return __fmul_rn(e4m3_to_f32(e[i]), load_f32(e + kvl + 4 * (i / B)));
      return bf16_bits_to_f32(load_u16(e + kvl + 4 * nb + 2 * (i - kvl)));
    }
    case LatentFormat::NVFP4_DS_MLA: {
      const int nb = kvl / cpu::kNvfp4Block;
      const uint8_t* sc = e + kvl / 2;
      if (i < kvl) {
        const uint8_t nib = (i & 1) ? (e[i / 2] >> 4) : (e[i / 2] & 0xf);
        return __fmul_rn(e2m1_to_f32(nib), e4m3_to_f32(sc[i / cpu::kNvfp4Block]));
      }
      return bf16_bits_to_f32(load_u16(sc + nb + 2 * (i - kvl)));
    }
  }
  return 0.0f;
}

__global__ void to_bf16_kernel(LatentFormat fmt, const uint8_t* cache, int kvl, int rope,
                               const int32_t* block_table, int max_pages, const int32_t* seq_len,
                               int page_size, __nv_bfloat16* __restrict__ out,
                               int64_t entry_bytes) {
  K3_PDL_ENTRY();
  const int p = blockIdx.x;
  const int64_t r = blockIdx.y;
  const int64_t first = static_cast<int64_t>(p) * page_size;
  const int len = seq_len[r];
  if (first >= len) return;
  const int page = block_table[r * max_pages + p];
  if (page < 0) return;
  const int n = kvl + rope;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int j = warp; j < page_size && first + j < len; j += nwarps) {  // one token per warp
    const int64_t slot = static_cast<int64_t>(page) * page_size + j;
    const uint8_t* e = cache + slot * entry_bytes;  // [entry_bytes]
    __nv_bfloat16* o = out + slot * n;              // [kvl + rope] bf16
    for (int i = lane; i < n; i += 32) o[i] = __float2bfloat16_rn(entry_value(fmt, e, kvl, i));
  }
}

}  // namespace

void latent_cache_append(LatentFormat fmt, const __nv_bfloat16* kv, int64_t rows, int kv_lora,
                         int rope, const int32_t* block_table, int max_pages,
                         const int32_t* position, int page_size, uint8_t* cache,
                         cudaStream_t stream) {
  const size_t eb = cpu::latent_entry_bytes(fmt, kv_lora, rope);  // validates the widths
  K3_CHECK(rows >= 0 && rows <= 0x7fffffff && page_size > 0 && max_pages > 0,
           "latent_cache_append: bad rows=", rows, " page_size=", page_size,
           " max_pages=", max_pages);
  if (rows == 0) return;
  append_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      fmt, kv, kv_lora, rope, block_table, max_pages, position, page_size, cache,
      static_cast<int64_t>(eb));
  K3_CUDA_CHECK_LAUNCH();
}

void latent_cache_to_bf16(LatentFormat fmt, const uint8_t* cache, int kv_lora, int rope,
                          const int32_t* block_table, int max_pages, const int32_t* seq_len,
                          int64_t rows, int page_size, __nv_bfloat16* out, cudaStream_t stream) {
  const size_t eb = cpu::latent_entry_bytes(fmt, kv_lora, rope);
  K3_CHECK(rows >= 0 && rows <= 65535 && page_size > 0 && max_pages > 0,
           "latent_cache_to_bf16: bad rows=", rows, " (at most 65535) page_size=", page_size,
           " max_pages=", max_pages);
  if (rows == 0) return;
  const dim3 grid(static_cast<unsigned>(max_pages), static_cast<unsigned>(rows));
  to_bf16_kernel<<<grid, kThreads, 0, stream>>>(fmt, cache, kv_lora, rope, block_table, max_pages,
                                                seq_len, page_size, out, static_cast<int64_t>(eb));
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
