// Paged MLA latent cache in the deploy kv_cache_dtype formats (layouts: cpu/latent_format.h):
// appending this step's rows, and dequantizing a whole context to the bf16 layout that
// mla_decode reads. Bytes equal the CPU encoder's (encode_latent_row on the same bf16 inputs).
//
// Bytes per token and layer for K3: bf16 1152, fp8 576, fp8_ds_mla 656, nvfp4_ds_mla 416.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cpu/latent_format.h"

namespace k3::cuda {

using cpu::LatentFormat;

// Writes row r of kv at token position[r] of its context: page block_table[r][pos / page_size],
// slot pos % page_size. A row with position < 0, a page index >= max_pages or a page id < 0 is
// skipped (padding rows of a captured graph). Block-scaled formats: inputs must be finite (the
// CPU encoder raises on them; the kernel cannot).
// kv:          [rows][kv_lora + rope] bf16 (normed c, then k_pe)
// block_table: [rows][max_pages] int32 page ids (device)
// position:    [rows] int32 (device)
// cache:       [num_pages][page_size][latent_entry_bytes(fmt, kv_lora, rope)] bytes
// Raises k3::Error on widths the format cannot hold. No allocation, no host sync.
void latent_cache_append(LatentFormat fmt, const __nv_bfloat16* kv, int64_t rows, int kv_lora,
                         int rope, const int32_t* block_table, int max_pages,
                         const int32_t* position, int page_size, uint8_t* cache,
                         cudaStream_t stream);

// Dequantizes tokens 0..seq_len[r]-1 of every row into a bf16 cache with the same page ids
// (out page p slot j = cache page p slot j); other slots are left untouched. The grid covers
// rows x max_pages (host bounds); lengths are read on the device.
// cache:   [num_pages][page_size][latent_entry_bytes] bytes
// seq_len: [rows] int32 (device)
// out:     [num_pages][page_size][kv_lora + rope] bf16
void latent_cache_to_bf16(LatentFormat fmt, const uint8_t* cache, int kv_lora, int rope,
                          const int32_t* block_table, int max_pages, const int32_t* seq_len,
                          int64_t rows, int page_size, __nv_bfloat16* out, cudaStream_t stream);

}  // namespace k3::cuda
