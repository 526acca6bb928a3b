// Deterministic random numbers (SplitMix64 + Box-Muller), identical on every platform,
// so a seed names the same synthetic checkpoint and the same sampled tokens everywhere.
#pragma once

#include <cmath>
#include <cstdint>

namespace k3 {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t next_u64() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  float uniform(float lo, float hi) { return lo + static_cast<float>(uniform()) * (hi - lo); }
  // Standard normal.
  float normal() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = static_cast<float>(r * std::sin(2.0 * M_PI * u2));
    have_spare_ = true;
    return static_cast<float>(r * std::cos(2.0 * M_PI * u2));
  }

 private:
  uint64_t state_;
  float spare_ = 0.0f;
  bool have_spare_ = false;
};

// A seed derived from a base seed and a name, so each tensor gets its own stream.
inline uint64_t derive_seed(uint64_t base, const char* name) {
  uint64_t h = 1469598103934665603ull ^ base;  // FNV-1a over the name
  for (const char* p = name; *p; ++p) h = (h ^ static_cast<unsigned char>(*p)) * 1099511628211ull;
  return h;
}

}  // namespace k3
