// Shared test helpers: fresh random seeds (printed, overridable with K3_TEST_SEED), random
// inputs, and error metrics against float64 references.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/rng.h"

namespace k3::test {

// A new seed per call unless K3_TEST_SEED is set; the seed goes into the failure message
// (use: const uint64_t seed = test_seed(); SCOPED_TRACE(seed_trace(seed));).
inline uint64_t test_seed() {
  if (const char* s = std::getenv("K3_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}
inline std::string seed_trace(uint64_t seed) {
  return "seed " + std::to_string(seed) + " (rerun with K3_TEST_SEED=" + std::to_string(seed) + ")";
}

// A fresh, empty directory private to this test process (ctest runs tests in parallel).
inline std::filesystem::path temp_dir(const std::string& name) {
  const auto d = std::filesystem::temp_directory_path() /
                 ("k3_test_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(d);
  return d;
}

inline std::vector<float> random_normal(Rng& rng, size_t n, float scale = 1.0f) {
  std::vector<float> v(n);
  for (auto& x : v) x = rng.normal() * scale;
  return v;
}

// bf16 weights as stored in a checkpoint (bits), and their float values.
inline std::vector<uint16_t> random_bf16(Rng& rng, size_t n, float scale = 1.0f) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16(rng.normal() * scale);
  return v;
}

// ||a - b|| / ||b|| over doubles.
template <typename A, typename B>
double rel_l2(const A& a, const B& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}

template <typename A, typename B>
double max_abs_diff(const A& a, const B& b) {
  double m = 0;
  for (size_t i = 0; i < b.size(); ++i)
    m = std::fmax(m, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return m;
}

}  // namespace k3::test
