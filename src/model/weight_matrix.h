// A 2-D weight as the ops see it: [rows, cols] in one of the checkpoint formats, read
// without copying. PyTorch Linear layout: rows = out features, cols = in features.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor_view.h"

namespace k3 {

enum class WeightFormat : uint8_t { F32, BF16, F16, MXFP4 };

std::string_view weight_format_name(WeightFormat f);

struct WeightMatrix {
  std::string name;
  WeightFormat format = WeightFormat::BF16;
  int64_t rows = 0, cols = 0;
  // F32/BF16/F16: [rows, cols] elements. MXFP4: [rows, cols/2] u8, element 2k in the low nibble.
  const void* data = nullptr;
  // MXFP4 only: [rows, cols/32] u8 E8M0 scales.
  const uint8_t* scales = nullptr;

  bool empty() const { return data == nullptr; }
  // Element (r, c) as float.
  float at(int64_t r, int64_t c) const;
  // Row r as floats, out[cols].
  void row_to_float(int64_t r, float* out) const;
  // Bytes this matrix occupies in its storage format.
  uint64_t storage_bytes() const;

  // A dense matrix over a 2-D tensor (or a 3-D [rows, 1, cols] one, e.g. conv weights).
  static WeightMatrix from_tensor(const TensorView& t);
  // A compressed-tensors MXFP4 matrix: packed [rows, cols/2] U8 + scale [rows, cols/32] U8.
  static WeightMatrix from_mxfp4(const TensorView& packed, const TensorView& scale);
};

// MXFP4 quantization of a row-major fp32 matrix [rows, cols] (cols % 32 == 0), as the
// synthetic checkpoint writes it: per 32-block scale 2^(ceil(log2(amax/6))), elements
// rounded to the nearest E2M1 value. packed: rows*cols/2 bytes, scales: rows*cols/32 bytes.
void quantize_mxfp4(const float* w, int64_t rows, int64_t cols, uint8_t* packed, uint8_t* scales);

}  // namespace k3
