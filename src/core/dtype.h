// Element types as named by the safetensors format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace k3 {

enum class DType : uint8_t {
  F64,
  F32,
  F16,
  BF16,
  F8_E4M3,
  F8_E5M2,
  I64,
  I32,
  I16,
  I8,
  U64,
  U32,
  U16,
  U8,
  BOOL,
};

// Bytes per element.
size_t dtype_size(DType t);
// The safetensors spelling ("BF16", "F8_E4M3", ...).
std::string_view dtype_name(DType t);
// Parses the safetensors spelling; throws k3::Error naming the string when unknown.
DType parse_dtype(std::string_view name);

}  // namespace k3
