// Exact MXFP4 -> bf16 dequantization into mma A fragments, shared by the tiled skinny GEMM
// (linear_mxfp4.cu) and the GEMV (gemv_mxfp4.cu).
//
// With t = q << 12-4i, (t & 0x80008000) | ((t >> 6) & 0x01C001C0) puts nibbles i and i+4 of the
// 32-bit word q into the two bf16 halves as sign | e2m1 bits << 6, which is exactly
// value * 2^-126 (the e2m1 subnormal 0.5 lands on the bf16 subnormal 2^-127). One multiply by
// 2^(s-1) = 2^126 * 2^(s-127) then gives the exact bf16 value; scales above 2^1 (s > 128, rare)
// need two multiplies (kTwo), taken when any lane of the warp has one. The pairs of a word come
// out in k order [0,4,1,5,2,6,3,7]; x is staged in that order (skinny_gemm.cuh: permute_x8).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace k3::cuda::detail {

__device__ __forceinline__ uint32_t e2m1x2_raw(uint32_t t) {
  return (t & 0x80008000u) | ((t >> 6) & 0x01C001C0u);
}

// bf16x2 multiply (the intrinsic vLLM's Marlin uses on the same subnormal-encoded pairs).
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The bf16x2 factors of E8M0 scale byte s: one (2^(s-1), s <= 128) or two (2^126, 2^(s-127)).
template <bool kTwo>
__device__ __forceinline__ void mxfp4_factors(uint32_t s, uint32_t& f1, uint32_t& f2) {
  if (!kTwo) {
    f1 = ((s + 126u) << 7) * 0x10001u;
    f2 = 0;
  } else {
    f1 = 0x7E807E80u;
    f2 = s == 255u ? 0x7FC07FC0u : s == 0u ? 0x00400040u : (s << 7) * 0x10001u;
  }
}

// The four bf16x2 pairs of packed word q (8 values), scaled: k order [0,4,1,5,2,6,3,7].
template <bool kTwo>
__device__ __forceinline__ void mxfp4_pairs(uint32_t q, uint32_t f1, uint32_t f2,
                                            uint32_t (&pr)[4]) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    uint32_t v = mul_bf16x2(e2m1x2_raw(q << (12 - 4 * p)), f1);
    if (kTwo) v = mul_bf16x2(v, f2);
    pr[p] = v;
  }
}

}  // namespace k3::cuda::detail
