// PTX wrappers for the skinny GEMMs and the MLA decode: cp.async (Ampere-style, per-thread
// asynchronous copies to shared memory, zero-filling out-of-range sources), 16-byte shared loads,
// ldmatrix, and the bf16 mma.sync m16n8k16 with fp32 accumulators (HMMA on sm_90; wgmma needs
// M >= 64 rows).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda::detail {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, L2 only (.cg: W is streamed once). valid == false zero-fills dst and
// reads nothing (src must still be a mapped address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(n)
               : "memory");
}
// 8 bytes global -> shared (.ca: the only size-8 form), zero-filled when !valid.
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
  const int n = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(n)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// wait_group takes an immediate: dispatch a run-time count (uniform across the CTA).
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
  switch (n) {
    case 0:
      cp_async_wait<0>();
      break;
    case 1:
      cp_async_wait<1>();
      break;
    case 2:
      cp_async_wait<2>();
      break;
    case 3:
      cp_async_wait<3>();
      break;
    case 4:
      cp_async_wait<4>();
      break;
    case 5:
      cp_async_wait<5>();
      break;
    default:
      cp_async_wait<6>();
      break;
  }
}

// Shared-memory accesses are plain C++ (LDS/STS): the compiler may schedule them freely but
// never across the cp.async waits above, which clobber memory.
__device__ __forceinline__ uint4 lds128(const void* p) {
  return *static_cast<const uint4*>(p);
}
__device__ __forceinline__ uint2 lds64(const void* p) {
  return *static_cast<const uint2*>(p);
}
__device__ __forceinline__ void sts128(void* p, uint4 v) {
  *static_cast<uint4*>(p) = v;
}
// A 16-byte load of data an earlier kernel of the step wrote (an activation): coherent at L2,
// and, being volatile asm, kept after griddepcontrol.wait. __ldg (ld.global.nc) is only for data
// that is read-only for the kernel's whole lifetime, which an activation is not under a
// programmatic launch (its producer may still be writing it when this kernel starts): with the
// GEMV's weight loads for two rows ahead of the wait, GEMVs read stale x on the H200 and the
// specialized step's logits drifted to 1.2 rel L2 from the stock step's.
__device__ __forceinline__ uint4 ld_act128(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// A streamed weight load (read-only for the whole step, read once): kept out of L1. Weights may
// be requested before griddepcontrol.wait, no earlier kernel writes them.
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Word i (compile-time after unrolling) of a 16-byte vector.
__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Four 8x8 b16 matrices from shared memory: lane l gives the (16-byte aligned) address of row
// l % 8 of matrix l / 8; thread t receives of matrix i, in r[i], row t / 4, columns 2 (t % 4) and
// 2 (t % 4) + 1 (the _trans form: column t / 4, rows 2 (t % 4) and 2 (t % 4) + 1), which is an
// mma fragment's layout. Volatile with a memory clobber: the compiler must not move it across
// the barriers and cp.async waits that order the shared memory it reads.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row))
               : "memory");
}

// D += A * B, A 16x16 bf16 (row-major fragment a0..a3), B 16x8 bf16 (b0, b1), D 16x8 fp32.
// Fragments (PTX ISA, mma.m16n8k16, g = lane / 4, c = lane % 4):
//   a0: (row g,   k 2c..2c+1)   a1: (row g+8, k 2c..2c+1)
//   a2: (row g,   k 2c+8..+9)   a3: (row g+8, k 2c+8..+9)
//   b0: (k 2c..2c+1, col g)     b1: (k 2c+8..+9, col g)
//   d0,d1: (row g, col 2c, 2c+1)   d2,d3: (row g+8, col 2c, 2c+1)
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D += A B with fp8 E4M3 operands (sm_89+): A 16 x 32 row-major (a0/a2 row g, a1/a3 row g + 8;
// a0/a1 columns 4 t .. 4 t + 3, a2/a3 those + 16), B 32 x 8 (b0 rows 4 t .. 4 t + 3, b1 those + 16,
// column g), D as in mma_bf16_16816; g = lane / 4, t = lane % 4, four E4M3 bytes per register,
// the lowest k in the lowest byte.
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace k3::cuda::detail
