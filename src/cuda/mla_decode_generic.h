// Generic-shape path of cuda::mla_decode (internal): any kv_lora in [8, 1024] (multiple of 8)
// and rope in [0, 128], e.g. the tiny test model's 32 / 8. mla_decode dispatches here for every
// shape other than K3's 512 / 64; callers use mla_decode.h only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/mla_decode.h"

namespace k3::cuda::detail {

constexpr int kMlaGenericMaxKvLora = 1024;
constexpr int kMlaGenericMaxRope = 128;

// True when (kv_lora, rope) is a shape the generic kernel takes.
inline bool mla_generic_shape_ok(int kv_lora, int rope) {
  return kv_lora >= 8 && kv_lora <= kMlaGenericMaxKvLora && kv_lora % 8 == 0 && rope >= 0 &&
         rope <= kMlaGenericMaxRope;
}

// Same arguments and output contract as mla_decode (the workspace is not used: one CTA per
// (head, row) covers all of the row's tokens, so there is nothing to combine).
void mla_decode_generic(const MlaDecodePlan& plan, const __nv_bfloat16* q_abs,
                        const __nv_bfloat16* q_pe, const __nv_bfloat16* cache,
                        const int32_t* block_table, const int32_t* seq_len, const int32_t* selected,
                        const int32_t* n_selected, float softmax_scale, void* o_latent, bool o_bf16,
                        cudaStream_t stream, float* lse);

}  // namespace k3::cuda::detail
