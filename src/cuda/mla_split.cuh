// The pieces both MLA split kernels share (mla_split_fp32.cu on CUDA cores, the default;
// mla_split_mma.cu on tensor cores, MlaDecodePlan::tensor_cores): K3's latent shape, a CTA's
// token range (which the combine derives again from the row's length), the tile copies through
// the page table, the query load, and the launch arguments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/device_util.cuh"
#include "cuda/mma.cuh"

namespace k3::cuda::detail::mla {

constexpr int kKvLora = 512;
constexpr int kRope = 64;
constexpr int kD = kKvLora + kRope;  // 576 values per cached token
constexpr int kChunks = kD / 8;      // 72 16-byte chunks per cache row
constexpr int kTile = 32;            // cache rows per shared-memory tile
constexpr int kMaxHeads = 16;        // heads per CTA
constexpr int kThreads = 256;
constexpr int kTileCopies = kTile * kChunks / kThreads;  // 16-byte copies per thread per tile
static_assert(kTile * kChunks % kThreads == 0, "a tile is whole rounds of copies");
constexpr int kRingDeepest = 5;  // tiles of the deepest ring that fits an SM's shared memory
constexpr int kQCopies = (kMaxHeads * kChunks + kThreads - 1) / kThreads;  // q: 16 B per copy

// Tokens per split of a row with n tokens: equal ranges in whole tiles, at least kMinSplit (one
// tile: at 1k tokens, 32 CTAs of one tile each took 18.1 us against 26.7 us for 16 CTAs of two,
// H6, one row, H200). Splits from ceil(n / chunk) on are empty; the split and the combine kernels
// both derive the active count from n on the device.
constexpr int kMinSplit = kTile;
__device__ __forceinline__ int split_tokens(int n, int splits) {
  const int per = ((n + splits - 1) / splits + kTile - 1) / kTile * kTile;
  return max(kMinSplit, per);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Queries, the cache, page tables, lengths, selections and the split partials: no __restrict__
// (PDL: their producer may still run when a kernel starts, so no ld.global.nc; see mma.cuh
// ld_act128).
struct SplitArgs {
  const __nv_bfloat16* q_abs;  // [rows][heads][512] bf16
  const __nv_bfloat16* q_pe;   // [rows][heads][64] bf16
  const __nv_bfloat16* cache;  // [pages][page_size][576] bf16
  const int32_t* block_table;  // [rows][max_pages] page ids
  const int32_t* seq_len;      // [rows] cached tokens
  const int32_t* selected;     // [rows][max_sel] token positions, or null (dense)
  const int32_t* n_selected;   // [rows]
  int heads, hpg, page_size, max_pages, max_sel;
  float scale;
  float* ws_acc;  // [rows][heads][splits][512] fp32: unnormalised sum p c per split
  float* ws_ml;   // [rows][heads][splits][2] fp32: running max and sum per split
};

// The token range [beg, end) of split `split` of `row`, and that row's page table and selection.
struct SplitRange {
  int beg, end;
  const int32_t* bt;   // [max_pages]
  const int32_t* sel;  // [max_sel] or null
};
__device__ __forceinline__ SplitRange split_range(const SplitArgs& a, int row, int split,
                                                  int splits) {
  SplitRange r;
  r.sel = a.selected ? a.selected + static_cast<int64_t>(row) * a.max_sel : nullptr;
  r.bt = a.block_table + static_cast<int64_t>(row) * a.max_pages;
  const int n = max(0, r.sel ? a.n_selected[row] : a.seq_len[row]);
  const int chunk = split_tokens(n, splits);
  r.beg = min(n, split * chunk);
  r.end = min(n, r.beg + chunk);
  return r;
}

// Tokens t0 .. t0 + kTile - 1 of the range into dst [kTile][kStride] bf16: the rows' page-table
// entries (and selections) in one batch, then the 16-byte copies, one commit group. Rows past the
// range are zero-filled.
template <int kStride>
__device__ __forceinline__ void issue_tile(const SplitArgs& a, const SplitRange& r,
                                           __nv_bfloat16* dst, int t0, int tid) {
  const int nt = min(kTile, r.end - t0);
#pragma unroll
  for (int j = 0; j < kTileCopies; ++j) {
    const int i = tid + j * kThreads;
    const int row = i / kChunks, c = i % kChunks;
    const bool ok = row < nt;
    const int pos = ok ? (r.sel ? r.sel[t0 + row] : t0 + row) : 0;
    const int64_t page = ok ? r.bt[pos / a.page_size] : 0;
    const __nv_bfloat16* src = a.cache + (page * a.page_size + pos % a.page_size) * kD + c * 8;
    cp_async16(dst + row * kStride + c * 8, ok ? src : a.cache, ok);
  }
  cp_async_commit();
}

// q (q_abs then q_pe) of heads h0 .. h0 + hg - 1 of `row` into qs [rows_out][kStride] bf16, rows
// hg .. rows_out - 1 zero: every 16-byte load first, then the stores.
template <int kStride>
__device__ __forceinline__ void load_q(const SplitArgs& a, int row, int h0, int hg, int rows_out,
                                       __nv_bfloat16* qs, int tid) {
  uint4 qv[kQCopies];
#pragma unroll
  for (int j = 0; j < kQCopies; ++j) {
    const int i = tid + j * kThreads;
    const int h = i / kChunks, c = i % kChunks;
    qv[j] = make_uint4(0, 0, 0, 0);
    if (h < hg) {
      const int64_t qh = static_cast<int64_t>(row) * a.heads + h0 + h;
      qv[j] = c < kKvLora / 8 ? ld_act128(a.q_abs + qh * kKvLora + c * 8)
                              : ld_act128(a.q_pe + qh * kRope + (c - kKvLora / 8) * 8);
    }
  }
#pragma unroll
  for (int j = 0; j < kQCopies; ++j) {
    const int i = tid + j * kThreads;
    const int h = i / kChunks, c = i % kChunks;
    if (h < rows_out) *reinterpret_cast<uint4*>(qs + h * kStride + c * 8) = qv[j];
  }
}

// A ring of kStages tiles (kStages - 1 in flight while one is used): the first kStages - 1
// tiles of the range go out, one commit group each (empty past the range).
template <int kStride, int kStages>
__device__ __forceinline__ void ring_start(const SplitArgs& a, const SplitRange& r,
                                           __nv_bfloat16* tiles, int tid) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const int t0 = r.beg + s * kTile;
    if (t0 < r.end)
      issue_tile<kStride>(a, r, tiles + s * kTile * kStride, t0, tid);
    else
      cp_async_commit();  // an empty group keeps the wait count uniform
  }
}

// The start of a tile step: the tile kStages - 1 ahead goes out (into the slot the previous step
// finished with), then this tile's copies (in tiles[buf]) have landed, for the whole CTA.
template <int kStride, int kStages>
__device__ __forceinline__ void tile_ready(const SplitArgs& a, const SplitRange& r,
                                           __nv_bfloat16* tiles, int buf, int t0, int tid) {
  const int ahead = t0 + (kStages - 1) * kTile;
  if (ahead < r.end)
    issue_tile<kStride>(a, r, tiles + (buf + kStages - 1) % kStages * kTile * kStride, ahead, tid);
  else
    cp_async_commit();
  cp_async_wait<kStages - 1>();
  __syncthreads();
}

// One head's online-softmax step over a tile, one warp, lane = token, s = -inf where the tile
// has no token: returns the lane's p = exp(s - new max); lane 0 updates the head's running max
// and sum and the factor a that rescales its accumulators.
__device__ __forceinline__ float softmax_step(float s, float* m_s, float* l_s, float* a_s, int h,
                                              int lane) {
  const float mo = m_s[h], mn = fmaxf(mo, warp_max(s));
  // mn is finite here: every tile holds at least one valid token.
  const float p = s == -INFINITY ? 0.0f : expf(s - mn);
  const float al = mo == -INFINITY ? 0.0f : expf(mo - mn);
  const float sum = warp_sum(p);
  if (lane == 0) {
    l_s[h] = l_s[h] * al + sum;
    m_s[h] = mn;
    a_s[h] = al;
  }
  return p;
}

// The group's running max and sum per head into ws_ml, where the combine reads them.
__device__ __forceinline__ void store_ml(const SplitArgs& a, int row, int h0, int hg, int split,
                                         int splits, const float* m_s, const float* l_s, int tid) {
  if (tid < hg) {
    const int64_t slot = (static_cast<int64_t>(row) * a.heads + h0 + tid) * splits + split;
    a.ws_ml[slot * 2] = m_s[tid];
    a.ws_ml[slot * 2 + 1] = l_s[tid];
  }
}

// grid (splits, head groups, rows), kThreads threads; both raise k3::Error on a failed launch.
// ring_tiles: the tensor-core kernel's tile ring, 2 (two CTAs per SM), 4 or kRingDeepest (one CTA
// per SM; MlaDecodePlan::ring_tiles).
void launch_split_fp32(const SplitArgs& a, dim3 grid, cudaStream_t stream);
void launch_split_mma(const SplitArgs& a, dim3 grid, int ring_tiles, cudaStream_t stream);

}  // namespace k3::cuda::detail::mla
