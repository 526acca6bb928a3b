// Router top-k, one CTA of 8 warps per row, in two phases of warp argmax rounds (redux.sync:
// max value, then min id among its holders). Phase 1: each warp picks the top_k of its strided
// eighth of the experts, held 4 per lane in registers; phase 2: warp 0 picks the
// top_k of the 8 x top_k candidates (the global top_k are among them). A round rescans only the
// winner lane's registers, so 2 x top_k short rounds replace one warp rescanning E / 32 values
// from shared memory per round (measured: the 93-layer rank's router stage 5.6 -> 4.1 ms).
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
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kPerLane = kMaxExperts / kThreads;      // phase 1 registers per lane
constexpr int kCandPerLane = kWarps * kMaxTopK / 32;  // phase 2 registers per lane
constexpr int kNone = 0x7fffffff;                     // id of an empty register

// A float's order as an unsigned key (larger float, larger key; -inf lowest of the finite
// order). Choice scores are sigmoid + bias: never -0, so +0 / -0 never tie differently.
__device__ __forceinline__ unsigned ordered_key(float v) {
  const unsigned u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The lane's best (value, id) of its N registers, (value desc, id asc) as cpu::route orders;
// taken or empty registers hold -inf / kNone. j: its register.
template <int N>
__device__ __forceinline__ void lane_best(const float (&v)[N], const int (&id)[N], float& bv,
                                          int& bi, int& bj) {
  bv = -INFINITY;
  bi = kNone;
  bj = 0;
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (v[j] > bv || (v[j] == bv && id[j] < bi)) {
      bv = v[j];
      bi = id[j];
      bj = j;
    }
}

// top_k rounds of warp argmax over the lanes' registers; pick k lands in (out_v[k], out_i[k])
// through `emit` (called by lane 0). Registers of picked entries become -inf / kNone.
template <int N, class Emit>
__device__ __forceinline__ void warp_topk(float (&v)[N], int (&id)[N], int top_k, int lane,
                                          Emit emit) {
  float bv;
  int bi, bj;
  lane_best(v, id, bv, bi, bj);
  for (int k = 0; k < top_k; ++k) {
    const unsigned key = ordered_key(bv);
    const unsigned best = __reduce_max_sync(0xffffffffu, key);
    const int i = static_cast<int>(
        __reduce_min_sync(0xffffffffu, key == best ? static_cast<unsigned>(bi) : 0xffffffffu));
    if (lane == 0) emit(k, key_value(best), i);
    if (bi == i && i != kNone) {  // the owner (ids are distinct) drops it and rescans
#pragma unroll
      for (int j = 0; j < N; ++j)
        if (j == bj) v[j] = -INFINITY, id[j] = kNone;
      lane_best(v, id, bv, bi, bj);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    router_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int E,
                  int top_k, bool renormalize, float scaling, int32_t* __restrict__ ids,
                  float* __restrict__ weights, const RouterGrouping g) {
  K3_PDL_ENTRY();
  // logits [rows][E]; bias [E] or null; ids / weights [rows][top_k]; one CTA per row.
  __shared__ float cand_v[kWarps * kMaxTopK];
  __shared__ int cand_i[kWarps * kMaxTopK];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t row = blockIdx.x;
  const float* lg = logits + row * E;

  // Phase 1: thread t holds experts t, t + 256, ... (choice score = sigmoid + bias).
  float v[kPerLane];
  int id[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = j * kThreads + static_cast<int>(threadIdx.x);
    v[j] = e < E ? sigmoid_ref(lg[e]) + (bias ? bias[e] : 0.0f) : -INFINITY;
    id[j] = e < E ? e : kNone;
  }
  warp_topk(v, id, top_k, lane, [&](int k, float val, int i) {
    cand_v[w * top_k + k] = val;
    cand_i[w * top_k + k] = i;
  });
  __syncthreads();

  if (w == 0) {  // Phase 2: warp 0 over the 8 x top_k candidates.
    float cv[kCandPerLane];
    int ci[kCandPerLane];
    const int n_cand = kWarps * top_k;
#pragma unroll
    for (int j = 0; j < kCandPerLane; ++j) {
      const int c = j * 32 + lane;
      cv[j] = c < n_cand ? cand_v[c] : -INFINITY;
      ci[j] = c < n_cand ? cand_i[c] : kNone;
    }
    __shared__ int pick_s[kMaxTopK];
    warp_topk(cv, ci, top_k, lane, [&](int k, float, int i) { pick_s[k] = i; });
    __syncwarp();
    const int my_id = lane < top_k ? pick_s[lane] : 0;
    // The weight uses s without the bias (one load per pick, all lanes at once).
    const float my_s = lane < top_k ? sigmoid_ref(lg[my_id]) : 0.0f;
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
  // this CTA's ids visible before its count; the last one reads all of them through L2).
  __shared__ detail::GroupScratch<kMaxExperts, kMaxRouterGroupedPairs> sm;
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(g.done, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  detail::group_pairs(sm, ids, static_cast<int>(gridDim.x) * top_k, top_k, g.local.begin,
                      g.local.count, g.slot_expert, g.slot_offsets, g.row_index, g.position,
                      /*compact=*/true);
  if (threadIdx.x == 0) *g.done = 0;  // ready for the next launch (graph replays included)
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
  router_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      logits, bias, p.num_experts, p.top_k, p.renormalize, p.routed_scaling_factor, ids, weights,
      RouterGrouping{});
  K3_CUDA_CHECK_LAUNCH();
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
  router_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      logits, bias, p.num_experts, p.top_k, p.renormalize, p.routed_scaling_factor, ids, weights,
      g);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
