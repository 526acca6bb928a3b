#include "model/weight_matrix.h"

#include <cmath>
#include <cstring>

#include "core/numeric.h"

namespace k3 {

std::string_view weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::F32:
      return "F32";
    case WeightFormat::BF16:
      return "BF16";
    case WeightFormat::F16:
      return "F16";
    case WeightFormat::MXFP4:
      return "MXFP4";
  }
  return "?";
}

float WeightMatrix::at(int64_t r, int64_t c) const {
  const int64_t i = r * cols + c;
  switch (format) {
    case WeightFormat::F32: {
      float f;
      std::memcpy(&f, static_cast<const uint8_t*>(data) + 4 * i, 4);
      return f;
    }
    case WeightFormat::BF16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const uint8_t*>(data) + 2 * i, 2);
      return bf16_to_float(h);
    }
    case WeightFormat::F16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const uint8_t*>(data) + 2 * i, 2);
      return f16_to_float(h);
    }
    case WeightFormat::MXFP4: {
      const uint8_t byte = static_cast<const uint8_t*>(data)[i / 2];
      const uint8_t nib = (c & 1) ? (byte >> 4) : (byte & 0x0f);
      return e2m1_to_float(nib) * e8m0_to_float(scales[r * (cols / 32) + c / 32]);
    }
  }
  fail("internal: bad weight format");
}

void WeightMatrix::row_to_float(int64_t r, float* out) const {
  if (format == WeightFormat::MXFP4) {
    const uint8_t* p = static_cast<const uint8_t*>(data) + r * (cols / 2);
    const uint8_t* s = scales + r * (cols / 32);
    for (int64_t b = 0; b < cols / 32; ++b) {
      const float scale = e8m0_to_float(s[b]);
      for (int k = 0; k < 16; ++k) {
        const uint8_t byte = p[b * 16 + k];
        out[b * 32 + 2 * k] = e2m1_to_float(byte & 0x0f) * scale;
        out[b * 32 + 2 * k + 1] = e2m1_to_float(byte >> 4) * scale;
      }
    }
    return;
  }
  for (int64_t c = 0; c < cols; ++c) out[c] = at(r, c);
}

uint64_t WeightMatrix::storage_bytes() const {
  const uint64_t n = static_cast<uint64_t>(rows * cols);
  switch (format) {
    case WeightFormat::F32:
      return 4 * n;
    case WeightFormat::BF16:
    case WeightFormat::F16:
      return 2 * n;
    case WeightFormat::MXFP4:
      return n / 2 + n / 32;
  }
  return 0;
}

WeightMatrix WeightMatrix::from_tensor(const TensorView& t) {
  WeightMatrix m;
  m.name = t.name;
  switch (t.dtype) {
    case DType::F32:
      m.format = WeightFormat::F32;
      break;
    case DType::BF16:
      m.format = WeightFormat::BF16;
      break;
    case DType::F16:
      m.format = WeightFormat::F16;
      break;
    default:
      fail("tensor ", t.name, ": dtype ", dtype_name(t.dtype), " cannot be used as a dense weight");
  }
  if (t.shape.size() == 2) {
    m.rows = t.shape[0];
    m.cols = t.shape[1];
  } else if (t.shape.size() == 3 && t.shape[1] == 1) {
    m.rows = t.shape[0];
    m.cols = t.shape[2];
  } else if (t.shape.size() == 1) {
    m.rows = 1;
    m.cols = t.shape[0];
  } else {
    fail("tensor ", t.name, ": shape ", shape_str(t.shape), " is not a matrix");
  }
  m.data = t.data;
  return m;
}

WeightMatrix WeightMatrix::from_mxfp4(const TensorView& packed, const TensorView& scale) {
  K3_CHECK(packed.dtype == DType::U8 && scale.dtype == DType::U8, "MXFP4 tensors ", packed.name,
           " / ", scale.name, " must be U8, got ", dtype_name(packed.dtype), " / ",
           dtype_name(scale.dtype));
  K3_CHECK(packed.shape.size() == 2 && scale.shape.size() == 2, "MXFP4 tensors ", packed.name,
           " must be 2-D");
  const int64_t rows = packed.shape[0], cols = packed.shape[1] * 2;
  K3_CHECK(scale.shape[0] == rows && scale.shape[1] * 32 == cols, "MXFP4 scale ", scale.name,
           " has shape ", shape_str(scale.shape), ", expected [", rows, ", ", cols / 32,
           "] for packed ", shape_str(packed.shape));
  WeightMatrix m;
  m.name = packed.name;
  m.format = WeightFormat::MXFP4;
  m.rows = rows;
  m.cols = cols;
  m.data = packed.data;
  m.scales = scale.data;
  return m;
}

void quantize_mxfp4(const float* w, int64_t rows, int64_t cols, uint8_t* packed, uint8_t* scales) {
  K3_CHECK(cols % 32 == 0, "MXFP4 needs cols % 32 == 0, got ", cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / 32; ++b) {
      const float* x = w + r * cols + b * 32;
      float amax = 0.0f;
      for (int k = 0; k < 32; ++k) amax = std::fmax(amax, std::fabs(x[k]));
      // Smallest power of two with amax / scale <= 6 (the largest E2M1 magnitude).
      int e = amax > 0.0f ? static_cast<int>(std::ceil(std::log2(amax / 6.0f))) : -127;
      if (e < -127) e = -127;
      if (e > 127) e = 127;
      scales[r * (cols / 32) + b] = static_cast<uint8_t>(e + 127);
      const float inv = std::ldexp(1.0f, -e);
      for (int k = 0; k < 16; ++k) {
        const uint8_t lo = float_to_e2m1(x[2 * k] * inv);
        const uint8_t hi = float_to_e2m1(x[2 * k + 1] * inv);
        packed[r * (cols / 2) + b * 16 + k] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

}  // namespace k3
