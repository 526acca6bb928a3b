// Router top-k, one CTA of 1024 threads per row, one expert per thread, with one of two selects
// (RouterPlan::merge_tree), the same picks and weights bit for bit:
// - radix: a radix select finds the top_k-th largest choice score (32 CTA-wide counts, one per
//   key bit, most significant first), every thread then knows whether its expert is in (above
//   the threshold, or at it among the lowest ids: cpu::route's order is value desc, id asc), the
//   picks are compacted by prefix counts, and one warp sorts them into pick order. ~6 us alone
//   (k3_bench_attn); the argmax rounds before it took 10.8 us alone and 16-23 us inside the
//   decode step (bench/RESULTS.md).
// - merge tree: each choice is one 64-bit key, (order of s + bias) << 32 | ~id, so that one
//   comparison is cpu::route's order and no two keys tie; each warp sorts its 32 keys (bitonic,
//   in registers), then five levels of warps merge the sorted lists pairwise, keeping the best
//   32 of each pair: five barriers where the radix select takes over thirty-five. Not yet timed.
#include "cuda/router.h"

#include <cmath>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/moe_group.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

using detail::sigmoid_ref;

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;
constexpr int kThreads = kMaxExperts;  // one expert per thread
constexpr int kWarps = kThreads / 32;

// A float's order as an unsigned key (larger float, larger key). Choice scores are sigmoid +
// bias: never -0, so +0 / -0 never tie differently. NaN (and a thread past E) gets key 0, below
// every number's key (-inf's is 0x007fffff), so it is never picked over a number.
__device__ __forceinline__ unsigned ordered_key(float v) {
  const unsigned u = __float_as_uint(v);
  if (isnan(v)) return 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix count of `flag` over the CTA's threads in thread order (every thread calls
// it; warp_tot: kWarps ints of shared memory).
__device__ __forceinline__ int cta_rank(bool flag, int* warp_tot) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const unsigned m = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) warp_tot[w] = __popc(m);
  __syncthreads();
  int before = 0;
  for (int q = 0; q < w; ++q) before += warp_tot[q];
  __syncthreads();  // warp_tot is reused by the next call
  return before + __popc(m & ((1u << lane) - 1u));
}

// The radix select. Returns, in warp 0, the lane-th pick's expert id (lane < top_k). Every
// thread of the CTA calls it with its expert's key (0 past E).
__device__ int radix_pick(unsigned key, int e, int E, int top_k) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __shared__ int warp_tot[kWarps];
  __shared__ unsigned pick_key[kMaxTopK];
  __shared__ int pick_id[kMaxTopK];
  __shared__ int pick_s[kMaxTopK];
  // The top_k-th largest key: the largest t with at least top_k keys >= t, bit by bit.
  unsigned t = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const unsigned c = t | (1u << bit);
    if (__syncthreads_count(key >= c) >= top_k) t = c;
  }
  // In: above t, or at t among the lowest ids (ids are thread order).
  const int n_gt = __syncthreads_count(key > t);
  const int eq_rank = cta_rank(key == t, warp_tot);
  const bool in = e < E && (key > t || (key == t && eq_rank < top_k - n_gt));
  const int slot = cta_rank(in, warp_tot);
  if (in) {
    pick_key[slot] = key;
    pick_id[slot] = e;
  }
  __syncthreads();
  if (w != 0) return 0;
  // Pick order: value desc, id asc (the top_k picks are distinct experts).
  const unsigned my_key = lane < top_k ? pick_key[lane] : 0u;
  const int my_raw = lane < top_k ? pick_id[lane] : 0;
  int rank = 0;
  for (int q = 0; q < top_k; ++q) {
    const unsigned kq = __shfl_sync(0xffffffffu, my_key, q);
    const int iq = __shfl_sync(0xffffffffu, my_raw, q);
    rank += kq > my_key || (kq == my_key && iq < my_raw);
  }
  if (lane < top_k) pick_s[rank] = my_raw;
  __syncwarp();
  return lane < top_k ? pick_s[lane] : 0;
}

// The choice's sort key: larger is picked first; at equal scores the lower id is larger. Threads
// past E have ids above every expert's, so among key-0 choices (NaN) experts still come first.
__device__ __forceinline__ unsigned long long choice_key(unsigned key, int id) {
  return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<unsigned>(id));
}

// One compare-exchange step across lanes lane and lane ^ j: the lane keeps the larger key
// where keep_max, else the smaller.
__device__ __forceinline__ unsigned long long exchange(unsigned long long c, int j, bool keep_max) {
  const unsigned long long o = __shfl_xor_sync(0xffffffffu, c, j);
  return keep_max ? (c > o ? c : o) : (c < o ? c : o);
}

// A bitonic sequence over the warp's lanes into descending order (lane 0 the largest).
__device__ __forceinline__ unsigned long long merge_desc(unsigned long long c, int lane) {
#pragma unroll
  for (int j = 16; j > 0; j >>= 1) c = exchange(c, j, (lane & j) == 0);
  return c;
}

// The warp's 32 keys in descending order (lane 0 the largest).
__device__ __forceinline__ unsigned long long sort_desc(unsigned long long c, int lane) {
#pragma unroll
  for (int k = 2; k <= 32; k <<= 1)
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) c = exchange(c, j, ((lane & j) == 0) == ((lane & k) == 0));
  return c;
}

// The merge tree. Returns, in warp 0, the lane-th pick's expert id (lane < top_k <= 32). Every
// thread of the CTA calls it with its expert's key (0 past E).
__device__ int tree_pick(unsigned key, int e) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __shared__ unsigned long long best[kWarps][32];  // [warp][rank] sorted choice keys
  best[w][lane] = sort_desc(choice_key(key, e), lane);
  __syncthreads();
  // Lists w and w + half hold sorted keys: max(a[i], b[31 - i]) is a bitonic sequence of the
  // pair's best 32, which merge_desc sorts.
#pragma unroll
  for (int half = kWarps / 2; half >= 1; half >>= 1) {
    if (w < half) best[w][lane] = merge_desc(max(best[w][lane], best[w + half][31 - lane]), lane);
    __syncthreads();
  }
  return static_cast<int>(0xffffffffu - static_cast<unsigned>(best[0][lane]));
}

// logits: no __restrict__ (PDL: the router GEMM may still run when this kernel starts; see
// mma.cuh ld_act128); nor ids, which the last CTA reads back to group them.
template <bool kTree>
__global__ void __launch_bounds__(kThreads)
    router_kernel(const float* logits, const float* __restrict__ bias, int E, int top_k,
                  bool renormalize, float scaling, int32_t* ids, float* __restrict__ weights,
                  const RouterGrouping g) {
  detail::pdl_launch_dependents();
  // logits [rows][E]; bias [E] or null; ids / weights [rows][top_k]; one CTA per row.
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t row = blockIdx.x;
  const float* lg = logits + row * E;

  __shared__ float score[kMaxExperts];  // [E] sigmoid(logit), for the weights
  const int e = static_cast<int>(threadIdx.x);
  // The bias is a weight: read before waiting for the router GEMM, off the critical path.
  const float b = e < E && bias ? bias[e] : 0.0f;
  detail::pdl_wait();
  const float s = e < E ? sigmoid_ref(lg[e]) : 0.0f;
  score[e] = s;  // read by warp 0 after the select's barriers
  const unsigned key = e < E ? ordered_key(s + b) : 0u;
  int my_id;  // (if constexpr: each kernel holds only its own select's shared memory)
  if constexpr (kTree)
    my_id = tree_pick(key, e);
  else
    my_id = radix_pick(key, e, E, top_k);

  if (w == 0) {  // my_id: the lane-th pick (value desc, id asc)
    // The weight uses s without the bias.
    const float my_s = lane < top_k ? score[my_id] : 0.0f;
    // Sum in pick order, as cpu::route does, so the fp32 rounding matches.
    float sum = 0.0f;
    for (int k = 0; k < top_k; ++k) sum += __shfl_sync(0xffffffffu, my_s, k);
    const float norm = renormalize ? 1.0f / (sum + 1e-20f) : 1.0f;
    if (lane < top_k) {
      ids[row * top_k + lane] = my_id;
      weights[row * top_k + lane] = my_s * norm * scaling;
    }
  }
  if (!g.done) return;

  // Fused grouping: the last CTA to count itself in groups every row's pairs (the fence makes
  // this CTA's ids visible before its count; the last one reads all of them through L2). A
  // single row's CTA is the last by itself: the barrier makes its own ids visible to it, and the
  // fence and count (two more memory round trips on the MoE's critical path) are skipped.
  __shared__ detail::GroupScratch<kMaxExperts, kMaxRouterGroupedPairs> sm;
  __shared__ bool last;
  if (gridDim.x == 1) {
    __syncthreads();
  } else {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(g.done, 1) == static_cast<int>(gridDim.x) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
  }
  detail::group_pairs(sm, ids, static_cast<int>(gridDim.x) * top_k, top_k, g.local.begin,
                      g.local.count, g.slot_expert, g.slot_offsets, g.row_index, g.position,
                      /*compact=*/true);
  if (threadIdx.x == 0 && gridDim.x > 1) *g.done = 0;  // ready for the next launch (replays too)
}

void launch(const RouterPlan& p, const float* logits, const float* bias, int64_t rows, int32_t* ids,
            float* weights, const RouterGrouping& g, cudaStream_t stream) {
  const auto kernel = p.merge_tree ? router_kernel<true> : router_kernel<false>;
  kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      logits, bias, p.num_experts, p.top_k, p.renormalize, p.routed_scaling_factor, ids, weights,
      g);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace

void check_router_plan(const RouterPlan& p) {
  K3_CHECK(p.num_experts >= 1 && p.num_experts <= kMaxExperts, "cuda::router_topk: num_experts ",
           p.num_experts, " outside [1, ", kMaxExperts, "]");
  K3_CHECK(p.top_k >= 1 && p.top_k <= kMaxTopK && p.top_k <= p.num_experts,
           "cuda::router_topk: top_k ", p.top_k, " outside [1, min(", kMaxTopK,
           ", num_experts=", p.num_experts, ")]");
  K3_CHECK(p.num_expert_group == 1, "cuda::router_topk: num_expert_group ", p.num_expert_group,
           " unsupported (group-limited routing is not implemented on the GPU)");
}

void router_topk(const RouterPlan& p, const float* logits, const float* bias, int64_t rows,
                 int32_t* ids, float* weights, cudaStream_t stream) {
  check_router_plan(p);
  K3_CHECK(rows >= 0, "cuda::router_topk: rows ", rows);
  if (rows == 0) return;
  K3_CHECK(rows <= 0x7fffffff, "cuda::router_topk: too many rows ", rows);
  launch(p, logits, bias, rows, ids, weights, RouterGrouping{}, stream);
}

void router_topk_grouped(const RouterPlan& p, const float* logits, const float* bias, int64_t rows,
                         int32_t* ids, float* weights, const RouterGrouping& g,
                         cudaStream_t stream) {
  check_router_plan(p);
  K3_CHECK(rows >= 1 && rows * p.top_k <= kMaxRouterGroupedPairs,
           "cuda::router_topk_grouped: ", rows, " rows x top_k ", p.top_k, " outside [1, ",
           kMaxRouterGroupedPairs, "] pairs");
  K3_CHECK(g.local.count >= 1 && g.local.count <= kMaxExperts && g.local.begin >= 0,
           "cuda::router_topk_grouped: local experts [", g.local.begin, ", ",
           g.local.begin + g.local.count, ")");
  K3_CHECK(g.slot_expert && g.slot_offsets && g.row_index && g.position && g.done,
           "cuda::router_topk_grouped: null grouping output");
  launch(p, logits, bias, rows, ids, weights, g, stream);
}

}  // namespace k3::cuda
