// MLA latent (KV) cache formats: the bytes one cached token occupies for each deploy
// kv_cache_dtype, and host encode / decode of one row [kv_lora + rope] (normed c, then k_pe).
// The CUDA cache kernels (src/cuda/latent_cache.cu) write and read exactly these bytes.
//
// Layouts, per token:
//   F32          (kv_lora + rope) fp32                          (fp32 reference runs only)
//   BF16         (kv_lora + rope) bf16                          1152 B for K3 (512 + 64)
//   FP8          (kv_lora + rope) E4M3 of x / kFp8LatentScale    576 B
//   FP8_DS_MLA   kv_lora E4M3 | kv_lora/B fp32 scales | rope bf16   512 + 16 + 128 = 656 B
//                B = min(128, kv_lora); scale = amax / 448 (1 when amax = 0), q = e4m3(x / scale)
//   NVFP4_DS_MLA kv_lora/2 B E2M1 pairs (element 2k in the low nibble) | kv_lora/16 E4M3 scales
//                | rope bf16                                    256 + 32 + 128 = 416 B
//                scale = e4m3(amax / 6), value = e2m1 * scale (a zero scale stores zeros)
// Multi-byte fields are little-endian (the host and the GPU are).
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/deploy_config.h"

namespace k3::cpu {

enum class LatentFormat { F32, BF16, FP8, FP8_DS_MLA, NVFP4_DS_MLA };

// Per-tensor scale of the FP8 format. Checkpoints ship no k_scale for the latent cache, so
// the value is vLLM's default 1.0 (x is stored as e4m3(x), saturating at +-448).
constexpr float kFp8LatentScale = 1.0f;
constexpr int kFp8DsMlaBlock = 128;  // values per fp32 scale (fewer when kv_lora < 128)
constexpr int kNvfp4Block = 16;      // values per E4M3 scale

// auto / bfloat16 -> BF16, fp8 -> FP8, fp8_ds_mla -> FP8_DS_MLA, nvfp4_ds_mla -> NVFP4_DS_MLA.
LatentFormat latent_format_of(KvCacheDtype t);
const char* latent_format_name(LatentFormat f);

// Values per fp32 scale of FP8_DS_MLA: min(128, kv_lora).
inline int fp8_ds_mla_block(int kv_lora) {
  return kv_lora < kFp8DsMlaBlock ? kv_lora : kFp8DsMlaBlock;
}

// Bytes per cached token. Raises k3::Error when the format cannot hold these widths (kv_lora not
// a multiple of the format's block, non-positive widths).
size_t latent_entry_bytes(LatentFormat f, int kv_lora, int rope);

// row: [kv_lora + rope] fp32 -> out: [latent_entry_bytes] bytes. Non-finite values raise for the
// block-scaled formats (a NaN would poison the whole block's scale).
void encode_latent_row(LatentFormat f, const float* row, int kv_lora, int rope, uint8_t* out);
// in: [latent_entry_bytes] bytes -> row: [kv_lora + rope] fp32, the values the cache holds.
void decode_latent_row(LatentFormat f, const uint8_t* in, int kv_lora, int rope, float* row);

// row [kv_lora + rope] replaced by what a cache of format f gives back (encode, then decode).
void round_trip_latent_row(LatentFormat f, float* row, int kv_lora, int rope);

}  // namespace k3::cpu
