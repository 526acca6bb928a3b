// Sigmoid router top-k on the GPU (spec 3.6), the selection and weights of cpu::route for one
// expert group: s = sigmoid(logit); choose the top_k of s + bias (descending, ties to the lower
// expert id); weight = s / (sum of the chosen s + 1e-20) if renormalize, times scaling.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/moe_dispatch.h"

namespace k3::cuda {

struct RouterPlan {
  int num_experts = 0;       // E, runtime (K3: 896; EP-local counts differ), <= 1024
  int top_k = 0;             // <= 32 and <= E
  int num_expert_group = 1;  // only 1 is supported; others are refused by check_router_plan
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
  // The select (router.cu): a warp sort and merge tree of 64-bit keys instead of the radix
  // select of CTA-wide counts; the same outputs (the specialized step takes it, 35% faster on
  // an H100; the stock step the radix select).
  bool merge_tree = false;
};

// Raises k3::Error for plans this kernel does not implement (E > 1024, top_k > 32,
// num_expert_group != 1, ...). Called by router_topk; callers may call it once at plan time.
void check_router_plan(const RouterPlan& p);

// logits:  [rows][E] fp32, the router GEMM output (device)
// bias:    [E] fp32 correction bias, or null (device)
// ids:     [rows][top_k] int32 expert ids, best first (device)
// weights: [rows][top_k] fp32 (device)
// One CTA per row, the choice scores in registers; no allocation, no host sync.
// Non-finite logits are not checked here (cpu::route raises on them).
void router_topk(const RouterPlan& plan, const float* logits, const float* bias, int64_t rows,
                 int32_t* ids, float* weights, cudaStream_t stream);

// The same top-k with the compact expert grouping of its ids (moe_group_by_expert_compact over
// all rows) in the same launch: the last CTA to finish its row groups every row's pairs, which
// saves the grouping kernel's launch on the decode step's critical path. Same outputs, bit for
// bit, as router_topk then moe_group_by_expert_compact. done: [1] int32 device counter, zero
// before the first launch and left zero by every launch (so graph replays reuse it); one launch
// at a time per counter. rows * top_k <= kMaxRouterGroupedPairs.
constexpr int kMaxRouterGroupedPairs = 512;
struct RouterGrouping {
  LocalExperts local;
  int32_t* slot_expert = nullptr;   // [local.count] int32
  int32_t* slot_offsets = nullptr;  // [local.count + 1] int32
  int32_t* row_index = nullptr;     // [rows * top_k] int32
  int32_t* position = nullptr;      // [rows * top_k] int32
  int32_t* done = nullptr;          // [1] int32 CTA counter (device)
};
void router_topk_grouped(const RouterPlan& plan, const float* logits, const float* bias,
                         int64_t rows, int32_t* ids, float* weights, const RouterGrouping& g,
                         cudaStream_t stream);

}  // namespace k3::cuda
