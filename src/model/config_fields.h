// Internal to the config parser (config_parse.cpp, config_json.cpp): a JSON object reader that
// tracks consumed keys (so unknown fields can be named) and typed conversions whose errors name
// the field's full path and the expected type.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "model/config.h"

namespace k3::config_detail {

using json = nlohmann::json;

inline std::string shown(const json& v) {
  std::string s = v.dump();
  return s.size() > 48 ? s.substr(0, 45) + "..." : s;
}

[[noreturn]] inline void type_error(const std::string& path, const char* expected, const json& v) {
  fail("config field \"", path, "\" must be ", expected, ", got ", v.type_name(), " ", shown(v));
}

template <typename... Parts>
[[noreturn]] void field_error(const std::string& path, Parts&&... parts) {
  fail("config field \"", path, "\" ", std::forward<Parts>(parts)...);
}

// One JSON object being read. `prefix` is the object's path plus "." ("" at the top level).
class Fields {
 public:
  Fields(const json& j, std::string prefix) : j_(j), prefix_(std::move(prefix)) {
    if (j.is_object()) return;
    if (prefix_.empty()) fail("config.json must be a JSON object, got ", j.type_name());
    type_error(prefix_.substr(0, prefix_.size() - 1), "an object", j);
  }
  std::string path(std::string_view key) const { return prefix_ + std::string(key); }
  const std::string& prefix() const { return prefix_; }
  // The value (marked consumed), or null when absent.
  const json* take(std::string_view key) {
    const auto it = j_.find(std::string(key));
    if (it == j_.end()) return nullptr;
    used_.insert(std::string(key));
    return &*it;
  }
  template <size_t N>
  void ignore(const std::string_view (&keys)[N]) {
    for (auto k : keys) take(k);
  }
  // Any key not taken is unknown.
  void finish() const {
    for (const auto& [k, v] : j_.items())
      if (!used_.count(k)) fail("unknown config field \"", prefix_, k, "\"");
  }

 private:
  const json& j_;
  std::string prefix_;
  std::set<std::string> used_;
};

template <typename T>
T convert(const json& v, const std::string& path) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) type_error(path, "a boolean", v);
    return v.get<bool>();
  } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, int>) {
    if (!v.is_number_integer()) type_error(path, "an integer", v);
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
      field_error(path, "is out of range: ", shown(v));
    const int64_t x = v.get<int64_t>();
    if (std::is_same_v<T, int> && (x < INT32_MIN || x > INT32_MAX))
      field_error(path, "is out of range: ", x);
    return static_cast<T>(x);
  } else if constexpr (std::is_same_v<T, float>) {
    if (!v.is_number()) type_error(path, "a number", v);
    return v.get<float>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) type_error(path, "a string", v);
    return v.get<std::string>();
  } else if constexpr (std::is_same_v<T, DType>) {
    const auto s = convert<std::string>(v, path);
    if (s == "bfloat16") return DType::BF16;
    if (s == "float16") return DType::F16;
    if (s == "float32") return DType::F32;
    field_error(path, "must be one of bfloat16, float16, float32, got \"", s, "\"");
  } else {  // std::vector<E>
    using E = typename T::value_type;
    // eos_token_id may be a single integer (HF allows int or list).
    if constexpr (std::is_same_v<E, int64_t>)
      if (v.is_number_integer()) return T{convert<E>(v, path)};
    if (!v.is_array())
      type_error(path,
                 std::is_same_v<E, std::string> ? "a list of strings"
                 : std::is_same_v<E, int64_t>   ? "an integer or a list of integers"
                                                : "a list of integers",
                 v);
    T out;
    for (size_t i = 0; i < v.size(); ++i)
      out.push_back(convert<E>(v[i], path + "[" + std::to_string(i) + "]"));
    return out;
  }
}

// Absent -> nullopt; null is a type error (get_nullable: null means "unset").
template <typename T>
std::optional<T> get(Fields& f, std::string_view key) {
  const json* v = f.take(key);
  if (!v) return std::nullopt;
  return convert<T>(*v, f.path(key));
}
template <typename T>
std::optional<T> get_nullable(Fields& f, std::string_view key) {
  const json* v = f.take(key);
  if (!v || v->is_null()) return std::nullopt;
  return convert<T>(*v, f.path(key));
}
template <typename T>
T need(const std::optional<T>& v, const std::string& path) {
  if (!v) field_error(path, "is required");
  return *v;
}
template <typename T>
T require(Fields& f, std::string_view key) {
  return need(get<T>(f, key), f.path(key));
}

template <typename T>
std::string show(const T& v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, bool>)
    os << (v ? "true" : "false");
  else if constexpr (std::is_same_v<T, DType>)
    os << dtype_name(v);
  else if constexpr (std::is_same_v<T, std::vector<int64_t>>)
    os << json(v).dump();
  else
    os << v;
  return os.str();
}

// Two spellings of one value (an alias, or K3's top level vs text_config): equal when both given.
template <typename T>
std::optional<T> agree(const std::optional<T>& a, const std::string& pa, const std::optional<T>& b,
                       const std::string& pb) {
  if (a && b && !(*a == *b))
    fail("config fields \"", pa, "\" and \"", pb, "\" disagree (", show(*a), " vs ", show(*b), ")");
  return a ? a : b;
}
template <typename T>
std::optional<T> get_aliased(Fields& f, std::string_view key, std::string_view alias) {
  const auto a = get<T>(f, key);
  const auto b = get<T>(f, alias);
  return agree(a, f.path(key), b, f.path(alias));
}
template <typename T, typename U>
void set_if(U& dst, const std::optional<T>& v) {
  if (v) dst = *v;
}

// The sub-objects (config_json.cpp, which also writes them back). `path` names the object.
QuantizationConfig parse_quantization_config(const json& j, const std::string& path);
DsaConfig parse_dsa_config(const json& j, const std::string& path);

}  // namespace k3::config_detail
