// DSA top-k (dsa_topk in dsa_indexer.h) over many CTAs per row, so a long row no longer waits on
// one SM: the one-CTA radix select (kept below, split = false) takes 284 us at 131072 tokens on an
// H100, 60 us at 32768; this one 26 and 19 us (bench/RESULTS.md, twenty-first stop).
//
// Two kernels over chunks of kChunk scores (grid: chunks x rows), both reading the scores once:
//  1. histogram: each chunk counts its scores' top 11 key bits in shared memory and adds the
//     non-zero bins to the row's histogram; the chunk that arrives last finds the threshold bin
//     (the bin of the m-th largest score) and the count above it, and zeroes the histogram.
//  2. select: each chunk writes the bitmap words of its scores above the threshold bin (one
//     ballot per warp) and appends the indices of those in it to the row's candidate list; the
//     chunk that arrives last picks the candidates it needs by a radix select over a composite
//     of the key's 21 low bits and the inverted index (all distinct; a tie goes to the lower
//     index, as cpu::dsa_topk), sets their bits, then writes the set bits' indices in ascending
//     order, zeroing the bitmap as it reads it.
// The workspace starts zeroed and every call leaves it so. Per-row lengths come from the device,
// the grid from host bounds; no host sync, so the launches stay valid inside a captured graph.
#include <cstdint>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/dsa_indexer.h"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kChunk = 2048;  // scores per CTA
constexpr int kPerThread = kChunk / kThreads;
constexpr int kBins = 2048;  // one per value of a key's top 11 bits (sign, exponent, 2 mantissa)
constexpr int kBinShift = 21;
constexpr int kBinsPerThread = kBins / kThreads;
constexpr uint32_t kLowKeyMask = (1u << kBinShift) - 1u;
constexpr int kCtrlWords = 8;
constexpr int kCachedCandidates = 4096;  // 32 KB of shared memory in the select kernel
static_assert(kBinsPerThread == 8 && kChunk % 32 == 0);

// Control words of a row: arrivals of kernel 1 and 2, candidates appended, threshold bin and the
// count of scores above it (the last two written by kernel 1 for kernel 2; the rest back to 0).
enum Ctrl { kHistArrived = 0, kSelectArrived = 1, kCandidates = 2, kThresholdBin = 3, kAbove = 4 };

__host__ __device__ int64_t bitmap_words(int64_t stride) {
  return (stride + 31) / 32;
}
// Per row: hist [kBins] u32, ctrl [kCtrlWords] u32, bitmap [bitmap_words] u32, candidates
// [stride] int32.
__host__ __device__ int64_t row_words(int64_t stride) {
  return kBins + kCtrlWords + bitmap_words(stride) + stride;
}

struct RowWorkspace {
  uint32_t* hist;    // [kBins]
  uint32_t* ctrl;    // [kCtrlWords]
  uint32_t* bitmap;  // [ceil(stride / 32)]: bit i of word w = score 32 w + i is selected
  int32_t* cand;     // [stride]: indices of the scores in the threshold bin, unordered
};

__device__ RowWorkspace row_workspace(uint32_t* ws, int64_t r, int64_t stride) {
  uint32_t* p = ws + r * row_words(stride);
  return {p, p + kBins, p + kBins + kCtrlWords,
          reinterpret_cast<int32_t*>(p + kBins + kCtrlWords + bitmap_words(stride))};
}

struct RowExtent {
  int T;  // scores of the row
  int m;  // how many to select
  int chunks;
};

__device__ RowExtent row_extent(const int32_t* seq_len, int64_t r, int64_t stride, int topk) {
  const int T = static_cast<int>(min(static_cast<int64_t>(max(seq_len[r], 0)), stride));
  return {T, min(topk, T), (T + kChunk - 1) / kChunk};
}

// Order-preserving bits: a larger float gives a larger key; -0 is taken as +0 (equal scores).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Within a threshold bin: the key's low bits, then the inverted index, so the larger composite
// is the one cpu::dsa_topk prefers.
__device__ __forceinline__ uint64_t composite(uint32_t key, int idx) {
  return (static_cast<uint64_t>(key & kLowKeyMask) << 32) | static_cast<uint32_t>(~idx);
}

// Exclusive prefix of v over the CTA in thread order; *total gets the CTA's sum.
// scratch: >= 33 ints of shared memory; called by every thread.
__device__ int block_exclusive_sum(int v, int* scratch, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += n;
  }
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const int w = lane < nwarps ? scratch[lane] : 0;
    int winc = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, winc, o);
      if (lane >= o) winc += n;
    }
    scratch[lane] = winc - w;  // exclusive prefix of the warp totals
    if (lane == 31) scratch[32] = winc;
  }
  __syncthreads();
  const int r = scratch[warp] + inc - v;
  *total = scratch[32];
  __syncthreads();  // scratch is reused by the next call
  return r;
}

// Thread t holds the counts of bins 8t..8t+7 (threads past the histogram hold zeros). Finds the
// bin of the target-th largest key (counting from the top bin) and how many keys lie in higher
// bins, into found[0] and found[1].
// 1 <= target <= the histogram's total; called by every thread.
__device__ void threshold_bin(const uint32_t (&own)[kBinsPerThread], int target, int* scratch,
                              int* found) {
  int sum = 0;
#pragma unroll
  for (int b = 0; b < kBinsPerThread; ++b) sum += static_cast<int>(own[b]);
  int total;
  const int above = [&] {
    const int below = block_exclusive_sum(sum, scratch, &total);
    return total - below - sum;  // in the bins of higher threads
  }();
  if (above < target && target <= above + sum) {  // exactly one thread
    int acc = above, b = kBinsPerThread - 1;
    while (acc + static_cast<int>(own[b]) < target) acc += static_cast<int>(own[b--]);
    found[0] = kBinsPerThread * static_cast<int>(threadIdx.x) + b;
    found[1] = acc;
  }
  __syncthreads();
}

// Signals this CTA's arrival at *counter (its writes made visible first); true in every thread of
// the CTA that arrives last of `expected`, which then sees all the others' writes.
__device__ bool arrive_last(uint32_t* counter, int expected, bool* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(counter, 1u) == static_cast<uint32_t>(expected - 1);
  __syncthreads();
  if (*flag) __threadfence();
  return *flag;
}

__global__ void __launch_bounds__(kThreads)
    topk_histogram_kernel(const float* scores, int64_t stride, const int32_t* seq_len, int topk,
                          uint32_t* ws) {
  K3_PDL_ENTRY();
  __shared__ uint32_t hist[kBins];
  __shared__ int scratch[33];
  __shared__ int found[2];
  __shared__ bool last;
  const int64_t r = blockIdx.y;
  const RowExtent e = row_extent(seq_len, r, stride, topk);
  const int t0 = static_cast<int>(blockIdx.x) * kChunk;
  if (e.m == 0 || e.m == e.T || t0 >= e.T) return;  // nothing to rank here (kernel 2 agrees)
  const RowWorkspace w = row_workspace(ws, r, stride);
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  float v[kPerThread];  // [kPerThread] scores t0 + j * kThreads + tid
  const float* sc = scores + r * stride;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = t0 + j * kThreads + static_cast<int>(threadIdx.x);
    v[j] = i < e.T ? sc[i] : 0.0f;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kPerThread; ++j)
    if (t0 + j * kThreads + static_cast<int>(threadIdx.x) < e.T)
      atomicAdd(&hist[order_key(v[j]) >> kBinShift], 1u);
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads)
    if (hist[b] != 0) atomicAdd(&w.hist[b], hist[b]);
  if (!arrive_last(&w.ctrl[kHistArrived], e.chunks, &last)) return;

  uint32_t own[kBinsPerThread];
#pragma unroll
  for (int b = 0; b < kBinsPerThread; ++b) {
    uint32_t* bin = &w.hist[kBinsPerThread * threadIdx.x + b];
    own[b] = __ldcg(bin);
    *bin = 0;  // left zeroed for the next call
  }
  threshold_bin(own, e.m, scratch, found);
  if (threadIdx.x == 0) {
    w.ctrl[kThresholdBin] = static_cast<uint32_t>(found[0]);
    w.ctrl[kAbove] = static_cast<uint32_t>(found[1]);
    w.ctrl[kHistArrived] = 0;
  }
}

// The last CTA of a row: picks `need` of the row's candidates, sets their bits, writes the
// selection in ascending order and leaves the bitmap and counters zeroed.
// cache: [kCachedCandidates] shared; holds the candidates' composites when they fit, so the
// passes below gather each score once (a pass over ~1000 gathered candidates costs ~5 us of
// dependent L2 round trips) instead of once per pass.
__device__ void finish_row(const float* sc, const RowExtent& e, const RowWorkspace& w, int32_t* out,
                           uint32_t* hist, uint64_t* cache, int* scratch, int* found) {
  const int C = static_cast<int>(__ldcg(&w.ctrl[kCandidates]));
  int remaining = e.m - static_cast<int>(__ldcg(&w.ctrl[kAbove]));  // 1 <= remaining <= C
  const bool cached = C <= kCachedCandidates;
  if (cached) {
    constexpr int kBatch = 8;  // gathers in flight per thread
    for (int c0 = 0; c0 < C; c0 += kBatch * kThreads) {
      int idx[kBatch];
      float v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int c = c0 + u * kThreads + static_cast<int>(threadIdx.x);
        idx[u] = c < C ? __ldcg(&w.cand[c]) : 0;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        v[u] = c0 + u * kThreads + static_cast<int>(threadIdx.x) < C ? sc[idx[u]] : 0.0f;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int c = c0 + u * kThreads + static_cast<int>(threadIdx.x);
        if (c < C) cache[c] = composite(order_key(v[u]), idx[u]);
      }
    }
    __syncthreads();
  }
  const auto candidate = [&](int c) {
    if (cached) return cache[c];
    const int idx = __ldcg(&w.cand[c]);
    return composite(order_key(sc[idx]), idx);
  };
  // Radix select of the remaining-th largest composite, 11 bits at a time from the top (53 bits),
  // until the bin it falls in is taken whole; every candidate whose masked composite is at least
  // the prefix is then selected.
  uint64_t prefix = 0, mask = 0;
  if (remaining < C) {
    for (int shift = 42;; shift = shift > 11 ? shift - 11 : 0) {
      for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
      __syncthreads();
      for (int c = threadIdx.x; c < C; c += kThreads) {
        const uint64_t k = candidate(c);
        if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & (kBins - 1)], 1u);
      }
      __syncthreads();
      uint32_t own[kBinsPerThread];
#pragma unroll
      for (int b = 0; b < kBinsPerThread; ++b) own[b] = hist[kBinsPerThread * threadIdx.x + b];
      threshold_bin(own, remaining, scratch, found);
      prefix |= static_cast<uint64_t>(found[0]) << shift;
      mask |= static_cast<uint64_t>(kBins - 1) << shift;
      remaining -= found[1];
      if (static_cast<int>(hist[found[0]]) == remaining || shift == 0) break;
      __syncthreads();  // hist is cleared by the next pass
    }
  }
  for (int c = threadIdx.x; c < C; c += kThreads) {
    const uint64_t k = candidate(c);
    const int idx = static_cast<int>(~static_cast<uint32_t>(k));
    if ((k & mask) >= prefix) atomicOr(&w.bitmap[idx >> 5], 1u << (idx & 31));
  }
  __threadfence();
  __syncthreads();

  // Ascending compaction of the bitmap: thread t reads words [t per, (t + 1) per).
  const int words = (e.T + 31) / 32;
  const int per = (words + kThreads - 1) / kThreads;
  const int w0 = min(words, static_cast<int>(threadIdx.x) * per), w1 = min(words, w0 + per);
  int n = 0;
  for (int i = w0; i < w1; ++i) n += __popc(__ldcg(&w.bitmap[i]));
  int total;
  int at = block_exclusive_sum(n, scratch, &total);
  for (int i = w0; i < w1; ++i) {
    uint32_t bits = __ldcg(&w.bitmap[i]);
    w.bitmap[i] = 0;
    while (bits != 0) {
      const int b = __ffs(bits) - 1;
      if (at < e.m) out[at] = 32 * i + b;  // exactly m bits are set; the guard keeps out in bounds
      ++at;
      bits &= bits - 1u;
    }
  }
  if (threadIdx.x == 0) {
    w.ctrl[kSelectArrived] = 0;
    w.ctrl[kCandidates] = 0;
  }
}

__global__ void __launch_bounds__(kThreads)
    topk_select_kernel(const float* scores, int64_t stride, const int32_t* seq_len, int topk,
                       int32_t* __restrict__ selected, int32_t* __restrict__ n_selected,
                       uint32_t* ws) {
  K3_PDL_ENTRY();
  __shared__ uint32_t hist[kBins];
  __shared__ int scratch[33];
  __shared__ int found[2];
  __shared__ int cta_base;
  __shared__ bool last;
  __shared__ uint64_t cache[kCachedCandidates];  // the last CTA's candidates (finish_row)
  const int64_t r = blockIdx.y;
  const RowExtent e = row_extent(seq_len, r, stride, topk);
  const int t0 = static_cast<int>(blockIdx.x) * kChunk;
  int32_t* out = selected + r * static_cast<int64_t>(topk);  // [topk]
  if (blockIdx.x == 0) {
    for (int i = e.m + threadIdx.x; i < topk; i += kThreads) out[i] = -1;
    if (threadIdx.x == 0) n_selected[r] = e.m;
  }
  if (e.m == 0 || t0 >= e.T) return;
  if (e.m == e.T) {  // everything is selected, in order
    for (int i = t0 + threadIdx.x; i < min(e.T, t0 + kChunk); i += kThreads) out[i] = i;
    return;
  }
  const RowWorkspace w = row_workspace(ws, r, stride);
  const uint32_t bin = __ldcg(&w.ctrl[kThresholdBin]);  // kernel 1 has completed
  const float* sc = scores + r * stride;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t cand_bits = 0;  // bit j: score t0 + j * kThreads + tid is a candidate
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = t0 + j * kThreads + static_cast<int>(threadIdx.x);
    const uint32_t hi = i < e.T ? order_key(sc[i]) >> kBinShift : 0u;
    const bool valid = i < e.T;
    const uint32_t above = __ballot_sync(0xffffffffu, valid && hi > bin);
    const int first = t0 + j * kThreads + 32 * warp;             // a multiple of 32
    if (lane == 0 && first < e.T) w.bitmap[first >> 5] = above;  // this warp's word alone
    if (valid && hi == bin) cand_bits |= 1u << j;
  }
  int n_cta;
  const int at = block_exclusive_sum(__popc(cand_bits), scratch, &n_cta);
  if (threadIdx.x == 0)
    cta_base = n_cta > 0 ? static_cast<int>(atomicAdd(&w.ctrl[kCandidates], n_cta)) : 0;
  __syncthreads();
  int k = cta_base + at;
  for (int j = 0; j < kPerThread; ++j)
    if (cand_bits & (1u << j)) w.cand[k++] = t0 + j * kThreads + static_cast<int>(threadIdx.x);
  if (!arrive_last(&w.ctrl[kSelectArrived], e.chunks, &last)) return;
  finish_row(sc, e, w, out, hist, cache, scratch, found);
}

// ---- one CTA per row (the earlier kernel; K3_DSA_TOPK_SPLIT=0) ----

constexpr int kOneCtaThreads = 1024;
constexpr int kOneCtaBins = 256;  // one per value of a key byte

__global__ void __launch_bounds__(kOneCtaThreads)
    topk_one_cta_kernel(const float* scores, int64_t stride, const int32_t* seq_len, int topk,
                        int32_t* __restrict__ selected, int32_t* __restrict__ n_selected) {
  K3_PDL_ENTRY();
  __shared__ uint32_t hist[kOneCtaBins];
  __shared__ int scratch[33];
  __shared__ int found[2];
  const int64_t r = blockIdx.x;
  const float* sc = scores + r * stride;  // [T]
  int32_t* out = selected + r * static_cast<int64_t>(topk);
  const RowExtent e = row_extent(seq_len, r, stride, topk);
  const int T = e.T, m = e.m;
  for (int i = m + threadIdx.x; i < topk; i += blockDim.x) out[i] = -1;
  if (threadIdx.x == 0) n_selected[r] = m;
  if (m == 0) return;
  if (m == T) {  // everything is selected, in order
    for (int i = threadIdx.x; i < T; i += blockDim.x) out[i] = i;
    return;
  }

  // Radix select, most significant byte first: after the pass at `shift`, prefix holds the
  // top bytes of the m-th largest key and remaining how many keys equal to it (so far) to take.
  uint32_t prefix = 0, mask = 0;
  int remaining = m;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kOneCtaBins; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    // (Warp-aggregating same-bin adds with __match_any_sync measured slower: 257 vs 216 us.)
    for (int i = threadIdx.x; i < T; i += blockDim.x) {
      const uint32_t k = order_key(sc[i]);
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & (kOneCtaBins - 1)], 1u);
    }
    __syncthreads();
    uint32_t own[kBinsPerThread] = {};  // the first 32 threads own the bins, 8 each
    if (threadIdx.x < kOneCtaBins / kBinsPerThread)
#pragma unroll
      for (int b = 0; b < kBinsPerThread; ++b) own[b] = hist[kBinsPerThread * threadIdx.x + b];
    threshold_bin(own, remaining, scratch, found);
    prefix |= static_cast<uint32_t>(found[0]) << shift;
    remaining -= found[1];
    mask |= static_cast<uint32_t>(kOneCtaBins - 1) << shift;
    __syncthreads();  // hist and found are rewritten by the next pass
  }

  // Ordered compaction: keys above the threshold, and the first `remaining` equal ones.
  int base_out = 0, base_eq = 0;
  for (int c0 = 0; c0 < T; c0 += blockDim.x) {
    const int i = c0 + threadIdx.x;
    const uint32_t k = i < T ? order_key(sc[i]) : 0u;
    const bool eq = i < T && k == prefix;
    int n_eq;
    const int eq_rank = base_eq + block_exclusive_sum(eq ? 1 : 0, scratch, &n_eq);
    const bool take = i < T && (k > prefix || (eq && eq_rank < remaining));
    int n_take;
    const int at = base_out + block_exclusive_sum(take ? 1 : 0, scratch, &n_take);
    if (take) out[at] = i;
    base_out += n_take;
    base_eq += n_eq;
  }
}

}  // namespace

size_t dsa_topk_workspace_bytes(int64_t rows, int64_t stride, int topk) {
  (void)topk;
  K3_CHECK(rows >= 0 && stride >= 0, "dsa_topk_workspace_bytes: bad rows=", rows,
           " stride=", stride);
  return static_cast<size_t>(rows) * static_cast<size_t>(row_words(stride)) * sizeof(uint32_t);
}

void dsa_topk(const float* scores, int64_t stride, const int32_t* seq_len, int64_t rows, int topk,
              int32_t* selected, int32_t* n_selected, void* workspace, bool split,
              cudaStream_t stream) {
  K3_CHECK(rows >= 0 && rows <= 65535 && topk >= 1 && stride >= 0 && stride <= 0x7fffffff,
           "dsa_topk: bad rows=", rows, " topk=", topk, " stride=", stride);
  if (rows == 0) return;
  if (!split) {
    topk_one_cta_kernel<<<static_cast<unsigned>(rows), kOneCtaThreads, 0, stream>>>(
        scores, stride, seq_len, topk, selected, n_selected);
    K3_CUDA_CHECK_LAUNCH();
    return;
  }
  K3_CHECK(workspace != nullptr,
           "dsa_topk: a zeroed workspace of dsa_topk_workspace_bytes() bytes is required");
  const int64_t chunks = stride > 0 ? (stride + kChunk - 1) / kChunk : 1;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(rows));
  auto* ws = static_cast<uint32_t*>(workspace);
  topk_histogram_kernel<<<grid, kThreads, 0, stream>>>(scores, stride, seq_len, topk, ws);
  K3_CUDA_CHECK_LAUNCH();
  topk_select_kernel<<<grid, kThreads, 0, stream>>>(scores, stride, seq_len, topk, selected,
                                                    n_selected, ws);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
