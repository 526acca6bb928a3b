// bf16 weights for the skinny GEMM (skinny_gemm.cuh). A chunk is 64 k of 16*MT rows: per
// thread, rows g and g+8 of each 16-row tile, two 16-byte pieces each (k 8c..8c+7 and
// 32+8c..32+8c+7): 4*MT cp.async per chunk, a warp covering 128 contiguous bytes of each row.
// Words 2s and 2s+1 of a piece are mma k-step s's a0/a2 (row g) or a1/a3 (row g+8); x is read
// with the same layout, so the k order inside a step is permuted identically on both sides.
#include "cuda/linear_bf16.h"

#include "core/error.h"
#include "cuda/device_util.cuh"
#include "cuda/linear_launch.cuh"

namespace k3::cuda {
namespace detail {
namespace {

struct Bf16Format {
  using PlanKey = Bf16Format;  // its plans (linear_launch.cuh: tuned_plans)
  static constexpr int kChunk = 64;
  static constexpr bool kXPermute = false;
  static constexpr bool kGluInput = false;
  static constexpr bool kWarpgroupMma = false;
  static constexpr __host__ __device__ int stage_bytes(int mt) { return 2048 * mt; }

  struct Dec {
    __device__ static float at(const void* W, const uint8_t*, int n, int k, int K) {
      return __bfloat162float(
          static_cast<const __nv_bfloat16*>(W)[static_cast<int64_t>(n) * K + k]);
    }
  };

  // slot: this warp's ring slot, [4*MT pieces][32 lanes] x 16 B; piece q = (i*2 + h)*2 + j.
  template <int MT>
  __device__ static void load_chunk(uint8_t* slot, const void* W, const uint8_t*, int N, int K,
                                    int row0, int chunk, int lane) {
    const __nv_bfloat16* w = static_cast<const __nv_bfloat16*>(W);  // [N, K]
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + i * 16 + h * 8 + g;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int k = chunk * kChunk + j * 32 + c * 8;
          const bool valid = row < N && k < K;
          const __nv_bfloat16* src = valid ? w + static_cast<int64_t>(row) * K + k : w;
          cp_async16(slot + (((i * 2 + h) * 2 + j) * 32 + lane) * 16, src, valid);
        }
      }
  }

  // acc[i][t]: rows 16i.. of this warp x tokens 8t..; xs: [mx][pitch] staged x, kloc: the
  // chunk's first k relative to the staged slice.
  template <int NT, int MT>
  __device__ static void compute_chunk(float (&acc)[MT][NT][4], const uint8_t* slot,
                                       const uint8_t* xs, int pitch, int kloc, int lane, int mx) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint4 wv[MT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wv[i][h] = lds128(slot + (((i * 2 + h) * 2 + j) * 32 + lane) * 16);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t * 8 >= mx) break;  // uniform: no token in this column tile
        // Token columns past mx read row mx - 1 (staged, finite): an mma column only feeds its
        // own output column, and those are never stored. No divergent branch per fragment.
        const int n = min(t * 8 + g, mx - 1);
        const uint4 b = lds128(xs + n * pitch + (kloc + j * 32 + c * 8) * 2);
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
          for (int i = 0; i < MT; ++i)
            mma_bf16_16816(acc[i][t], word(wv[i][0], 2 * s), word(wv[i][1], 2 * s),
                           word(wv[i][0], 2 * s + 1), word(wv[i][1], 2 * s + 1), word(b, 2 * s),
                           word(b, 2 * s + 1));
      }
    }
  }
};

}  // namespace
}  // namespace detail

using detail::Bf16Format;

LinearPlan plan_linear_bf16(int m, int64_t n, int64_t k) {
  return detail::best_plan<Bf16Format>(LinearWeight::BF16, m, n, k, 1);
}

std::vector<LinearPlan> linear_bf16_candidates(int m, int64_t n, int64_t k) {
  return linear_candidates(LinearWeight::BF16, m, n, k, 1, device_limits(),
                           detail::skinny_regs<Bf16Format>, 0,
                           detail::skinny_cluster_fit<Bf16Format>);
}

namespace {

detail::SkinnyArgs dense_args(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int m,
                              int64_t N, int64_t K, void* y, int64_t ldy, bool y_fp32,
                              const LinearEpilogue& epi) {
  detail::SkinnyArgs a;
  a.w = w;
  a.x = x;
  a.ldx = ldx;
  a.y = y;
  a.ldy = ldy;
  a.y_fp32 = y_fp32 ? 1 : 0;
  a.add = epi.add;
  a.res = epi.res;
  a.res_copy = epi.res_copy ? 1 : 0;
  a.m = m;
  a.n = static_cast<int>(N);
  a.k = static_cast<int>(K);
  return a;
}

}  // namespace

void linear_bf16(const LinearPlan& p, const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w,
                 int64_t M, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream,
                 long long* stamps) {
  K3_CHECK(p.weight == LinearWeight::BF16, "linear_bf16: plan is for another weight format");
  K3_CHECK(M >= 1 && M <= 64 && M <= p.m, "linear_bf16: M = ", M, " for a plan of ", p.m);
  K3_CHECK(p.n >= 1 && p.k >= 1 && p.n <= 0x7fffffff && p.k <= 0x7fffffff, "linear_bf16: shape ",
           p.n, "x", p.k);
  K3_CHECK(x && w && y, "linear_bf16: null pointer");
  K3_CHECK(ldx >= p.k && ldy >= p.n, "linear_bf16: ldx ", ldx, " / ldy ", ldy, " below K ", p.k,
           " / N ", p.n);
  const bool tiled_ok =
      p.k % 8 == 0 && ldx % 8 == 0 && detail::aligned16(x) && detail::aligned16(w);
  K3_CHECK(p.fallback || tiled_ok,
           "linear_bf16: a tiled plan needs K % 8 == 0, ldx % 8 == 0 and "
           "16-byte aligned x and w");
  detail::SkinnyArgs a = dense_args(x, ldx, w, static_cast<int>(M), p.n, p.k, y, ldy, y_fp32, {});
  a.stamps = stamps;
  detail::launch_skinny<Bf16Format>(p, a, stream);
}

namespace {

void linear_bf16_impl(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int64_t M,
                      int64_t N, int64_t K, void* y, int64_t ldy, bool y_fp32,
                      const LinearEpilogue& epi, cudaStream_t stream) {
  K3_CHECK(M >= 0 && N >= 1 && K >= 1, "linear_bf16: shape ", M, "x", N, "x", K);
  const bool tiled_ok = K % 8 == 0 && ldx % 8 == 0 && detail::aligned16(x) && detail::aligned16(w);
  const size_t ysize = y_fp32 ? 4 : 2;
  K3_CHECK(x && w && y, "linear_bf16: null pointer");
  K3_CHECK(ldx >= K && ldy >= N && N <= 0x7fffffff && K <= 0x7fffffff, "linear_bf16: ldx ", ldx,
           " / ldy ", ldy, " for ", N, "x", K);
  for (int64_t m0 = 0; m0 < M; m0 += 64) {
    const int m = static_cast<int>(std::min<int64_t>(64, M - m0));
    LinearEpilogue part = epi;
    part.add = epi.add ? epi.add + m0 * ldy : nullptr;
    part.res = epi.res ? epi.res + m0 * ldy : nullptr;
    const detail::SkinnyArgs a =
        dense_args(x + m0 * ldx, ldx, w, m, N, K, static_cast<uint8_t*>(y) + m0 * ldy * ysize, ldy,
                   y_fp32, part);
    detail::launch_planned<Bf16Format>(LinearWeight::BF16, m, 1, tiled_ok, a, stream);
  }
}

}  // namespace

namespace {

// c fits the GEMV's combined input (gemv_bf16.h) with these operands.
bool combined_fits(const CombinedInput& c, const __nv_bfloat16* w, int64_t M, int64_t K) {
  return M >= 1 && M <= kGemvMaxRows && detail::gemv_takes_combined(K, c.top_k) &&
         detail::aligned16(w) && detail::aligned16(c.y) &&
         (!c.norm_w || detail::aligned16(c.norm_w));
}

void set_combined(detail::SkinnyArgs& a, const CombinedInput& c) {
  a.combine_y = c.y;
  a.combine_pos = c.y_pos;
  a.combine_w = c.weights;
  a.combine_norm = c.norm_w;
  a.combine_eps = c.eps;
  a.combine_k = c.top_k;
}

}  // namespace

void linear_bf16_combined(const LinearPlan& p, const CombinedInput& c, const __nv_bfloat16* w,
                          int64_t M, __nv_bfloat16* y, int64_t ldy, cudaStream_t stream) {
  K3_CHECK(p.weight == LinearWeight::BF16 && p.gemv() && M <= p.m && ldy >= p.n,
           "linear_bf16_combined: plan ", p.str(), " for ", M, " rows, ldy ", ldy);
  K3_CHECK(w && y && c.y && c.weights, "linear_bf16_combined: null pointer");
  K3_CHECK(combined_fits(c, w, M, p.k), "linear_bf16_combined: ", M, " rows of width ", p.k,
           " over ", c.top_k, " choices do not fit the GEMV's combined input");
  detail::SkinnyArgs a = dense_args(nullptr, p.k, w, static_cast<int>(M), p.n, p.k, y, ldy,
                                    /*y_fp32=*/false, {});
  set_combined(a, c);
  detail::launch_skinny<Bf16Format>(p, a, stream);
}

bool linear_bf16_combined(const CombinedInput& c, const __nv_bfloat16* x, const __nv_bfloat16* w,
                          int64_t M, int64_t N, int64_t K, __nv_bfloat16* y, int64_t ldy,
                          const LinearEpilogue& epi, cudaStream_t stream) {
  K3_CHECK(M >= 1 && N >= 1 && K >= 1 && N <= 0x7fffffff && K <= 0x7fffffff && ldy >= N,
           "linear_bf16_combined: shape ", M, "x", N, "x", K, " ldy ", ldy);
  K3_CHECK(x && w && y && c.y && c.weights, "linear_bf16_combined: null pointer");
  if (!combined_fits(c, w, M, K) || !detail::aligned16(x)) return false;
  detail::SkinnyArgs a =
      dense_args(x, K, w, static_cast<int>(M), N, K, y, ldy, /*y_fp32=*/false, epi);
  const LinearPlan p = detail::planned<Bf16Format>(LinearWeight::BF16, static_cast<int>(M), 1,
                                                   /*tiled_ok=*/true, a, stream);
  if (!p.gemv()) return false;
  set_combined(a, c);
  detail::launch_skinny<Bf16Format>(p, a, stream);
  return true;
}

void linear_bf16(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int64_t M, int64_t N,
                 int64_t K, void* y, int64_t ldy, bool y_fp32, cudaStream_t stream) {
  linear_bf16_impl(x, ldx, w, M, N, K, y, ldy, y_fp32, {}, stream);
}

void linear_bf16(const __nv_bfloat16* x, int64_t ldx, const __nv_bfloat16* w, int64_t M, int64_t N,
                 int64_t K, __nv_bfloat16* y, int64_t ldy, const LinearEpilogue& epi,
                 cudaStream_t stream) {
  linear_bf16_impl(x, ldx, w, M, N, K, y, ldy, false, epi, stream);
}

}  // namespace k3::cuda
