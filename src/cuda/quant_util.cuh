// Device versions of the cache number formats of core/numeric.h (E4M3, E2M1), bit for bit the
// host functions on finite inputs, plus unaligned little-endian byte stores for packed cache
// entries (their scale and bf16 fields need not be 4- or 2-byte aligned).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda::detail {

// Round to nearest even, saturating to +-448, NaN -> 0x7f: float_to_e4m3.
__device__ __forceinline__ uint8_t f32_to_e4m3(float f) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
}

// e4m3_to_float: subnormals are man * 2^-9, normals (1 + man/8) * 2^(exp-7), 0x7f/0xff NaN.
__device__ __forceinline__ float e4m3_to_f32(uint8_t v) {
  const uint32_t exp = (v >> 3) & 0xfu, man = v & 7u;
  float mag;
  if (exp == 15 && man == 7) return __int_as_float(0x7fc00000);
  if (exp == 0)
    mag = static_cast<float>(man) * 0x1p-9f;
  else
    mag = __uint_as_float(((exp + 120u) << 23) | (man << 20));
  return (v & 0x80) ? -mag : mag;
}

// float_to_e2m1: nearest of {0,.5,1,1.5,2,3,4,6}, ties to the even code, saturating at 6. The
// thresholds are the midpoints; "<=" where the lower neighbour has the even code.
__device__ __forceinline__ uint8_t f32_to_e2m1(float f) {
  const uint8_t sign = signbit(f) ? 8 : 0;
  const float a = fabsf(f);
  if (a != a) return 0;
  uint8_t m;
  if (a <= 0.25f)
    m = 0;
  else if (a < 0.75f)
    m = 1;
  else if (a <= 1.25f)
    m = 2;
  else if (a < 1.75f)
    m = 3;
  else if (a <= 2.5f)
    m = 4;
  else if (a < 3.5f)
    m = 5;
  else if (a <= 5.0f)
    m = 6;
  else
    m = 7;
  return static_cast<uint8_t>(sign | m);
}

__device__ __forceinline__ float e2m1_to_f32(uint8_t nib) {
  const uint32_t m = nib & 7u;
  // {0, .5, 1, 1.5, 2, 3, 4, 6}: exponent-free formula avoids a local-memory table.
  const float mag = m < 4 ? 0.5f * static_cast<float>(m)
                          : static_cast<float>(1u << ((m >> 1) - 1)) * (m & 1 ? 1.5f : 1.0f);
  return (nib & 8) ? -mag : mag;
}

__device__ __forceinline__ void store_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
__device__ __forceinline__ void store_f32(uint8_t* p, float f) {
  const uint32_t v = __float_as_uint(f);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
__device__ __forceinline__ uint16_t load_u16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}
__device__ __forceinline__ float load_f32(const uint8_t* p) {
  return __uint_as_float(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24));
}
__device__ __forceinline__ uint16_t bf16_bits(__nv_bfloat16 h) {
  return __bfloat16_as_ushort(h);
}
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

}  // namespace k3::cuda::detail
