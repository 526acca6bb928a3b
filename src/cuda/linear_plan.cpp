// Skinny-GEMM plans: shared-memory layout, and a small bandwidth model that ranks the tilings.
// The model is a lead, not a measurement: bench/bench_linear.cu times the top candidates.
#include "cuda/linear_plan.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/wgmma_x_layout.h"

namespace k3::cuda {

DeviceLimits device_limits() {
  static std::mutex mu;
  static std::array<DeviceLimits, 64> cache{};
  static std::array<bool, 64> have{};
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (dev >= 0 && dev < 64 && have[dev]) return cache[dev];
  DeviceLimits d;
  int v = 0;
  K3_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
  d.sms = v;
  K3_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  d.smem_per_block_optin = static_cast<size_t>(v);
  K3_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  d.smem_per_sm = static_cast<size_t>(v);
  K3_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxRegistersPerMultiprocessor, dev));
  d.regs_per_sm = v;
  K3_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxThreadsPerMultiProcessor, dev));
  d.max_threads_per_sm = v;
  if (dev >= 0 && dev < 64) {
    cache[dev] = d;
    have[dev] = true;
  }
  return d;
}

std::string LinearPlan::str() const {
  std::ostringstream os;
  if (fallback) {
    os << "fallback";
    return os.str();
  }
  if (cublas) return "cublas";
  if (gemv_fp4()) {
    os << "gemv-fp4 p" << gemv_fp4_pieces << " w" << threads() / 32 << " grid" << grid_x() << "x"
       << slot_ctas() << " smem" << (smem_bytes + 1023) / 1024 << "K";
    return os.str();
  }
  if (gemv()) {
    os << "gemv ks" << gemv_ks << " rpw" << gemv_rpw << " grid" << grid_x();
    return os.str();
  }
  os << (wg ? "wg " : "") << "nt" << nt << " mt" << mt << " wn" << wn << " wk" << wk << " ck" << ck
     << " s" << stages << " grid" << grid_x() * slot_ctas() << "x" << threads()
     << (active_groups > 0 && active_groups < groups ? " busy" + std::to_string(active_groups) : "")
     << " smem" << (smem_bytes + 1023) / 1024 << "K";
  return os.str();
}

int LinearPlan::threads() const {
  if (gemv()) return 256;
  if (gemv_fp4()) return 32 * gemv_mxfp4_warps(k, gemv_fp4_pieces);
  return 32 * wn * wk;
}

int gemv_mxfp4_warps(int64_t k, int pieces) {
  const int64_t n_pieces = k / kGemvMxfp4PieceK;
  return static_cast<int>((n_pieces + pieces - 1) / pieces);
}

int linear_chunk_k(LinearWeight w) {
  return w == LinearWeight::BF16 ? 64 : 256;
}

int linear_stage_bytes(LinearWeight w, int mt) {
  // bf16: 16*mt rows x 64 k x 2 B. MXFP4: 16*mt rows x 128 B packed, plus each thread's copy
  // of its two rows' 8 scale bytes (32 lanes x 2 rows x 8 B per 16 rows).
  return w == LinearWeight::BF16 ? 2048 * mt : 2560 * mt;
}

double linear_weight_bytes(LinearWeight w, int64_t n, int64_t k) {
  const double e = static_cast<double>(n) * static_cast<double>(k);
  return w == LinearWeight::BF16 ? 2.0 * e : e / 2.0 + e / 32.0;
}

int gemv_units_per_lane(int64_t k, int ks) {
  return static_cast<int>((k / 8 + 32LL * ks - 1) / (32LL * ks));
}

bool finalize_plan(LinearPlan& p, const DeviceLimits& d) {
  if (p.fallback) return true;
  if (p.cublas) {  // cuBLAS stages nothing of ours
    p.chunks = 0, p.x_pitch = 0, p.x_bytes = 0, p.smem_bytes = 0;
    return p.weight == LinearWeight::BF16 && p.groups == 1 && p.m >= 1 && p.m <= 64 &&
           p.gemv_ks == 0 && p.n <= 0x7fffffff && p.k <= 0x7fffffff;
  }
  if (p.gemv_fp4()) {
    if (p.weight != LinearWeight::MXFP4 || p.m < 1 || p.m > kGemvMxfp4MaxRows || p.k % 256 != 0 ||
        p.gemv_ks != 0 || p.k > 0x7fffffff || p.n > 0x7fffffff)
      return false;
    if (p.gemv_fp4_pieces != 1 && p.gemv_fp4_pieces != 2 && p.gemv_fp4_pieces != 4) return false;
    if (p.threads() > gemv_mxfp4_max_threads(p.gemv_fp4_pieces)) return false;
    // Per warp: its pieces of every x row (+16 B: conflict-free with the swizzle); then one
    // [pieces][rows][16] partial tile per 128-k piece, summed in piece order.
    p.chunks = static_cast<int>(p.k / kGemvMxfp4PieceK);
    p.x_pitch = p.gemv_fp4_pieces * kGemvMxfp4PieceK * 2 + 16;
    p.x_bytes = static_cast<size_t>(p.threads() / 32) * p.m * p.x_pitch;
    p.smem_bytes = p.x_bytes + static_cast<size_t>(p.chunks) * p.m * 16 * sizeof(float);
    return p.smem_bytes + kSkinnyStaticSmem <= d.smem_per_block_optin;
  }
  if (p.gemv()) {
    if (p.weight != LinearWeight::BF16 || p.m < 1 || p.m > kGemvMaxRows || p.groups != 1 ||
        p.k % 8 != 0)
      return false;
    if (p.gemv_ks != 1 && p.gemv_ks != 2 && p.gemv_ks != 4 && p.gemv_ks != 8) return false;
    const int j = gemv_units_per_lane(p.k, p.gemv_ks);
    if (p.gemv_rpw < 1 || j < 1 || j > gemv_max_units_per_lane(p.m)) return false;
    p.chunks = 0, p.x_pitch = 0, p.x_bytes = 0;
    p.smem_bytes =
        static_cast<size_t>(p.rows_per_cta()) * p.gemv_ks * gemv_rows_instance(p.m) * sizeof(float);
    return p.smem_bytes + kSkinnyStaticSmem <= d.smem_per_block_optin;
  }
  const int kc = linear_chunk_k(p.weight);
  if (p.threads() > linear_max_threads(p.nt, p.mt, p.wg) || p.threads() < 64) return false;
  if (p.ck < 1 || p.ck > 8 || p.stages < 2 || p.stages > 7 || p.m > 8 * p.nt) return false;
  if (p.wg && (p.weight != LinearWeight::MXFP4 || p.mt != 1 || p.wn % 4 != 0)) return false;
  p.chunks = static_cast<int>((p.k + kc - 1) / kc);
  if (p.chunks < p.ck * p.wk) return false;  // every warp gets at least one chunk
  const int per_cta = (p.chunks + p.ck - 1) / p.ck;
  const int mx = std::min(p.m, 8 * p.nt);
  const size_t rings =
      static_cast<size_t>(p.wn * p.wk) * p.stages * linear_stage_bytes(p.weight, p.mt);
  size_t staging = 0;  // past the rings: x as loaded, before the scatter into the wgmma tiles
  if (p.wg) {
    // wgmma B tiles: 16 steps of 16 k per chunk, each 8 * nt tokens x 32 bytes
    // (wgmma_x_layout.h). x_pitch: the row pitch of x as cp.async loads it, under
    // skinny_x_async() where that fits beside the tiles and rings (0: x goes through registers).
    p.x_bytes =
        static_cast<size_t>(detail::wg_step(per_cta, 0, 0, 0)) * detail::wg_tile_bytes(p.nt);
    const int raw_pitch = per_cta * kc * 2;
    const size_t raw = static_cast<size_t>(mx) * raw_pitch;
    const bool fits =
        skinny_x_async() && p.x_bytes + rings + raw + kSkinnyStaticSmem <= d.smem_per_block_optin;
    p.x_pitch = fits ? raw_pitch : 0;
    staging = fits ? raw : 0;
  } else {
    // Row pitch of the staged x: +64 B (bf16) / +16 B (MXFP4, with a swizzle) keeps the 16-byte
    // fragment reads of one warp conflict-free (skinny_gemm.cuh).
    p.x_pitch = per_cta * kc * 2 + (p.weight == LinearWeight::BF16 ? 64 : 16);
    p.x_bytes = (static_cast<size_t>(mx) * p.x_pitch + 127) / 128 * 128;
  }
  p.fast_reduce = skinny_fast_reduce();
  const size_t red = static_cast<size_t>(p.wk) * mx *
                     skinny_red_pitch(p.rows_per_cta(), p.fast_reduce) * sizeof(float);
  p.smem_bytes = std::max(p.x_bytes + rings + staging, red);
  return p.smem_bytes + kSkinnyStaticSmem <= d.smem_per_block_optin;
}

double read_curve_tbps(const double* mib, const double* tbps, int n, double bytes) {
  K3_CHECK(n >= 1, "read_curve_tbps: an empty curve");
  const double mb = bytes / (1024.0 * 1024.0);
  if (mb <= mib[0]) return tbps[0] * std::max(mb, 1e-6) / mib[0];
  for (int i = 1; i < n; ++i)
    if (mb <= mib[i]) {
      const double t = std::log(mb / mib[i - 1]) / std::log(mib[i] / mib[i - 1]);
      return tbps[i - 1] + t * (tbps[i] - tbps[i - 1]);
    }
  return tbps[n - 1];
}

double h200_read_curve_tbps(double bytes) {
  static constexpr double kMB[] = {1, 4, 8, 16, 32, 64, 128};
  static constexpr double kTBps[] = {0.8, 1.8, 2.7, 3.1, 3.7, 4.1, 4.2};
  return read_curve_tbps(kMB, kTBps, 7, bytes);
}

namespace {

// Model constants: leads, to be refitted from the k3_bench_ops plan sweep on the H200.
constexpr double kLatencyUs = 1.0;  // loaded DRAM latency: in-flight bytes / latency
constexpr double kSmBwCap = 50e9;   // bytes/s one SM can pull (a guess, see above)
constexpr double kSmemBw = 200e9;   // shared-memory bytes/s per SM usable here
constexpr double kXUnitUs = 0.25;   // x staging, per 16-byte unit of a thread (see below)
// Cluster barriers + DSMEM reduction: the phase stamps measured ~2 us more than a plan without
// a cluster (the sync waits for the cluster's slowest CTA, then one DSMEM round trip per sum).
constexpr double kClusterUs = 2.0;
constexpr double kCtaReduceUs = 0.3;  // intra-CTA reduction and output

double model_us(const LinearPlan& p, const DeviceLimits& d, int regs, const LinearClusterFit& fit) {
  const int threads = p.threads();
  int occ = static_cast<int>(d.smem_per_sm / (p.smem_bytes + 1024));
  occ = std::min(occ, d.max_threads_per_sm / threads);
  if (regs > 0) occ = std::min(occ, d.regs_per_sm / (threads * ((regs + 7) / 8 * 8)));
  occ = std::min(occ, 32);
  if (occ <= 0) return 1e30;
  const int busy = p.active_groups > 0 ? std::min(p.active_groups, p.groups) : p.groups;
  const double grid = static_cast<double>(p.grid_x()) * busy;
  const double conc_sms = static_cast<double>(d.sms) * occ;
  double conc = conc_sms;
  if (p.ck > 1 && fit) {  // resident clusters, where the device says (GPCs, not SMs, bound them)
    const int clusters = fit(p, occ);
    if (clusters > 0) conc = std::min(conc, static_cast<double>(clusters) * p.ck);
  }
  const double waves = std::ceil(grid / conc);
  const double wbytes = linear_weight_bytes(p.weight, p.n, p.k) * busy;
  const double per_cta = wbytes / grid;
  const double cta_per_sm = std::min<double>(occ, grid / d.sms);  // average over busy SMs
  const double cta_per_sm_max = std::min<double>(occ, std::ceil(grid / d.sms));
  const double active_sms = std::min<double>(d.sms, grid);
  const int kc = linear_chunk_k(p.weight);
  const int per_warp = std::max(1, (p.chunks / p.ck) / p.wk);
  const double in_flight = cta_per_sm * p.wn * p.wk * std::min(p.stages - 1, per_warp) *
                           linear_stage_bytes(p.weight, p.mt) *
                           (p.weight == LinearWeight::BF16 ? 1.0 : 0.8);
  // Little's law, saturating smoothly at the per-SM cap (more in flight always helps a little).
  const double sm_bw = kSmBwCap * (1.0 - std::exp(-in_flight / (kSmBwCap * kLatencyUs * 1e-6)));
  const double bw = std::min(h200_read_curve_tbps(wbytes) * 1e12, active_sms * sm_bw);
  // Partial last wave: the time is set by whole waves. Fewer resident clusters never make it
  // faster (fewer CTAs a wave need not stream less), so the SM-count pricing is a floor.
  const auto waves_us = [&](double c) {
    return wbytes / bw * (std::ceil(grid / c) * std::min(grid, c) / grid) * 1e6;
  };
  const double t_w = std::max(waves_us(conc_sms), waves_us(conc));
  // Shared memory: W written and read once, x fragments read by each row set (a warp's 16 mt
  // rows, or a warpgroup's 64).
  const int mx = std::min(p.m, 8 * p.nt);
  const double bpe = p.weight == LinearWeight::BF16 ? 2.0 : 0.53125;
  const double x_ratio = 2.0 * mx / ((p.wg ? 64.0 : 16.0 * p.mt) * bpe);
  const double t_smem = per_cta * cta_per_sm_max * waves * (2.0 + x_ratio) / kSmemBw * 1e6;
  // x staging: each thread loads its share of the CTA's x slice one 16-byte unit at a time
  // (load, permute, store) while the W prologue is in flight, so it costs a round trip per unit
  // of a thread, not bytes over a bandwidth: the kernel's phase stamps measured ~0.5 us per unit
  // with x cold (k3_bench_ops --phases), and the plan sweeps fit 0.25 us with x in L2, as in a
  // step (bench/RESULTS.md, twenty-sixth stop).
  const double units = std::ceil(static_cast<double>(p.chunks) / p.ck) * kc / 8.0;
  const double t_x = waves * std::ceil(mx * units / threads) * kXUnitUs;
  const double t_red = (p.ck > 1 ? kClusterUs : 0.0) + kCtaReduceUs;
  return std::max(t_w, t_smem) + waves * kLatencyUs + t_x + t_red;
}

// GEMV plans: W streamed at the read curve when enough bytes are in flight per SM (each warp's
// J units of the current and the next row), slowed when the grid leaves SMs idle, plus the x
// segments every warp re-reads from L2 and a little per k segment (its reduction). Fitted by
// eye to the prototype's sweep on the H200 (bench/RESULTS.md); the tuner measures anyway.
double gemv_model_us(const LinearPlan& p, const DeviceLimits& d) {
  constexpr double kInFlightPerSm = 64.0 * 1024;  // bytes that keep one SM at its share
  constexpr double kL2Bps = 8e12;
  const double bytes = linear_weight_bytes(LinearWeight::BF16, p.n, p.k);
  const double grid = static_cast<double>(p.grid_x());
  const double active = std::min<double>(d.sms, grid);
  const double warps_per_sm = std::min(64.0, grid * 8.0 / active);
  const int j = gemv_units_per_lane(p.k, p.gemv_ks);
  const double in_flight = warps_per_sm * j * 512.0 * (p.gemv_rpw > 1 ? 2.0 : 1.0);
  const double bw = h200_read_curve_tbps(bytes) * 1e12 * std::min(1.0, in_flight / kInFlightPerSm) *
                    active / d.sms;
  const double t_x = grid * 8.0 * (static_cast<double>(p.k) / p.gemv_ks) * 2.0 / kL2Bps;
  return (bytes / bw + t_x) * 1e6 + 0.5 + 0.05 * p.gemv_ks;
}

// MXFP4 GEMV plans: every warp requests all its bytes at once, so a wave of CTAs streams at
// the read curve when the bytes it holds in flight cover the latency, plus a latency per wave
// and the dequantization and mma work of a warp's pieces, which run one after another. Priced
// for one weight matrix whatever the slot counts, so that launches of one expert shape with
// other slot counts (the stock and specialized paths) make the same pick.
double gemv_fp4_model_us(const LinearPlan& p, const DeviceLimits& d) {
  constexpr double kInFlightPerSm = 48.0 * 1024;
  constexpr double kWaveLatencyUs = 1.5;
  constexpr double kPieceUs = 0.25;  // one warp's dequantization and 8 mma of 16 x 128 weights
  const int regs = p.gemv_fp4_pieces >= 4 ? 80 : 64;
  const int threads = p.threads();
  int occ = d.max_threads_per_sm / threads;
  occ = std::min(occ, d.regs_per_sm / (threads * regs));
  occ = std::min<int>(occ, static_cast<int>(d.smem_per_sm / (p.smem_bytes + 1024)));
  if (occ <= 0) return 1e30;
  const double bytes = linear_weight_bytes(LinearWeight::MXFP4, p.n, p.k);
  const double grid = static_cast<double>(p.grid_x());
  const double conc = static_cast<double>(d.sms) * occ;
  const double waves = std::ceil(grid / conc);
  const double per_sm = std::min<double>(occ, grid / d.sms);
  const double in_flight = per_sm * threads * p.gemv_fp4_pieces * 34.0;  // 32 packed + 2 scale B
  const double bw = h200_read_curve_tbps(bytes) * 1e12 * std::min(1.0, in_flight / kInFlightPerSm);
  const double t_w = bytes / bw * (waves * std::min(grid, conc) / grid) * 1e6;
  return t_w + waves * (kWaveLatencyUs + kPieceUs * p.gemv_fp4_pieces) + kCtaReduceUs;
}

}  // namespace

std::vector<LinearPlan> linear_candidates(LinearWeight w, int m, int64_t n, int64_t k, int groups,
                                          const DeviceLimits& d, const LinearRegs& regs,
                                          int active_groups, const LinearClusterFit& cluster_fit) {
  K3_CHECK(m >= 1 && m <= 64, "linear plan: m = ", m, " (1..64 per launch)");
  K3_CHECK(n >= 1 && k >= 1 && groups >= 1, "linear plan: n ", n, ", k ", k, ", groups ", groups);
  static constexpr int kNt[] = {1, 2, 4, 6, 8};
  int nt = 0;
  for (int t : kNt)
    if (8 * t >= m) {
      nt = t;
      break;
    }
  std::vector<LinearPlan> out;
  // (mt, wg) kernels: mma.sync with one or two row tiles a warp, and for MXFP4 the warpgroup one.
  std::vector<std::pair<int, bool>> kernels{{1, false}};
  if (nt >= 4) kernels.push_back({2, false});
  if (w == LinearWeight::MXFP4 && mxfp4_wgmma_plans()) kernels.push_back({1, true});
  for (const auto& [mt, wg] : kernels) {
    const int r = regs ? regs(nt, mt, wg) : 0;
    for (int wn = wg ? 4 : 1; wn <= 8; wn += wg ? 4 : 1)
      for (int wk = 1; wk <= 8; ++wk)
        for (int ck = 1; ck <= 8; ++ck)
          for (int stages : {2, 3, 4, 6}) {
            LinearPlan p;
            p.weight = w;
            p.m = m;
            p.n = n;
            p.k = k;
            p.groups = groups;
            p.active_groups = active_groups;
            p.nt = nt;
            p.mt = mt;
            p.wg = wg;
            p.wn = wn;
            p.wk = wk;
            p.ck = ck;
            p.stages = stages;
            if (!finalize_plan(p, d)) continue;
            if (p.grid_x() > 0x7fffffff / 2) continue;
            p.model_us = model_us(p, d, r, cluster_fit);
            out.push_back(p);
          }
  }
  const auto by_model = [](const LinearPlan& a, const LinearPlan& b) {
    return a.model_us < b.model_us;
  };
  std::stable_sort(out.begin(), out.end(), by_model);
  // A GEMV kind's plans, best model first: ahead of the tilings for one row, after them else.
  const auto place_gemv = [&](std::vector<LinearPlan>& gemv) {
    std::stable_sort(gemv.begin(), gemv.end(), by_model);
    out.insert(m == 1 ? out.begin() : out.end(), gemv.begin(), gemv.end());
  };
  // Dense bf16 launches of 1..4 rows also get GEMV plans, best model first. For one row they go
  // first: the prototype sweep measured the best GEMV ahead of every mma tiling on each one-row
  // shape it timed, which the mma model does not capture. With more rows x takes m times the
  // registers and the tilings go first (at 4 rows the prototype lost to cuBLAS); the tuner times
  // both kinds. Not under batch invariance: the GEMV sums K in another order than the tilings.
  if (w == LinearWeight::BF16 && m <= kGemvMaxRows && groups == 1 && !batch_invariant()) {
    std::vector<LinearPlan> gemv;
    for (int ks : {1, 2, 4, 8})
      for (int rpw : {1, 2, 4, 8, 16}) {
        LinearPlan p;
        p.weight = w, p.m = m, p.n = n, p.k = k, p.groups = 1;
        p.gemv_ks = ks, p.gemv_rpw = rpw;
        if (!finalize_plan(p, d) || p.grid_x() > 0x7fffffff) continue;
        p.model_us = gemv_model_us(p, d);
        gemv.push_back(p);
      }
    place_gemv(gemv);
  }
  // MXFP4 launches of 1..8 rows per slot, likewise: at one row the tiled kernel's shared-memory
  // ring leaves it latency-bound (ncu: one CTA per SM, DRAM at 10% of peak), which the GEMV's
  // all-in-registers loads avoid; with more rows the tilings go first and the tuner decides.
  if (w == LinearWeight::MXFP4 && m <= kGemvMxfp4MaxRows && !batch_invariant() &&
      mxfp4_gemv_plans()) {
    std::vector<LinearPlan> gemv;
    for (int pieces : {1, 2, 4}) {
      LinearPlan p;
      p.weight = w, p.m = m, p.n = n, p.k = k, p.groups = groups, p.active_groups = active_groups;
      p.gemv_fp4_pieces = pieces;
      if (!finalize_plan(p, d)) continue;
      p.model_us = gemv_fp4_model_us(p, d);
      gemv.push_back(p);
    }
    place_gemv(gemv);
  }
  return out;
}

LinearPlan cublas_plan(int m, int64_t n, int64_t k) {
  K3_CHECK(m >= 1 && m <= 64 && n >= 1 && k >= 1, "cuBLAS plan: shape ", m, "x", n, "x", k);
  LinearPlan p;
  p.weight = LinearWeight::BF16, p.m = m, p.n = n, p.k = k, p.groups = 1, p.cublas = true;
  return p;
}

bool cublas_plan_applies(LinearWeight w, int m, int groups, bool glu_input, bool invariant) {
  return w == LinearWeight::BF16 && m >= cublas_min_rows() && groups == 1 && !glu_input &&
         !invariant;
}

std::vector<LinearPlan> same_k_order(const std::vector<LinearPlan>& c, const LinearPlan& anchor) {
  std::vector<LinearPlan> out;
  for (const LinearPlan& p : c)
    // (wgmma and mma.sync may round their in-instruction sums differently: same kind only.)
    if (!p.fallback && !p.streams_rows() && !p.cublas && p.wk == anchor.wk && p.ck == anchor.ck &&
        p.wg == anchor.wg)
      out.push_back(p);
  return out;
}

}  // namespace k3::cuda

namespace k3::cuda::detail {

bool linear_tuning_enabled() {
  return linear_tuning();
}

void flush_l2(cudaStream_t stream) {
  static std::mutex mu;
  static std::array<std::pair<void*, size_t>, 64> scratch{};  // per device, kept for the process
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  K3_CHECK(dev >= 0 && dev < 64, "flush_l2: device ", dev);
  static std::array<bool, 64> tried{};
  std::pair<void*, size_t> buf;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!tried[dev]) {
      tried[dev] = true;
      int l2 = 0;
      K3_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
      const size_t bytes = 2 * static_cast<size_t>(std::max(l2, 8 << 20));
      // A device already full (weights and caches first) tunes from a warm L2 instead.
      if (cudaMalloc(&scratch[dev].first, bytes) == cudaSuccess) {
        scratch[dev].second = bytes;
      } else {
        (void)cudaGetLastError();  // clear the failed allocation's error
        scratch[dev].first = nullptr;
      }
    }
    buf = scratch[dev];
  }
  if (buf.first) K3_CUDA_CHECK(cudaMemsetAsync(buf.first, 0x5a, buf.second, stream));
}

std::vector<LinearPlan> tuning_shortlist(const std::vector<LinearPlan>& ranked, bool with_cublas) {
  std::vector<LinearPlan> out;
  // The best six GEMV plans (where the shape has any), then up to 12 tiled ones.
  for (const LinearPlan& p : ranked)
    if (p.streams_rows() && out.size() < 6) out.push_back(p);
  const size_t n_gemv = out.size();
  const auto have = [&](auto pred) { return std::any_of(out.begin() + n_gemv, out.end(), pred); };
  for (const LinearPlan& p : ranked) {
    if (p.streams_rows()) continue;
    if (out.size() - n_gemv >= 12) break;
    if (have([&](const LinearPlan& q) { return q.str() == p.str(); })) continue;
    const bool novel = out.size() - n_gemv < 6 ||
                       !have([&](const LinearPlan& q) { return q.ck == p.ck; }) ||
                       !have([&](const LinearPlan& q) { return q.wk == p.wk; });
    if (novel) out.push_back(p);
  }
  // Warpgroup tilings too, where the model left them out (it prices bytes and latency, not the
  // instruction counts in which they differ from the mma.sync tilings): for each warps-along-N
  // count (one or two warpgroups a CTA), the best two of distinct cluster sizes.
  for (int wn : {4, 8}) {
    const auto same_wn = [&](const LinearPlan& q) { return q.wg && q.wn == wn; };
    int n = static_cast<int>(std::count_if(out.begin() + n_gemv, out.end(), same_wn));
    for (const LinearPlan& p : ranked) {
      if (!same_wn(p) || n >= 2) continue;
      if (have([&](const LinearPlan& q) { return same_wn(q) && q.ck == p.ck; })) continue;
      out.push_back(p);
      ++n;
    }
  }
  if (with_cublas && !ranked.empty()) {
    const LinearPlan& s = ranked.front();
    out.push_back(cublas_plan(s.m, s.n, s.k));
  }
  return out;
}

}  // namespace k3::cuda::detail
