// MXFP4 weights for the skinny GEMM (skinny_gemm.cuh). A chunk is 256 k of 16*MT rows: per
// thread, rows g and g+8 of each 16-row tile, two 16-byte packed pieces each (k 32c..32c+31 and
// 128+32c..), i.e. exactly one E8M0 block per piece, plus the row's 8 scale bytes (8-byte
// cp.async). A warp covers 128 contiguous packed bytes of each row per chunk.
//
// Dequantization: mxfp4_dequant.cuh (exact bf16, pairs in k order [0,4,1,5,2,6,3,7]; x is staged
// in that order).
#include "cuda/linear_mxfp4.h"

#include "core/error.h"
#include "cuda/device_util.cuh"
#include "cuda/linear_launch.cuh"
#include "cuda/mxfp4_dequant.cuh"

namespace k3::cuda {
namespace detail {
namespace {

struct Mxfp4Format {
  using PlanKey = Mxfp4Format;  // its plans (linear_launch.cuh: tuned_plans)
  static constexpr int kChunk = 256;
  static constexpr bool kXPermute = true;
  static constexpr bool kGluInput = false;
  static constexpr bool kWarpgroupMma = true;
  // 4*MT packed pieces x 32 lanes x 16 B, then 2*MT rows x 32 lanes x 8 scale bytes.
  static constexpr __host__ __device__ int stage_bytes(int mt) { return 2560 * mt; }

  struct Dec {
    __device__ static float at(const void* W, const uint8_t* Ws, int n, int k, int K) {
      const uint8_t byte =
          static_cast<const uint8_t*>(W)[static_cast<int64_t>(n) * (K / 2) + k / 2];
      const uint32_t nib = (k & 1) ? (byte >> 4) : (byte & 15u);
      // e2m1 bits << 22 in fp32 are the value * 2^-126 (as in the bf16 trick above).
      const float mag = __uint_as_float((nib & 7u) << 22) * 0x1p126f;
      const float v = (nib & 8u) ? -mag : mag;
      const uint32_t s = Ws[static_cast<int64_t>(n) * (K / 32) + k / 32];
      const float scale = s == 255u ? __uint_as_float(0x7fc00000u)
                          : s == 0u ? __uint_as_float(0x00400000u)
                                    : __uint_as_float(s << 23);
      return v * scale;
    }
  };

  template <int MT>
  __device__ static void load_chunk(uint8_t* slot, const void* W, const uint8_t* Ws, int N, int K,
                                    int row0, int chunk, int lane) {
    const uint8_t* p = static_cast<const uint8_t*>(W);  // [N, K/2]
    const int g = lane >> 2, c = lane & 3;
    const int64_t row_bytes = K / 2, scale_bytes = K / 32;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + i * 16 + h * 8 + g;
        const bool valid = row < N;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint8_t* src = valid ? p + row * row_bytes + chunk * 128 + j * 64 + c * 16 : p;
          cp_async16(slot + (((i * 2 + h) * 2 + j) * 32 + lane) * 16, src, valid);
        }
        const uint8_t* ssrc = valid ? Ws + row * scale_bytes + chunk * 8 : Ws;
        cp_async8(slot + 2048 * MT + ((i * 2 + h) * 32 + lane) * 8, ssrc, valid);
      }
  }

  template <int NT, int MT, bool kTwo>
  __device__ static void compute(float (&acc)[MT][NT][4], const uint8_t* slot,
                                 const uint2 (&sc)[MT][2], const uint8_t* xs, int pitch, int kloc,
                                 int lane, int mx) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint4 wv[MT][2];
      uint32_t f1[MT][2], f2[MT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wv[i][h] = lds128(slot + (((i * 2 + h) * 2 + j) * 32 + lane) * 16);
          const uint32_t s = ((j ? sc[i][h].y : sc[i][h].x) >> (8 * c)) & 0xffu;
          mxfp4_factors<kTwo>(s, f1[i][h], f2[i][h]);
        }
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t pr[MT][2][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            mxfp4_pairs<kTwo>(word(wv[i][h], w), f1[i][h], f2[i][h], pr[i][h]);
        // x_unit((kloc + j*128 + c*32 + w*8) / 8) with kloc % 256 == 0: the swizzle flips bit 1
        // where bit 3 is set, i.e. lane-constant on c >= 2 (saves its integer chain per word).
        const int unit = (kloc >> 3) + j * 16 + c * 4 + (w ^ ((c >> 1) << 1));
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (t * 8 >= mx) break;  // uniform: no token in this column tile
          // Token columns past mx read row mx - 1 (staged, finite): an mma column only feeds
          // its own output column, and those are never stored. No divergent branch.
          const int n = min(t * 8 + g, mx - 1);
          const uint4 b = lds128(xs + n * pitch + unit * 16);
#pragma unroll
          for (int s = 0; s < 2; ++s)
#pragma unroll
            for (int i = 0; i < MT; ++i)
              mma_bf16_16816(acc[i][t], pr[i][0][2 * s], pr[i][1][2 * s], pr[i][0][2 * s + 1],
                             pr[i][1][2 * s + 1], word(b, 2 * s), word(b, 2 * s + 1));
        }
      }
    }
  }

  // This lane's scale bytes of a chunk's rows (sc[i][h]: row tile i, row g + 8 h; .x half 0,
  // .y half 1), and whether any lane of the warp has a scale above 2^1 (the two-multiply path).
  template <int MT>
  __device__ static bool load_scales(const uint8_t* slot, int lane, uint2 (&sc)[MT][2]) {
    const int c = lane & 3;
    bool big = false;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sc[i][h] = lds64(slot + 2048 * MT + ((i * 2 + h) * 32 + lane) * 8);
        big |= ((sc[i][h].x >> (8 * c)) & 0xffu) > 128u || ((sc[i][h].y >> (8 * c)) & 0xffu) > 128u;
      }
    return __any_sync(0xffffffffu, big);
  }

  template <int NT, int MT>
  __device__ static void compute_chunk(float (&acc)[MT][NT][4], const uint8_t* slot,
                                       const uint8_t* xs, int pitch, int kloc, int lane, int mx) {
    uint2 sc[MT][2];
    if (load_scales<MT>(slot, lane, sc))
      compute<NT, MT, true>(acc, slot, sc, xs, pitch, kloc, lane, mx);
    else
      compute<NT, MT, false>(acc, slot, sc, xs, pitch, kloc, lane, mx);
  }

  // (Warpgroup MMA) The A fragments of half j of a 16-row chunk (mt 1): a[w][s] is mma step
  // 2 w + s of the half, registers as mma_bf16_16816's a0..a3 (rows g / g + 8, pairs 2 s and
  // 2 s + 1 of word w).
  template <bool kTwo>
  __device__ static void dequant_half(const uint8_t* slot, const uint2 (&sc)[2], int j, int lane,
                                      uint32_t (&a)[4][2][4]) {
    const int c = lane & 3;
    uint4 wv[2];
    uint32_t f1[2], f2[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      wv[h] = lds128(slot + ((h * 2 + j) * 32 + lane) * 16);
      mxfp4_factors<kTwo>(((j ? sc[h].y : sc[h].x) >> (8 * c)) & 0xffu, f1[h], f2[h]);
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t pr[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) mxfp4_pairs<kTwo>(word(wv[h], w), f1[h], f2[h], pr[h]);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        a[w][s][0] = pr[0][2 * s];
        a[w][s][1] = pr[1][2 * s];
        a[w][s][2] = pr[0][2 * s + 1];
        a[w][s][3] = pr[1][2 * s + 1];
      }
    }
  }

  // (Warpgroup MMA) One chunk of this warp's 16 rows times the x tiles at x_tiles (shared
  // address of the chunk's first of 16 B tiles, wgmma_x_layout.h), into the
  // warpgroup's 64 x 8 NT accumulators: per half, dequantize (the two-multiply path where any
  // lane of this warp needs it: no wgmma inside the branch, so warps may differ), then 8 wgmma;
  // the second half is dequantized while the first half's wgmma run.
  template <int NT>
  __device__ static void compute_chunk_wg(float (&acc)[1][NT][4], const uint8_t* slot,
                                          uint32_t x_tiles, int lane) {
    uint2 sc[1][2];
    const bool big = load_scales<1>(slot, lane, sc);
    uint32_t a[2][4][2][4];  // [half j][word w][step s][fragment register]
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (big)
        dequant_half<true>(slot, sc[0], j, lane, a[j]);
      else
        dequant_half<false>(slot, sc[0], j, lane, a[j]);
      wgmma_fence();
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int s = 0; s < 2; ++s)
          WgmmaRs<NT>::run(acc[0], a[j][w][s],
                           wgmma_desc(x_tiles + wg_step(0, j, w, s) * wg_tile_bytes(NT),
                                      wg_lead_bytes(NT), kWgStrideBytes));
      wgmma_commit();
    }
    wgmma_wait<0>();
    // The asynchronous reads of a and writes of acc are complete only here: both stay pinned.
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) wgmma_keep(acc[0][t][e]);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
          for (int e = 0; e < 4; ++e) wgmma_keep(a[j][w][s][e]);
  }
};

// The same weights with x staged from glu(g, u) (SkinnyArgs::x_glu): its own kernel
// instantiations, so the plain GEMMs carry no activation code.
struct Mxfp4GluFormat : Mxfp4Format {
  static constexpr bool kGluInput = true;
};

}  // namespace
}  // namespace detail

using detail::Mxfp4Format;
using detail::Mxfp4GluFormat;

LinearPlan plan_linear_mxfp4(int m, int64_t n, int64_t k, int groups) {
  return detail::best_plan<Mxfp4Format>(LinearWeight::MXFP4, m, n, k, groups);
}

int linear_mxfp4_cluster_fit(const LinearPlan& p, int ctas_per_sm) {
  K3_CHECK(p.weight == LinearWeight::MXFP4, "linear_mxfp4_cluster_fit: plan is for another format");
  return detail::skinny_cluster_fit<Mxfp4Format>(p, ctas_per_sm);
}

std::vector<LinearPlan> linear_mxfp4_candidates(int m, int64_t n, int64_t k, int groups) {
  return linear_candidates(LinearWeight::MXFP4, m, n, k, groups, device_limits(),
                           detail::skinny_regs<Mxfp4Format>, 0,
                           detail::skinny_cluster_fit<Mxfp4Format>);
}

namespace {

void check_shape(const LinearPlan& p, const __nv_bfloat16* x, int64_t ldx, void* y, int64_t ldy) {
  K3_CHECK(p.weight == LinearWeight::MXFP4, "linear_mxfp4: plan is for another weight format");
  K3_CHECK(p.n >= 1 && p.k >= 32 && p.k % 32 == 0 && p.n <= 0x7fffffff && p.k <= 0x7fffffff,
           "linear_mxfp4: shape ", p.n, "x", p.k, " (K must be a multiple of 32)");
  K3_CHECK(x && y, "linear_mxfp4: null x or y");
  K3_CHECK(ldx >= p.k && ldy >= p.n, "linear_mxfp4: ldx ", ldx, " / ldy ", ldy, " below K ", p.k,
           " / N ", p.n);
  K3_CHECK(p.fallback || (p.k % 256 == 0 && ldx % 8 == 0 && detail::aligned16(x)),
           "linear_mxfp4: a tiled plan needs K % 256 == 0, ldx % 8 == 0 and a 16-byte aligned x");
}

detail::SkinnyArgs base_args(const LinearPlan& p, const __nv_bfloat16* x, int64_t ldx, void* y,
                             int64_t ldy, bool y_fp32, int m) {
  detail::SkinnyArgs a;
  a.x = x;
  a.ldx = ldx;
  a.y = y;
  a.ldy = ldy;
  a.y_fp32 = y_fp32 ? 1 : 0;
  a.m = m;
  a.n = static_cast<int>(p.n);
  a.k = static_cast<int>(p.k);
  return a;
}

// The grouped launch's arguments: x / y as base_args, the expert tables and slot arrays of g.
detail::SkinnyArgs grouped_args(const LinearPlan& p, const Mxfp4Grouped& g, const __nv_bfloat16* x,
                                int64_t ldx, void* y, int64_t ldy, bool y_fp32) {
  K3_CHECK(g.packed && g.scales && g.slot_expert && g.slot_offsets,
           "linear_mxfp4_grouped: null device table");
  detail::SkinnyArgs a = base_args(p, x, ldx, y, ldy, y_fp32, g.max_rows_per_slot);
  a.w_table = reinterpret_cast<const void* const*>(g.packed);
  a.ws_table = g.scales;
  a.slot_expert = g.slot_expert;
  a.slot_offsets = g.slot_offsets;
  a.row_index = g.row_index;
  a.slots_ready = g.slots_ready ? 1 : 0;
  return a;
}

}  // namespace

void linear_mxfp4(const LinearPlan& p, const __nv_bfloat16* x, int64_t ldx, const uint8_t* w_packed,
                  const uint8_t* w_scales, int64_t M, void* y, int64_t ldy, bool y_fp32,
                  cudaStream_t stream, long long* stamps) {
  check_shape(p, x, ldx, y, ldy);
  K3_CHECK(p.groups == 1, "linear_mxfp4: a grouped plan for a dense launch");
  K3_CHECK(M >= 1 && M <= 64 && M <= p.m, "linear_mxfp4: M = ", M, " for a plan of ", p.m);
  K3_CHECK(w_packed && w_scales, "linear_mxfp4: null weight");
  K3_CHECK(p.fallback ||
               (detail::aligned16(w_packed) && (reinterpret_cast<uintptr_t>(w_scales) & 7u) == 0),
           "linear_mxfp4: a tiled plan needs 16-byte aligned packed and 8-byte aligned scales");
  detail::SkinnyArgs a = base_args(p, x, ldx, y, ldy, y_fp32, static_cast<int>(M));
  a.w = w_packed;
  a.ws = w_scales;
  a.stamps = stamps;
  detail::launch_skinny<Mxfp4Format>(p, a, stream);
}

void linear_mxfp4(const __nv_bfloat16* x, int64_t ldx, const uint8_t* w_packed,
                  const uint8_t* w_scales, int64_t M, int64_t N, int64_t K, void* y, int64_t ldy,
                  bool y_fp32, cudaStream_t stream) {
  K3_CHECK(M >= 0 && N >= 1 && K >= 32 && K % 32 == 0, "linear_mxfp4: shape ", M, "x", N, "x", K);
  const bool tiled_ok = K % 256 == 0 && ldx % 8 == 0 && detail::aligned16(x) &&
                        detail::aligned16(w_packed) &&
                        (reinterpret_cast<uintptr_t>(w_scales) & 7u) == 0;
  const size_t ysize = y_fp32 ? 4 : 2;
  for (int64_t m0 = 0; m0 < M; m0 += 64) {
    const int m = static_cast<int>(std::min<int64_t>(64, M - m0));
    LinearPlan shape;  // for the operand checks only
    shape.weight = LinearWeight::MXFP4, shape.m = m, shape.n = N, shape.k = K;
    shape.fallback = !tiled_ok;
    check_shape(shape, x + m0 * ldx, ldx, y, ldy);
    K3_CHECK(w_packed && w_scales, "linear_mxfp4: null weight");
    detail::SkinnyArgs a = base_args(shape, x + m0 * ldx, ldx,
                                     static_cast<uint8_t*>(y) + m0 * ldy * ysize, ldy, y_fp32, m);
    a.w = w_packed;
    a.ws = w_scales;
    detail::launch_planned<Mxfp4Format>(LinearWeight::MXFP4, m, 1, tiled_ok, a, stream);
  }
}

void linear_mxfp4_grouped(const LinearPlan& p, const Mxfp4Grouped& g, const __nv_bfloat16* x,
                          int64_t ldx, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream) {
  check_shape(p, x, ldx, y, ldy);
  K3_CHECK(g.n_slots >= 1 && g.n_slots == p.groups, "linear_mxfp4_grouped: ", g.n_slots,
           " slots for a plan of ", p.groups);
  K3_CHECK(g.max_rows_per_slot >= 1 && g.max_rows_per_slot <= p.m,
           "linear_mxfp4_grouped: max_rows_per_slot ", g.max_rows_per_slot, " for a plan of ", p.m);
  detail::launch_skinny<Mxfp4Format>(p, grouped_args(p, g, x, ldx, y, ldy, y_fp32), stream);
}

void linear_mxfp4_grouped(const Mxfp4Grouped& g, const __nv_bfloat16* x, int64_t ldx, int64_t N,
                          int64_t K, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream) {
  K3_CHECK(N >= 1 && K >= 32 && K % 32 == 0, "linear_mxfp4_grouped: shape ", N, "x", K);
  K3_CHECK(g.n_slots >= 1 && g.max_rows_per_slot >= 1, "linear_mxfp4_grouped: ", g.n_slots,
           " slots, ", g.max_rows_per_slot, " rows per slot");
  const bool tiled_ok =
      g.max_rows_per_slot <= 64 && K % 256 == 0 && ldx % 8 == 0 && detail::aligned16(x);
  LinearPlan shape;  // for the operand checks only
  shape.weight = LinearWeight::MXFP4, shape.m = g.max_rows_per_slot, shape.n = N, shape.k = K;
  shape.groups = g.n_slots, shape.fallback = !tiled_ok;
  check_shape(shape, x, ldx, y, ldy);
  detail::launch_planned<Mxfp4Format>(LinearWeight::MXFP4, g.max_rows_per_slot, g.n_slots, tiled_ok,
                                      grouped_args(shape, g, x, ldx, y, ldy, y_fp32), stream,
                                      g.expected_active);
}

bool grouped_glu_supported(const Mxfp4Grouped& g, int64_t K, const float* gu, int64_t ld_gu,
                           int64_t up) {
  return g.max_rows_per_slot >= 1 && g.max_rows_per_slot <= 64 && K % 256 == 0 && gu &&
         detail::aligned16(gu) && ld_gu % 4 == 0 && up % 4 == 0 && ld_gu >= up + K;
}

void linear_mxfp4_grouped_glu(const Mxfp4Grouped& g, const float* gu, int64_t ld_gu, int64_t up,
                              const GluAct& act, int64_t N, int64_t K, void* y, int64_t ldy,
                              bool y_fp32, cudaStream_t stream) {
  K3_CHECK(N >= 1 && K >= 256 && N <= 0x7fffffff && K <= 0x7fffffff && g.n_slots >= 1,
           "linear_mxfp4_grouped_glu: shape ", N, "x", K, ", ", g.n_slots, " slots");
  K3_CHECK(grouped_glu_supported(g, K, gu, ld_gu, up),
           "linear_mxfp4_grouped_glu: needs <= 64 rows per slot, K % 256 == 0 and 16-byte aligned "
           "fp32 g / u rows");
  K3_CHECK(y && ldy >= N, "linear_mxfp4_grouped_glu: null y or ldy ", ldy, " below N ", N);
  LinearPlan shape;
  shape.weight = LinearWeight::MXFP4, shape.m = g.max_rows_per_slot, shape.n = N, shape.k = K;
  shape.groups = g.n_slots;
  detail::SkinnyArgs a = grouped_args(shape, g, nullptr, K, y, ldy, y_fp32);  // x unused
  a.x_glu = gu;
  a.ld_glu = ld_gu;
  a.glu_up = up;
  a.glu = act;
  detail::launch_planned<Mxfp4GluFormat>(LinearWeight::MXFP4, g.max_rows_per_slot, g.n_slots, true,
                                         a, stream, g.expected_active);
}

}  // namespace k3::cuda
