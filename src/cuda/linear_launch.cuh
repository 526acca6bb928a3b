// Host side of the skinny GEMMs, shared by linear_bf16.cu and linear_mxfp4.cu: the kernel
// instantiations by (nt, mt), their register counts, the shared-memory opt-in, a plan cache and
// the launch itself (cudaLaunchKernelEx, with a cluster attribute when ck > 1).
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/cluster_launch.cuh"
#include "cuda/linear_fallback.cuh"
#include "cuda/linear_plan.h"
#include "cuda/skinny_gemm.cuh"

namespace k3::cuda::detail {

using SkinnyKernel = void (*)(SkinnyArgs);

template <class Fmt>
SkinnyKernel skinny_kernel(int nt, int mt) {
  switch (nt * 10 + mt) {
    case 11:
      return skinny_gemm_kernel<Fmt, 1, 1>;
    case 21:
      return skinny_gemm_kernel<Fmt, 2, 1>;
    case 41:
      return skinny_gemm_kernel<Fmt, 4, 1>;
    case 42:
      return skinny_gemm_kernel<Fmt, 4, 2>;
    case 61:
      return skinny_gemm_kernel<Fmt, 6, 1>;
    case 62:
      return skinny_gemm_kernel<Fmt, 6, 2>;
    case 81:
      return skinny_gemm_kernel<Fmt, 8, 1>;
    case 82:
      return skinny_gemm_kernel<Fmt, 8, 2>;
    default:
      break;
  }
  fail("skinny GEMM: no kernel for nt ", nt, ", mt ", mt);
}

template <class Fmt>
int skinny_regs(int nt, int mt) {
  static std::mutex mu;
  static std::map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(nt * 10 + mt);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes attr{};
  K3_CUDA_CHECK(cudaFuncGetAttributes(&attr, skinny_kernel<Fmt>(nt, mt)));
  cache[nt * 10 + mt] = attr.numRegs;
  return attr.numRegs;
}

// Dynamic shared memory above 48 KB needs an opt-in per kernel (and device): done once, to the
// device maximum, so that later launches (and graph captures) need nothing.
inline void allow_max_smem(const void* fn) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (!done.insert({fn, dev}).second) return;
  K3_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(device_limits().smem_per_block_optin)));
}

// The best tiled plan for a shape (model-ranked), cached per device.
template <class Fmt>
LinearPlan best_plan(LinearWeight w, int m, int64_t n, int64_t k, int groups) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int64_t, int64_t, int>, LinearPlan> cache;
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(dev, m, n, k, groups);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const auto c = linear_candidates(w, m, n, k, groups, device_limits(), skinny_regs<Fmt>);
  LinearPlan p;
  if (c.empty()) {
    p.weight = w, p.m = m, p.n = n, p.k = k, p.groups = groups, p.fallback = true;
  } else {
    p = c.front();
  }
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = p;
  return p;
}

// Launches plan p on args a (pointers, strides, m/n/k set by the caller).
template <class Fmt>
void launch_skinny(const LinearPlan& p, SkinnyArgs a, cudaStream_t stream) {
  K3_CHECK(a.n == p.n && a.k == p.k && a.m <= p.m, "skinny GEMM: plan for ", p.m, "x", p.n, "x",
           p.k, " used for ", a.m, "x", a.n, "x", a.k);
  if (p.fallback) {
    const dim3 grid(static_cast<unsigned>((p.n + 7) / 8), static_cast<unsigned>(p.groups));
    linear_fallback_kernel<typename Fmt::Dec><<<grid, 256, 0, stream>>>(a);
    K3_CUDA_CHECK_LAUNCH();
    return;
  }
  a.wn = p.wn, a.wk = p.wk, a.ck = p.ck, a.stages = p.stages, a.chunks = p.chunks;
  a.x_pitch = p.x_pitch;
  a.x_bytes = static_cast<int>(p.x_bytes);
  const SkinnyKernel fn = skinny_kernel<Fmt>(p.nt, p.mt);
  allow_max_smem(reinterpret_cast<const void*>(fn));
  const ClusterLaunch launch(
      dim3(static_cast<unsigned>(p.grid_x()), static_cast<unsigned>(p.groups)),
      dim3(static_cast<unsigned>(p.threads())), p.smem_bytes, stream,
      static_cast<unsigned>(p.ck > 1 ? p.ck : 0));
  K3_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, fn, a));
}

}  // namespace k3::cuda::detail
