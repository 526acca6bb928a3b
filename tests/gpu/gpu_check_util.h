// Comparison helpers shared by the GPU suites: tolerances in bf16 ulps of the reference plus a
// fraction of its RMS, and a check that reports how many elements fail and the first of them.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/linear_plan.h"

namespace k3::gpu_test {

// Turns the MXFP4 GEMV plans on for one test (they are on by default, but K3_MXFP4_GEMV=0 may
// have left them out), restoring the switch after, so later tests keep their own candidates.
struct Mxfp4GemvScope {
  bool was = cuda::mxfp4_gemv_plans();
  Mxfp4GemvScope() { cuda::set_mxfp4_gemv_plans(true); }
  ~Mxfp4GemvScope() { cuda::set_mxfp4_gemv_plans(was); }
};
// Offers the warpgroup (wgmma) MXFP4 tilings (off by default) within a test.
struct Mxfp4WgmmaScope {
  bool was = cuda::mxfp4_wgmma_plans();
  Mxfp4WgmmaScope() { cuda::set_mxfp4_wgmma_plans(true); }
  ~Mxfp4WgmmaScope() { cuda::set_mxfp4_wgmma_plans(was); }
};

// Sets how the tiled GEMM stages x (cp.async or through registers) and which form of its
// reduction plans made from here on take, within a test.
struct SkinnyFormsScope {
  bool was_async = cuda::skinny_x_async(), was_fast = cuda::skinny_fast_reduce();
  SkinnyFormsScope(bool x_async, bool fast_reduce) {
    cuda::set_skinny_x_async(x_async);
    cuda::set_skinny_fast_reduce(fast_reduce);
  }
  ~SkinnyFormsScope() {
    cuda::set_skinny_x_async(was_async);
    cuda::set_skinny_fast_reduce(was_fast);
  }
};

struct Tol {
  double ulps;  // bf16 ulps of |ref| (a summation-order change flips at most one rounding)
  double rel;   // times the RMS of the reference
};

inline double bf16_ulp(double v) {
  v = std::fabs(v);
  if (v < 0x1p-126) return 0x1p-133;
  int e = 0;
  std::frexp(v, &e);  // v = f * 2^e, f in [0.5, 1)
  return std::ldexp(1.0, e - 1 - 7);
}

template <typename R>
double rms(const std::vector<R>& v) {
  double s = 0;
  for (R x : v) s += static_cast<double>(x) * static_cast<double>(x);
  return v.empty() ? 0.0 : std::sqrt(s / static_cast<double>(v.size()));
}

// Every got[i] finite and within tol of ref[i] (float or double references).
template <typename R>
void expect_close(const std::vector<float>& got, const std::vector<R>& ref, Tol tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const double scale = rms(ref);
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double r = static_cast<double>(ref[i]);
    const double lim = tol.ulps * bf16_ulp(r) + tol.rel * scale;
    if (!std::isfinite(got[i]) || !(std::fabs(static_cast<double>(got[i]) - r) <= lim)) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " outside tolerance; first #"
                    << first << " got " << (first >= 0 ? got[first] : 0.0f) << " ref "
                    << (first >= 0 ? static_cast<double>(ref[first]) : 0.0);
}

}  // namespace k3::gpu_test
