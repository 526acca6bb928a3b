// Router top-k, one warp per row. The warp writes the row's choice scores (sigmoid + bias) to
// shared memory, then runs top_k rounds of a warp argmax: each lane keeps the best of its own
// strided experts cached in registers and rescans only when its best was taken, so a round is
// two warp reductions (redux.sync: max value, then min id among its holders) plus, for one
// lane, a rescan of E/32 values.
#include "cuda/router.h"

#include <cmath>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

using detail::sigmoid_ref;

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;
constexpr int kWarpsPerCta = 4;

// (value, id) order of cpu::route: larger value first, then lower id.
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// A float's order as an unsigned key (larger float, larger key; -inf lowest of the finite
// order). Choice scores are sigmoid + bias: never -0, so +0 / -0 never tie differently.
__device__ __forceinline__ unsigned ordered_key(float v) {
  const unsigned u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The lane's best untaken expert among e = lane, lane + 32, ...; id E when none is left.
__device__ __forceinline__ void lane_best(const float* choice, int E, int lane, float& bv,
                                          int& bi) {
  bv = -INFINITY;
  bi = E;
  for (int e = lane; e < E; e += 32) {
    const float v = choice[e];
    if (v != -INFINITY && better(v, e, bv, bi)) {  // taken experts hold -inf
      bv = v;
      bi = e;
    }
  }
}

__global__ void __launch_bounds__(kWarpsPerCta * 32)
    router_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int64_t rows,
                  int E, int top_k, bool renormalize, float scaling, int32_t* __restrict__ ids,
                  float* __restrict__ weights) {
  K3_PDL_ENTRY();
  // logits [rows][E]; bias [E] or null; ids / weights [rows][top_k]
  __shared__ float choice_s[kWarpsPerCta][kMaxExperts];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + w;
  if (row >= rows) return;  // whole warps leave together; no block barrier follows
  const float* lg = logits + row * E;
  float* choice = choice_s[w];
  for (int e = lane; e < E; e += 32) choice[e] = sigmoid_ref(lg[e]) + (bias ? bias[e] : 0.0f);
  __syncwarp();

  float bv;
  int bi;
  lane_best(choice, E, lane, bv, bi);
  int my_id = 0;  // lane k keeps the k-th pick
  for (int k = 0; k < top_k; ++k) {
    // The warp's best (value, id): the largest value (one redux), then the lowest id among the
    // lanes holding it (each lane's bi is already its lowest id of that value).
    const unsigned key = ordered_key(bv);
    const unsigned best = __reduce_max_sync(0xffffffffu, key);
    const int i = static_cast<int>(
        __reduce_min_sync(0xffffffffu, key == best ? static_cast<unsigned>(bi) : 0xffffffffu));
    if (lane == k) my_id = i;
    if ((i & 31) == lane) {  // the owner drops it and rescans its experts
      choice[i] = -INFINITY;
      lane_best(choice, E, lane, bv, bi);
    }
  }
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
  const int64_t ctas = (rows + kWarpsPerCta - 1) / kWarpsPerCta;
  K3_CHECK(ctas <= 0x7fffffff, "cuda::router_topk: too many rows ", rows);
  router_kernel<<<static_cast<unsigned>(ctas), kWarpsPerCta * 32, 0, stream>>>(
      logits, bias, rows, p.num_experts, p.top_k, p.renormalize, p.routed_scaling_factor, ids,
      weights);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
