#include "cpu/latent_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "cpu/ops_dsa.h"

namespace k3::cpu {
namespace {

void put_bf16(uint8_t* p, float v) {
  const uint16_t h = float_to_bf16(v);
  std::memcpy(p, &h, 2);
}
float get_bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return bf16_to_float(h);
}

}  // namespace

LatentFormat latent_format_of(KvCacheDtype t) {
  switch (t) {
    case KvCacheDtype::Auto:
    case KvCacheDtype::BFloat16:
      return LatentFormat::BF16;
    case KvCacheDtype::Fp8:
      return LatentFormat::FP8;
    case KvCacheDtype::Fp8DsMla:
      return LatentFormat::FP8_DS_MLA;
    case KvCacheDtype::Nvfp4DsMla:
      return LatentFormat::NVFP4_DS_MLA;
  }
  fail("unknown kv_cache_dtype");
}

const char* latent_format_name(LatentFormat f) {
  switch (f) {
    case LatentFormat::F32:
      return "float32";
    case LatentFormat::BF16:
      return "bfloat16";
    case LatentFormat::FP8:
      return "fp8";
    case LatentFormat::FP8_DS_MLA:
      return "fp8_ds_mla";
    case LatentFormat::NVFP4_DS_MLA:
      return "nvfp4_ds_mla";
  }
  return "?";
}

size_t latent_entry_bytes(LatentFormat f, int kv_lora, int rope) {
  K3_CHECK(kv_lora > 0 && rope >= 0, "latent cache ", latent_format_name(f),
           ": bad widths kv_lora_rank=", kv_lora, " rope=", rope);
  const size_t n = static_cast<size_t>(kv_lora + rope), kvl = static_cast<size_t>(kv_lora);
  switch (f) {
    case LatentFormat::F32:
      return 4 * n;
    case LatentFormat::BF16:
      return 2 * n;
    case LatentFormat::FP8:
      return n;
    case LatentFormat::FP8_DS_MLA: {
      const int b = fp8_ds_mla_block(kv_lora);
      K3_CHECK(kv_lora % b == 0,
               "kv_cache_dtype fp8_ds_mla needs kv_lora_rank below 128 or a "
               "multiple of 128 (one fp32 scale per 128 values), got ",
               kv_lora);
      return kvl + 4 * (kvl / static_cast<size_t>(b)) + 2 * static_cast<size_t>(rope);
    }
    case LatentFormat::NVFP4_DS_MLA:
      K3_CHECK(kv_lora % kNvfp4Block == 0,
               "kv_cache_dtype nvfp4_ds_mla needs kv_lora_rank a "
               "multiple of 16 (one E4M3 scale per 16 values), got ",
               kv_lora);
      return kvl / 2 + kvl / kNvfp4Block + 2 * static_cast<size_t>(rope);
  }
  fail("unknown latent cache format");
}

void encode_latent_row(LatentFormat f, const float* row, int kv_lora, int rope, uint8_t* out) {
  // row: [kv_lora + rope] fp32, out: [latent_entry_bytes(f, kv_lora, rope)] bytes.
  const size_t bytes = latent_entry_bytes(f, kv_lora, rope);  // validates the widths
  const int n = kv_lora + rope;
  switch (f) {
    case LatentFormat::F32:
      std::memcpy(out, row, bytes);
      return;
    case LatentFormat::BF16:
      for (int i = 0; i < n; ++i) put_bf16(out + 2 * i, row[i]);
      return;
    case LatentFormat::FP8:
      for (int i = 0; i < n; ++i) out[i] = float_to_e4m3(row[i] / kFp8LatentScale);
      return;
    case LatentFormat::FP8_DS_MLA: {
      const int b = fp8_ds_mla_block(kv_lora), nb = kv_lora / b;
      std::vector<float> scales(static_cast<size_t>(nb));
      quantize_fp8_blocks(row, kv_lora, b, out, scales.data());  // the index keys' quantizer
      std::memcpy(out + kv_lora, scales.data(), 4 * static_cast<size_t>(nb));
      uint8_t* pe = out + kv_lora + 4 * nb;  // [rope] bf16
      for (int i = 0; i < rope; ++i) put_bf16(pe + 2 * i, row[kv_lora + i]);
      return;
    }
    case LatentFormat::NVFP4_DS_MLA: {
      const int nb = kv_lora / kNvfp4Block;
      uint8_t* sc = out + kv_lora / 2;  // [nb] E4M3 scales
      std::memset(out, 0, static_cast<size_t>(kv_lora / 2));
      for (int bi = 0; bi < nb; ++bi) {
        const float* x = row + bi * kNvfp4Block;
        float amax = 0.0f;
        for (int i = 0; i < kNvfp4Block; ++i) {
          K3_CHECK(std::isfinite(x[i]), "nvfp4_ds_mla latent: non-finite value ", x[i], " at ",
                   bi * kNvfp4Block + i);
          amax = std::max(amax, std::fabs(x[i]));
        }
        // The scale is stored in E4M3, so the quantizer divides by the rounded scale: the
        // decoder's e2m1 * scale then reconstructs with the scale it actually reads.
        sc[bi] = float_to_e4m3(amax / 6.0f);
        const float s = e4m3_to_float(sc[bi]);
        for (int i = 0; i < kNvfp4Block; ++i) {
          const int k = bi * kNvfp4Block + i;
          const uint8_t nib = s > 0.0f ? float_to_e2m1(x[i] / s) : 0;
          out[k / 2] |= static_cast<uint8_t>(k % 2 == 0 ? nib : nib << 4);
        }
      }
      uint8_t* pe = sc + nb;  // [rope] bf16
      for (int i = 0; i < rope; ++i) put_bf16(pe + 2 * i, row[kv_lora + i]);
      return;
    }
  }
}

void decode_latent_row(LatentFormat f, const uint8_t* in, int kv_lora, int rope, float* row) {
  // in: [latent_entry_bytes(f, kv_lora, rope)] bytes, row: [kv_lora + rope] fp32.
  const size_t bytes = latent_entry_bytes(f, kv_lora, rope);
  const int n = kv_lora + rope;
  switch (f) {
    case LatentFormat::F32:
      std::memcpy(row, in, bytes);
      return;
    case LatentFormat::BF16:
      for (int i = 0; i < n; ++i) row[i] = get_bf16(in + 2 * i);
      return;
    case LatentFormat::FP8:
      for (int i = 0; i < n; ++i) row[i] = e4m3_to_float(in[i]) * kFp8LatentScale;
      return;
    case LatentFormat::FP8_DS_MLA: {
      const int b = fp8_ds_mla_block(kv_lora), nb = kv_lora / b;
      std::vector<float> scales(static_cast<size_t>(nb));
      std::memcpy(scales.data(), in + kv_lora, 4 * static_cast<size_t>(nb));
      dequantize_fp8_blocks(in, scales.data(), kv_lora, b, row);
      const uint8_t* pe = in + kv_lora + 4 * nb;
      for (int i = 0; i < rope; ++i) row[kv_lora + i] = get_bf16(pe + 2 * i);
      return;
    }
    case LatentFormat::NVFP4_DS_MLA: {
      const int nb = kv_lora / kNvfp4Block;
      const uint8_t* sc = in + kv_lora / 2;
      for (int k = 0; k < kv_lora; ++k) {
        const uint8_t nib = static_cast<uint8_t>(k % 2 == 0 ? in[k / 2] & 0xf : in[k / 2] >> 4);
        row[k] = e2m1_to_float(nib) * e4m3_to_float(sc[k / kNvfp4Block]);
      }
      const uint8_t* pe = sc + nb;
      for (int i = 0; i < rope; ++i) row[kv_lora + i] = get_bf16(pe + 2 * i);
      return;
    }
  }
}

void round_trip_latent_row(LatentFormat f, float* row, int kv_lora, int rope) {
  // row: [kv_lora + rope] fp32, in place.
  if (f == LatentFormat::F32) return;
  std::vector<uint8_t> bytes(latent_entry_bytes(f, kv_lora, rope));
  encode_latent_row(f, row, kv_lora, rope, bytes.data());
  decode_latent_row(f, bytes.data(), kv_lora, rope, row);
}

}  // namespace k3::cpu
