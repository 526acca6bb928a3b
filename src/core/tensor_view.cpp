#include "core/tensor_view.h"

#include <cstring>
#include <sstream>

#include "core/numeric.h"

namespace k3 {

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

float TensorView::get(int64_t i) const {
  switch (dtype) {
    case DType::F32: {
      float f;
      std::memcpy(&f, data + 4 * i, 4);
      return f;
    }
    case DType::BF16: {
      uint16_t h;
      std::memcpy(&h, data + 2 * i, 2);
      return bf16_to_float(h);
    }
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, data + 2 * i, 2);
      return f16_to_float(h);
    }
    case DType::F8_E4M3:
      return e4m3_to_float(data[i]);
    case DType::F64: {
      double d;
      std::memcpy(&d, data + 8 * i, 8);
      return static_cast<float>(d);
    }
    default:
      fail("tensor ", name, ": dtype ", dtype_name(dtype), " is not a floating-point type");
  }
}

std::vector<float> TensorView::to_float() const {
  const int64_t n = numel();
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = get(i);
  return out;
}

}  // namespace k3
