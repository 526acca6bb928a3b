// A non-owning, typed view of one tensor's bytes (usually inside an mmap'd checkpoint).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace k3 {

using Shape = std::vector<int64_t>;

inline int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s);  // "[12288, 7168]"

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  const uint8_t* data = nullptr;  // nbytes bytes, little endian, row-major
  size_t nbytes = 0;

  bool empty() const { return data == nullptr; }
  int64_t numel() const { return k3::numel(shape); }
  int64_t dim(size_t i) const {
    K3_CHECK(i < shape.size(), "tensor ", name, " has no dim ", i);
    return shape[i];
  }
  template <typename T>
  const T* as() const {
    K3_CHECK(sizeof(T) == dtype_size(dtype), "tensor ", name, ": element size mismatch");
    return reinterpret_cast<const T*>(data);
  }
  // Element i converted to float (F32, BF16, F16, F8_E4M3, F64 only).
  float get(int64_t i) const;
  // The whole tensor converted to float (same dtypes as get()).
  std::vector<float> to_float() const;
};

}  // namespace k3
