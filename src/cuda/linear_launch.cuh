// Host side of the skinny GEMMs, shared by linear_bf16.cu and linear_mxfp4.cu: the kernel
// instantiations by (nt, mt), their register counts, the shared-memory opt-in, a plan cache and
// the launch itself (cudaLaunchKernelEx, with a cluster attribute when ck > 1).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/cluster_launch.cuh"
#include "cuda/cublas_linear.h"
#include "cuda/gemv_bf16.h"
#include "cuda/gemv_mxfp4.h"
#include "cuda/linear_fallback.cuh"
#include "cuda/linear_plan.h"
#include "cuda/skinny_gemm.cuh"

namespace k3::cuda::detail {

using SkinnyKernel = void (*)(SkinnyArgs);

template <class Fmt, bool kWg, bool kAlt>
SkinnyKernel skinny_kernel_of(int nt, int mt) {
  // Two row tiles a warp (mt 2) exist for mma.sync only.
  constexpr bool kMt2 = !kWg;
  switch (nt * 10 + mt) {
    case 11:
      return skinny_gemm_kernel<Fmt, 1, 1, kWg, kAlt>;
    case 21:
      return skinny_gemm_kernel<Fmt, 2, 1, kWg, kAlt>;
    case 41:
      return skinny_gemm_kernel<Fmt, 4, 1, kWg, kAlt>;
    case 42:
      if constexpr (kMt2) return skinny_gemm_kernel<Fmt, 4, 2, false, kAlt>;
      break;
    case 61:
      return skinny_gemm_kernel<Fmt, 6, 1, kWg, kAlt>;
    case 62:
      if constexpr (kMt2) return skinny_gemm_kernel<Fmt, 6, 2, false, kAlt>;
      break;
    case 81:
      return skinny_gemm_kernel<Fmt, 8, 1, kWg, kAlt>;
    case 82:
      if constexpr (kMt2) return skinny_gemm_kernel<Fmt, 8, 2, false, kAlt>;
      break;
    default:
      break;
  }
  fail("skinny GEMM: no kernel for nt ", nt, ", mt ", mt, kWg ? " (warpgroup)" : "");
}

// The kernel of (nt, mt, wg); warpgroup kernels exist for formats with kWarpgroupMma. alt: the
// kernels of the alternative forms (x through cp.async, the fast reduction: SkinnyArgs::x_async,
// fast_reduce), instantiated apart so that the default kernels' code stays as it was measured.
template <class Fmt>
SkinnyKernel skinny_kernel(int nt, int mt, bool wg, bool alt = false) {
  if constexpr (Fmt::kWarpgroupMma) {
    if (wg)
      return alt ? skinny_kernel_of<Fmt, true, true>(nt, mt)
                 : skinny_kernel_of<Fmt, true, false>(nt, mt);
  } else {
    K3_CHECK(!wg, "skinny GEMM: a warpgroup plan for a format without one");
  }
  return alt ? skinny_kernel_of<Fmt, false, true>(nt, mt)
             : skinny_kernel_of<Fmt, false, false>(nt, mt);
}

template <class Fmt>
int skinny_regs(int nt, int mt, bool wg) {
  static std::mutex mu;
  static std::map<int, int> cache;
  const int key = nt * 10 + mt + (wg ? 100 : 0);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes attr{};
  K3_CUDA_CHECK(cudaFuncGetAttributes(&attr, skinny_kernel<Fmt>(nt, mt, wg)));
  cache[key] = attr.numRegs;
  return attr.numRegs;
}

// Dynamic shared memory above 48 KB needs an opt-in per kernel (and device): done once, to the
// device maximum less the kernel's static shared memory (the grouped slot list), so that later
// launches (and graph captures) need nothing.
inline void allow_max_smem(const void* fn) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (!done.insert({fn, dev}).second) return;
  cudaFuncAttributes attr{};
  K3_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
  K3_CHECK(attr.sharedSizeBytes <= kSkinnyStaticSmem, "skinny GEMM: ", attr.sharedSizeBytes,
           " B of static shared memory, above the ", kSkinnyStaticSmem, " the planner reserves");
  K3_CUDA_CHECK(cudaFuncSetAttribute(
      fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(device_limits().smem_per_block_optin - attr.sharedSizeBytes)));
}

// Clusters of tiled plan p that the device holds at once (LinearClusterFit), cached per device,
// cluster size and CTAs per SM (what packing clusters into GPCs depends on), so a shape's
// planning asks the driver a few times, not once per candidate. 0 (unknown: the model prices
// waves by SMs) for plans without clusters, or where the query fails (said once on stderr).
template <class Fmt>
int skinny_cluster_fit(const LinearPlan& p, int ctas_per_sm) {
  if (p.ck <= 1 || p.fallback || p.cublas || p.streams_rows()) return 0;
  static std::mutex mu;
  static std::map<std::tuple<int, int, int>, int> cache;
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(dev, p.ck, ctas_per_sm);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const SkinnyKernel fn = skinny_kernel<Fmt>(p.nt, p.mt, p.wg);
  allow_max_smem(reinterpret_cast<const void*>(fn));  // the query needs the smem opt-in
  const ClusterLaunch launch(dim3(static_cast<unsigned>(p.ck)),
                             dim3(static_cast<unsigned>(p.threads())), p.smem_bytes, nullptr,
                             static_cast<unsigned>(p.ck));
  int clusters = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, fn, &launch.config);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    static std::once_flag warned;
    std::call_once(warned, [e] {
      std::fprintf(stderr,
                   "k3: cudaOccupancyMaxActiveClusters failed (%s); GEMM plans priced by SM "
                   "count\n",
                   cudaGetErrorString(e));
    });
    clusters = 0;
  }
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = clusters;
  return clusters;
}

// The best tiled plan for a shape (model-ranked), cached per device.
template <class Fmt>
LinearPlan best_plan(LinearWeight w, int m, int64_t n, int64_t k, int groups, int active = 0) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int64_t, int64_t, int, int, bool>, LinearPlan> cache;
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  // Batch invariance changes the candidates (no GEMV plans).
  const auto key = std::make_tuple(dev, m, n, k, groups, active, batch_invariant());
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const auto c = linear_candidates(w, m, n, k, groups, device_limits(), skinny_regs<Fmt>, active,
                                   skinny_cluster_fit<Fmt>);
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

// Launches plan p on args a (pointers, strides, m/n/k set by the caller); returns the launch's
// error instead of raising it (the tuner skips plans the device cannot launch).
template <class Fmt>
cudaError_t try_launch_skinny(const LinearPlan& p, SkinnyArgs a, cudaStream_t stream) {
  K3_CHECK(a.n == p.n && a.k == p.k && a.m <= p.m, "skinny GEMM: plan for ", p.m, "x", p.n, "x",
           p.k, " used for ", a.m, "x", a.n, "x", a.k);
  // Phase stamps (SkinnyArgs::stamps) exist in the tiled kernel only.
  K3_CHECK(!a.stamps || !(p.fallback || p.cublas || p.streams_rows()),
           "skinny GEMM: phase stamps need a tiled plan, not ", p.str());
  if (p.fallback) {
    K3_CHECK(!a.x_glu, "skinny GEMM: the GLU input needs a tiled plan, none fits ", p.m, "x", p.n,
             "x", p.k);
    const dim3 grid(static_cast<unsigned>((p.n + 7) / 8), static_cast<unsigned>(p.groups));
    linear_fallback_kernel<typename Fmt::Dec><<<grid, 256, 0, stream>>>(a);
    return cudaGetLastError();
  }
  if (p.gemv()) return launch_gemv_bf16(p, a, stream);
  if (p.gemv_fp4()) return launch_gemv_mxfp4(p, a, stream);
  if (p.cublas) return launch_cublas_linear(p, a, stream);
  a.wn = p.wn, a.wk = p.wk, a.ck = p.ck, a.stages = p.stages, a.chunks = p.chunks;
  a.n_slots = p.groups;
  a.x_pitch = p.x_pitch;
  a.x_bytes = static_cast<int>(p.x_bytes);
  a.x_async = skinny_x_async() ? 1 : 0;
  a.fast_reduce = p.fast_reduce ? 1 : 0;
  const SkinnyKernel fn = skinny_kernel<Fmt>(p.nt, p.mt, p.wg, a.x_async || a.fast_reduce);
  allow_max_smem(reinterpret_cast<const void*>(fn));
  const ClusterLaunch launch(dim3(static_cast<unsigned>(p.grid_x()),
                                  static_cast<unsigned>(a.slot_expert ? p.slot_ctas() : 1)),
                             dim3(static_cast<unsigned>(p.threads())), p.smem_bytes, stream,
                             static_cast<unsigned>(p.ck > 1 ? p.ck : 0));
  return cudaLaunchKernelEx(&launch.config, fn, a);
}

template <class Fmt>
void launch_skinny(const LinearPlan& p, SkinnyArgs a, cudaStream_t stream) {
  K3_CUDA_CHECK(try_launch_skinny<Fmt>(p, a, stream));
}

// Measured plan choice (K3_LINEAR_TUNING=0 turns it off): the planner's model ranks the tilings
// but is only a lead (bench/RESULTS.md: its pick is up to 2x off the best measured plan). The
// first time a shape runs outside a graph capture, its model-ranked candidates (the top six,
// then the best of each cluster size and warps-along-K count, at most 12) are timed on the
// call's own operands and the fastest is kept for the process; captured graphs and later steps
// reuse it. A GEMM writes y without reading it, so the repeated launches change nothing; the
// one-time cost is a few launches per candidate and a device sync (first step of each size,
// before any graph of it is captured).
//
// Each timed launch runs from a cold L2 (flush_l2 before it), as every weight does in a decode
// step: back-to-back repeats would time a matrix of up to ~50 MB out of L2, whose best tiling
// (fewer bytes in flight, fewer CTAs) is not the best one for a stream from HBM.
bool linear_tuning_enabled();
// Evicts L2 by writing twice its size of scratch (allocated once per device, on first use:
// tuning time, never inside a capture or a decode step; where that allocation fails, nothing).
void flush_l2(cudaStream_t stream);

// A tuned shape: the fastest plan, and the fastest of our own kernels (the same when that is
// one), which launches of the shape's key that cuBLAS cannot serve take (a GLU input, slots).
struct TunedPlan {
  LinearPlan best, native;
  const LinearPlan& for_launch(const SkinnyArgs& a) const {
    return best.cublas && (a.x_glu || a.slot_expert) ? native : best;
  }
};

template <class Fmt>
TunedPlan tune_plan(const std::vector<LinearPlan>& ranked, const SkinnyArgs& a, bool with_cublas,
                    cudaStream_t stream) {
  const std::vector<LinearPlan> list = tuning_shortlist(ranked, with_cublas);
  cudaEvent_t t0, t1;
  K3_CUDA_CHECK(cudaEventCreate(&t0));
  K3_CUDA_CHECK(cudaEventCreate(&t1));
  K3_CUDA_CHECK(cudaDeviceSynchronize());  // time alone on the device
  TunedPlan best{ranked.front(), ranked.front()};
  float best_ms = 0, native_ms = 0;
  bool have = false, have_native = false;
  constexpr int kReps = 3;
  for (const LinearPlan& p : list) {
    if (try_launch_skinny<Fmt>(p, a, stream) != cudaSuccess) {  // e.g. cluster not schedulable
      (void)cudaGetLastError();
      continue;
    }
    float ms = 0;  // the fastest of kReps cold launches
    for (int r = 0; r < kReps; ++r) {
      flush_l2(stream);
      K3_CUDA_CHECK(cudaEventRecord(t0, stream));
      K3_CUDA_CHECK(try_launch_skinny<Fmt>(p, a, stream));
      K3_CUDA_CHECK(cudaEventRecord(t1, stream));
      K3_CUDA_CHECK(cudaEventSynchronize(t1));
      float one = 0;
      K3_CUDA_CHECK(cudaEventElapsedTime(&one, t0, t1));
      ms = r == 0 ? one : std::min(ms, one);
    }
    if (!have || ms < best_ms) best.best = p, best_ms = ms, have = true;
    if (!p.cublas && (!have_native || ms < native_ms))
      best.native = p, native_ms = ms, have_native = true;
  }
  (void)cudaEventDestroy(t0);
  (void)cudaEventDestroy(t1);
  K3_CHECK(have_native, "skinny GEMM: no candidate plan of ", a.m, "x", a.n, "x", a.k,
           " could be launched");
  return best;
}

// The tuned plans of one plan family (Fmt::PlanKey): formats that differ only in how they stage
// x (the GLU input) share the plans of the weight format, so a fused launch sums K exactly as
// the plain launch it replaces.
using TunedKey = std::tuple<int, int, int64_t, int64_t, int, int, bool>;
template <class PlanKey>
std::pair<std::mutex&, std::map<TunedKey, TunedPlan>&> tuned_plans() {
  static std::mutex mu;
  static std::map<TunedKey, TunedPlan> tuned;
  return {mu, tuned};
}

// The plan of a.m x a.n x a.k (groups slots, `active` of them expected busy: LinearPlan): the
// tuned plan of the shape, tuning it first where allowed; `tiled_ok`: the operands meet the
// tiled kernel's alignment (else the fallback).
template <class Fmt>
LinearPlan planned(LinearWeight w, int plan_m, int groups, bool tiled_ok, const SkinnyArgs& a,
                   cudaStream_t stream, int active = 0) {
  using Key = typename Fmt::PlanKey;
  auto [mu, tuned] = tuned_plans<Key>();
  const bool invariant = batch_invariant();
  const auto fallback = [&] {  // the generic kernel for the shape
    LinearPlan p;
    p.weight = w, p.m = plan_m, p.n = a.n, p.k = a.k, p.groups = groups, p.fallback = true;
    return p;
  };
  if (!tiled_ok) return fallback();
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(dev, plan_m, static_cast<int64_t>(a.n),
                                   static_cast<int64_t>(a.k), groups, active, invariant);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = tuned.find(key);
    if (it != tuned.end()) return it->second.for_launch(a);
  }
  LinearPlan p = best_plan<Key>(w, plan_m, a.n, a.k, groups, active);
  std::vector<LinearPlan> ranked;
  if (invariant) {
    // Only the tilings that sum K as the one-row plan does (a deterministic model pick).
    const LinearPlan anchor = best_plan<Key>(w, 1, a.n, a.k, 1, 0);
    if (!anchor.fallback)
      ranked = same_k_order(linear_candidates(w, plan_m, a.n, a.k, groups, device_limits(),
                                              skinny_regs<Key>, active, skinny_cluster_fit<Key>),
                            anchor);
    p = ranked.empty() ? fallback() : ranked.front();
  }
  TunedPlan t{p, p};
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  K3_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
  if (!p.fallback && cap == cudaStreamCaptureStatusNone && linear_tuning_enabled() && a.x != a.y) {
    // Timed without the epilogue: repeated launches must not add into res again (y alone is
    // written, and the real launch below rewrites it).
    SkinnyArgs plain = a;
    plain.add = nullptr;
    plain.res = nullptr;
    if (!invariant)
      ranked = linear_candidates(w, plan_m, a.n, a.k, groups, device_limits(), skinny_regs<Key>,
                                 active, skinny_cluster_fit<Key>);
    // cuBLAS is timed where a launch of the shape may take it (and where it is switched on).
    const bool with_cublas =
        cublas_plans() && cublas_plan_applies(w, plan_m, groups, a.x_glu != nullptr, invariant) &&
        !a.slot_expert;
    t = tune_plan<Fmt>(ranked, plain, with_cublas, stream);
  }
  if (cap == cudaStreamCaptureStatusNone) {
    std::lock_guard<std::mutex> lock(mu);
    if (tuned.emplace(key, t).second && log_plans())
      std::fprintf(stderr, "k3 plan: m %d n %lld k %lld groups %d active %d: %s\n", plan_m,
                   static_cast<long long>(a.n), static_cast<long long>(a.k), groups, active,
                   t.best.str().c_str());
  }
  return t.for_launch(a);
}

// Launches a with planned()'s plan.
template <class Fmt>
void launch_planned(LinearWeight w, int plan_m, int groups, bool tiled_ok, const SkinnyArgs& a,
                    cudaStream_t stream, int active = 0) {
  launch_skinny<Fmt>(planned<Fmt>(w, plan_m, groups, tiled_ok, a, stream, active), a, stream);
}

}  // namespace k3::cuda::detail
