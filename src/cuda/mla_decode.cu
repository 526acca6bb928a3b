// Absorbed MLA decode: the split kernel (mla_split_fp32.cu on CUDA cores, the default, or
// mla_split_mma.cu on tensor cores, MlaDecodePlan::tensor_cores) writes each split's
// unnormalised partials; the combine kernel here merges the row's active splits (derived from its
// length, like the split kernel's ranges) of each (row, head) in a fixed order, so the result
// does not depend on scheduling.
#include "cuda/mla_decode.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/mla_decode_generic.h"
#include "cuda/mla_split.cuh"
#include "cuda/pdl.cuh"

namespace k3::cuda {
namespace {

using detail::warp_sum;
using detail::mla::kKvLora;
using detail::mla::kMaxHeads;
using detail::mla::kMinSplit;
using detail::mla::kRope;
using detail::mla::split_tokens;
using detail::mla::warp_max;

// The combine: one CTA per (head, row); 8 groups of 64 threads, each thread 8 latent columns of
// every 8th split, then the groups' sums in group order. At batch 1 and 32k there are 264 splits
// for 6 CTAs: one thread walking all of them (the version before) was 264 dependent L2 round
// trips in batches of 4.
constexpr int kCombineCols = 8;
constexpr int kCombineColThreads = kKvLora / kCombineCols;            // 64
constexpr int kCombineGroups = 8;                                     // split groups
constexpr int kCombineThreads = kCombineColThreads * kCombineGroups;  // 512
constexpr int kMaxSplits = 1024;

template <bool kBf16Out>
__global__ void __launch_bounds__(kCombineThreads)
    mla_combine_kernel(const float* ws_acc, const float* ws_ml, const int32_t* seq_len,
                       const int32_t* n_selected, int heads, int splits, void* __restrict__ out,
                       float* __restrict__ lse) {
  K3_PDL_ENTRY();
  // ws_acc [rows][heads][splits][512]; ws_ml [rows][heads][splits][2];
  // out [rows][heads][512] fp32 or bf16. The split weights exp(m_s - max) are computed once into
  // shared memory; group q sums splits q, q + 8, ... in order, then the 8 group sums add in group
  // order: the result does not depend on scheduling.
  __shared__ float w_s[kMaxSplits];
  __shared__ float red[kCombineThreads / 32];
  __shared__ float4 part[kCombineGroups][kCombineColThreads][2];  // [group][thread][8 columns]
  const int row = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t rh = static_cast<int64_t>(row) * heads + blockIdx.x;
  const int n = max(0, n_selected ? n_selected[row] : seq_len[row]);
  const int active = n == 0 ? 0 : (n + split_tokens(n, splits) - 1) / split_tokens(n, splits);
  const float* ml = ws_ml + rh * splits * 2;
  float mx = -INFINITY;
  for (int s = tid; s < active; s += kCombineThreads) mx = fmaxf(mx, ml[2 * s]);
  mx = warp_max(mx);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < kCombineThreads / 32; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();  // red is reused for l
  float lp = 0.0f;
  for (int s = tid; s < active; s += kCombineThreads) {
    const float m = ml[2 * s];
    const float w = m == -INFINITY ? 0.0f : expf(m - mx);  // a split of masked tokens only
    w_s[s] = w;
    lp += w * ml[2 * s + 1];
  }
  lp = warp_sum(lp);
  if (lane == 0) red[warp] = lp;
  __syncthreads();
  float l = 0.0f;
  for (int w = 0; w < kCombineThreads / 32; ++w) l += red[w];
  if (lse != nullptr && tid == 0) lse[rh] = mx == -INFINITY ? -INFINITY : mx + logf(l);
  const int grp = tid / kCombineColThreads, ct = tid % kCombineColThreads;
  float o[kCombineCols] = {};
  if (mx != -INFINITY) {  // else the row has no tokens: o = 0
    const float* acc = ws_acc + rh * splits * kKvLora + ct * kCombineCols;
#pragma unroll 4
    for (int s = grp; s < active; s += kCombineGroups) {
      const float w = w_s[s];
      const float4* a = reinterpret_cast<const float4*>(acc + static_cast<int64_t>(s) * kKvLora);
      const float4 a0 = a[0], a1 = a[1];
      o[0] += w * a0.x;
      o[1] += w * a0.y;
      o[2] += w * a0.z;
      o[3] += w * a0.w;
      o[4] += w * a1.x;
      o[5] += w * a1.y;
      o[6] += w * a1.z;
      o[7] += w * a1.w;
    }
  }
  part[grp][ct][0] = make_float4(o[0], o[1], o[2], o[3]);
  part[grp][ct][1] = make_float4(o[4], o[5], o[6], o[7]);
  __syncthreads();
  if (grp != 0) return;
  float r[kCombineCols] = {};
  for (int q = 0; q < kCombineGroups; ++q) {
    const float4 p0 = part[q][ct][0], p1 = part[q][ct][1];
    r[0] += p0.x;
    r[1] += p0.y;
    r[2] += p0.z;
    r[3] += p0.w;
    r[4] += p1.x;
    r[5] += p1.y;
    r[6] += p1.z;
    r[7] += p1.w;
  }
  if (mx != -INFINITY) {
    const float inv = 1.0f / l;
    for (float& x : r) x *= inv;
  }
  const int64_t e = rh * kKvLora + ct * kCombineCols;
  if constexpr (kBf16Out) {
    __nv_bfloat16* y = static_cast<__nv_bfloat16*>(out) + e;
    for (int j = 0; j < kCombineCols; ++j) y[j] = __float2bfloat16_rn(r[j]);
  } else {
    float4* y = reinterpret_cast<float4*>(static_cast<float*>(out) + e);
    y[0] = make_float4(r[0], r[1], r[2], r[3]);
    y[1] = make_float4(r[4], r[5], r[6], r[7]);
  }
}

}  // namespace

MlaDecodePlan plan_mla_decode(MlaDecodePlan p, int sm_count) {
  const bool fast = p.kv_lora == kKvLora && p.rope == kRope;
  K3_CHECK(fast || detail::mla_generic_shape_ok(p.kv_lora, p.rope), "cuda::mla_decode: kv_lora ",
           p.kv_lora, " / rope ", p.rope,
           " unsupported (512 / 64, or kv_lora in [8, 1024] a multiple of 8 and rope in [0, 128])");
  K3_CHECK(p.rows >= 0 && p.heads >= 1 && p.heads <= 128, "cuda::mla_decode: rows ", p.rows,
           ", heads ", p.heads);
  K3_CHECK(p.page_size >= 1 && p.max_pages >= 1, "cuda::mla_decode: page_size ", p.page_size,
           ", max_pages ", p.max_pages);
  K3_CHECK(p.max_tokens >= 0 && p.max_tokens <= 0x7fffffff, "cuda::mla_decode: max_tokens ",
           p.max_tokens);
  K3_CHECK(sm_count >= 1, "cuda::mla_decode: sm_count ", sm_count);
  K3_CHECK(p.ring_tiles == 2 || p.ring_tiles == 4 || p.ring_tiles == detail::mla::kRingDeepest,
           "cuda::mla_decode: ring_tiles ", p.ring_tiles, " (2, 4 or ", detail::mla::kRingDeepest,
           ")");
  if (!p.tensor_cores) p.ring_tiles = 2;  // the CUDA-core kernel has the two-tile ring only
  if (!fast) {  // generic kernel: one CTA per (head, row), no splits, no tensor-core form
    p.tensor_cores = false;
    p.ring_tiles = 2;
    p.head_groups = p.heads;
    p.heads_per_group = 1;
    p.splits = 1;
    return p;
  }
  p.head_groups = (p.heads + kMaxHeads - 1) / kMaxHeads;
  p.heads_per_group = (p.heads + p.head_groups - 1) / p.head_groups;
  // Aim at one wave of two CTAs per SM (either split kernel fits two in shared memory with a
  // two-tile ring; one with a deeper ring) for the longest context the grid must serve: the most
  // splits whose CTAs all fit, since the splits are equal work and a second, partial wave would
  // double the kernel's time (64 rows at 5 splits were 320 CTAs for 264 places). On the device each
  // split takes at least kMinSplit tokens, so a short context uses fewer splits. At batch 1 the
  // step is latency-bound: many short splits win although each writes heads_per_group x 2 KB of
  // fp32 partials (L2-resident, read back by the combine).
  const int64_t base = std::max<int64_t>(1, static_cast<int64_t>(p.rows) * p.head_groups);
  const int64_t per_sm = p.ring_tiles == 2 ? 2 : 1;
  const int64_t want = per_sm * sm_count / base;
  const int64_t min_len = kMinSplit;
  const int64_t cap = std::max<int64_t>(1, (p.max_tokens + min_len - 1) / min_len);
  p.splits = static_cast<int>(std::clamp<int64_t>(std::min(want, cap), 1, kMaxSplits));
  return p;
}

size_t mla_decode_workspace_bytes(const MlaDecodePlan& p) {
  return sizeof(float) * static_cast<size_t>(p.rows) * p.heads * p.splits * (p.kv_lora + 2);
}

void mla_decode(const MlaDecodePlan& p, const __nv_bfloat16* q_abs, const __nv_bfloat16* q_pe,
                const __nv_bfloat16* cache, const int32_t* block_table, const int32_t* seq_len,
                const int32_t* selected, const int32_t* n_selected, float softmax_scale,
                void* workspace, void* o_latent, bool o_bf16, cudaStream_t stream, float* lse) {
  K3_CHECK(p.splits >= 1 && p.heads_per_group >= 1 && p.heads_per_group <= kMaxHeads,
           "cuda::mla_decode: plan not built by plan_mla_decode");
  K3_CHECK(selected == nullptr || (n_selected != nullptr && p.max_sel >= 1),
           "cuda::mla_decode: sparse launch needs n_selected and max_sel");
  K3_CHECK(reinterpret_cast<uintptr_t>(cache) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(workspace) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(o_latent) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(q_abs) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(q_pe) % 16 == 0,
           "cuda::mla_decode: cache, workspace, o_latent, q_abs and q_pe must be 16-byte aligned");
  if (p.kv_lora != kKvLora || p.rope != kRope) {
    K3_CHECK(!p.tensor_cores,
             "cuda::mla_decode: the tensor-core split kernel takes kv_lora 512 / "
             "rope 64 only, not ",
             p.kv_lora, " / ", p.rope);
    detail::mla_decode_generic(p, q_abs, q_pe, cache, block_table, seq_len, selected, n_selected,
                               softmax_scale, o_latent, o_bf16, stream, lse);
    return;
  }
  if (p.rows == 0) return;
  float* ws_acc = static_cast<float*>(workspace);
  float* ws_ml = ws_acc + static_cast<size_t>(p.rows) * p.heads * p.splits * kKvLora;
  const detail::mla::SplitArgs args{.q_abs = q_abs,
                                    .q_pe = q_pe,
                                    .cache = cache,
                                    .block_table = block_table,
                                    .seq_len = seq_len,
                                    .selected = selected,
                                    .n_selected = n_selected,
                                    .heads = p.heads,
                                    .hpg = p.heads_per_group,
                                    .page_size = p.page_size,
                                    .max_pages = p.max_pages,
                                    .max_sel = p.max_sel,
                                    .scale = softmax_scale,
                                    .ws_acc = ws_acc,
                                    .ws_ml = ws_ml};
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.head_groups),
                  static_cast<unsigned>(p.rows));
  if (p.tensor_cores)
    detail::mla::launch_split_mma(args, grid, p.ring_tiles, stream);
  else
    detail::mla::launch_split_fp32(args, grid, stream);
  const dim3 cgrid(static_cast<unsigned>(p.heads), static_cast<unsigned>(p.rows));
  const int32_t* n_sel = selected ? n_selected : nullptr;
  if (o_bf16)
    mla_combine_kernel<true><<<cgrid, kCombineThreads, 0, stream>>>(
        ws_acc, ws_ml, seq_len, n_sel, p.heads, p.splits, o_latent, lse);
  else
    mla_combine_kernel<false><<<cgrid, kCombineThreads, 0, stream>>>(
        ws_acc, ws_ml, seq_len, n_sel, p.heads, p.splits, o_latent, lse);
  K3_CUDA_CHECK_LAUNCH();
}

}  // namespace k3::cuda
