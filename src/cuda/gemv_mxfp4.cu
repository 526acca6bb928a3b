// The few-row MXFP4 GEMV: y[m, N] = x[m, K] . W[N, K]^T, m <= 8 rows per slot, with the skinny
// GEMM's epilogue. At one row the tiled kernel stages W through a cp.async ring for an mma that
// is 1/8 used and runs one CTA per SM, bound by latency (ncu, bench/RESULTS.md); here every
// weight byte goes straight into registers, all requested before waiting on the previous kernel.
//
// Layout. A CTA owns 16 rows of W; warp w owns `pieces` consecutive 128-k pieces of them (64
// packed bytes and 4 E8M0 scales per row and piece). Lane (g, c) = (lane / 4, lane % 4) holds rows
// g and g + 8, packed bytes 16c..16c+15 of each piece: k 32c..32c+31, exactly one scale block.
// Dequantized as the tiled kernel does (mxfp4_dequant.cuh) straight into mma A fragments; x is
// the B operand, staged per warp in shared memory in the dequantized k order (permute_x8) with
// the tiled kernel's swizzle.
//
// Order. Each piece's 8 mma start from zero and land in shared memory as one partial tile; the
// output sums the pieces in k order. So every plan of this kind (any pieces per warp) gives the
// same bits, and launches of one shape with other slot counts or row counts agree.
#include "cuda/gemv_mxfp4.h"

#include <cuda_bf16.h>

#include "core/error.h"
#include "cuda/linear_launch.cuh"
#include "cuda/mxfp4_dequant.cuh"
#include "cuda/pdl.cuh"
#include "cuda/skinny_gemm.cuh"

namespace k3::cuda::detail {
namespace {

constexpr int kPieceK = kGemvMxfp4PieceK;
constexpr int kPieceUnits = kPieceK / 8;  // 16-byte units of bf16 x per piece

// One warp's weights of its CTA's 16 rows: per piece, rows g and g + 8 (16 packed bytes each)
// and those rows' 4 scale bytes of the piece (this lane's block is byte c).
template <int P>
struct WarpWeights {
  uint4 q[P][2];
  uint32_t s[P][2];
};

template <int P>
__device__ __forceinline__ void load_weights(WarpWeights<P>& w, const void* W, const uint8_t* Ws,
                                             const SkinnyArgs& a, int row0, int piece0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const uint8_t* packed = static_cast<const uint8_t*>(W);  // [N, K/2] u8
  const int n_pieces = a.k / kPieceK;
  const int64_t row_bytes = a.k / 2, scale_bytes = a.k / 32;
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + h * 8 + g, piece = piece0 + p;
      const bool ok = row < a.n && piece < n_pieces;
      w.q[p][h] = ok ? ldg_stream(packed + row * row_bytes + piece * (kPieceK / 2) + c * 16)
                     : make_uint4(0, 0, 0, 0);
      w.s[p][h] = ok ? __ldg(reinterpret_cast<const uint32_t*>(Ws + row * scale_bytes +
                                                               piece * (kPieceK / 32)))
                     : 0u;
    }
}

// acc (the mma C fragment of rows g, g + 8 and token columns 2c, 2c + 1) = piece p of this
// warp's weights . its staged x.
template <int P, bool kTwo>
__device__ __forceinline__ void piece_mma(float (&acc)[4], const WarpWeights<P>& w, int p,
                                          const uint8_t* xs, int pitch, int mx) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  uint32_t f1[2], f2[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) mxfp4_factors<kTwo>((w.s[p][h] >> (8 * c)) & 0xffu, f1[h], f2[h]);
  // Token columns past mx read row mx - 1 (staged, finite): their outputs are never stored.
  const uint8_t* xrow = xs + min(g, mx - 1) * pitch;
#pragma unroll
  for (int wd = 0; wd < 4; ++wd) {
    uint32_t pr[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) mxfp4_pairs<kTwo>(word(w.q[p][h], wd), f1[h], f2[h], pr[h]);
    // x_unit<true>(p * 16 + c * 4 + wd): the swizzle flips bit 1 where c >= 2.
    const int unit = p * kPieceUnits + c * 4 + (wd ^ ((c >> 1) << 1));
    const uint4 b = lds128(xrow + unit * 16);
#pragma unroll
    for (int s = 0; s < 2; ++s)
      mma_bf16_16816(acc, pr[0][2 * s], pr[1][2 * s], pr[0][2 * s + 1], pr[1][2 * s + 1],
                     word(b, 2 * s), word(b, 2 * s + 1));
  }
}

// y rows [off, off + mx) of this CTA's 16 output rows, from the weights in registers (x is
// ready: the caller has waited on the previous kernel). Uses all of shared memory; the caller
// syncs the CTA before calling it again.
template <int P, bool kGlu>
__device__ __forceinline__ void gemv_tile(const SkinnyArgs& a, const WarpWeights<P>& w, int mx,
                                          int off, uint8_t* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int n_pieces = a.k / kPieceK, piece0 = warp * P;
  const int row0 = static_cast<int>(blockIdx.x) * 16;
  uint8_t* xs = smem + static_cast<size_t>(warp) * a.m * a.x_pitch;  // [mx][x_pitch] this warp's
  float* red = reinterpret_cast<float*>(smem + a.x_bytes);           // [n_pieces][mx][16]

  constexpr int units = P * kPieceUnits;
  for (int i = lane; i < mx * units; i += 32) {
    const int m = i / units, u = i % units;
    const int xr = a.row_index ? a.row_index[off + m] : off + m;
    const uint4 v = load_x8<kGlu>(a, xr, piece0 * kPieceK + u * 8);
    sts128(xs + m * a.x_pitch + x_unit<true>(u) * 16, permute_x8(v));
  }
  __syncwarp();

#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int piece = piece0 + p;
    if (piece >= n_pieces) break;  // uniform over the warp
    const bool big =
        ((w.s[p][0] >> (8 * c)) & 0xffu) > 128u || ((w.s[p][1] >> (8 * c)) & 0xffu) > 128u;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (__any_sync(0xffffffffu, big))
      piece_mma<P, true>(acc, w, p, xs, a.x_pitch, mx);
    else
      piece_mma<P, false>(acc, w, p, xs, a.x_pitch, mx);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int m = 2 * c + (e & 1), r = g + (e >= 2 ? 8 : 0);
      if (m < mx) red[(piece * mx + m) * 16 + r] = acc[e];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < mx * 16; idx += blockDim.x) {
    const int m = idx / 16, r = idx % 16, row = row0 + r;
    if (row >= a.n) continue;
    float s = 0.0f;
    for (int q = 0; q < n_pieces; ++q) s += red[(q * mx + m) * 16 + r];
    store_output(a, static_cast<int64_t>(off + m) * a.ldy + row, s);
  }
}

// Dense: one 16-row tile per CTA. Grouped: the CTAs of row y take the busy slots y,
// y + gridDim.y, ... in turn (skinny_gemm.cuh: for_each_busy_slot), as the tiled kernel does.
template <int P, bool kGlu>
__global__ void __launch_bounds__(gemv_mxfp4_max_threads(P))
    gemv_mxfp4_kernel(const __grid_constant__ SkinnyArgs a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int row0 = static_cast<int>(blockIdx.x) * 16, piece0 = (threadIdx.x >> 5) * P;
  const int mx_max = min(a.m, kGemvMxfp4MaxRows);
  WarpWeights<P> w;
  if (!a.slot_expert) {
    pdl_launch_dependents();
    load_weights<P>(w, a.w, a.ws, a, row0, piece0);
    pdl_wait();  // x is the previous kernel's output
    gemv_tile<P, kGlu>(a, w, mx_max, 0, smem);
    return;
  }
  // Slot arrays: from the previous kernel (wait first) or, slots_ready, complete before it began
  // (read now, the first expert's weights requested before the wait); see skinny_gemm_kernel.
  if (!a.slots_ready) pdl_wait();
  pdl_launch_dependents();
  for_each_busy_slot(a, [&](int e, int off, int cnt) {
    load_weights<P>(w, a.w_table[e], a.ws_table[e], a, row0, piece0);
    pdl_wait();  // returns at once after the first
    gemv_tile<P, kGlu>(a, w, min(cnt, mx_max), off, smem);
    __syncthreads();  // shared memory is the next slot's
  });
  pdl_wait();  // a CTA without a busy slot still completes after the previous kernel
}

using GemvFp4Kernel = void (*)(SkinnyArgs);

template <bool kGlu>
GemvFp4Kernel gemv_fp4_kernel_for(int pieces) {
  switch (pieces) {
    case 1:
      return gemv_mxfp4_kernel<1, kGlu>;
    case 2:
      return gemv_mxfp4_kernel<2, kGlu>;
    case 4:
      return gemv_mxfp4_kernel<4, kGlu>;
    default:
      break;
  }
  fail("MXFP4 GEMV: no kernel for ", pieces, " pieces per warp");
}

}  // namespace

cudaError_t launch_gemv_mxfp4(const LinearPlan& p, const SkinnyArgs& args, cudaStream_t stream) {
  K3_CHECK(p.gemv_fp4() && p.weight == LinearWeight::MXFP4 && args.m >= 1 && args.m <= p.m &&
               p.m <= kGemvMxfp4MaxRows && args.k == p.k && args.k % 256 == 0,
           "MXFP4 GEMV: 1..", kGemvMxfp4MaxRows, " rows per slot and K % 256 == 0 only (plan ",
           p.str(), ", m ", args.m, ")");
  K3_CHECK(!args.slot_expert || args.ws_table, "MXFP4 GEMV: a grouped launch without scales");
  SkinnyArgs a = args;
  a.n_slots = p.groups;
  a.x_pitch = p.x_pitch;
  a.x_bytes = static_cast<int>(p.x_bytes);
  const GemvFp4Kernel fn = a.x_glu ? gemv_fp4_kernel_for<true>(p.gemv_fp4_pieces)
                                   : gemv_fp4_kernel_for<false>(p.gemv_fp4_pieces);
  allow_max_smem(reinterpret_cast<const void*>(fn));
  const ClusterLaunch launch(dim3(static_cast<unsigned>(p.grid_x()),
                                  static_cast<unsigned>(a.slot_expert ? p.slot_ctas() : 1)),
                             dim3(static_cast<unsigned>(p.threads())), p.smem_bytes, stream, 0);
  return cudaLaunchKernelEx(&launch.config, fn, a);
}

}  // namespace k3::cuda::detail
