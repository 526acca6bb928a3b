// k3_bench_ops: times the CUDA stock-path kernels at Kimi K3 shapes against the H200 read curve
// (shared/spec/h200-ceilings.md), this GPU's own read curve measured first in the same run
// (read_curve.h) and cuBLAS, with a CPU correctness check beside each line.
//
// Timing. Every case is captured in CUDA graphs and replayed; times are medians.
//   us      one graph of R back-to-back launches over R copies of the weights (R copies exceed
//           2x the 60 MB L2, so every launch reads cold weights), 50 replays, replay time / R.
//           What a launch costs inside a decode graph: kernel plus the node gap.
//   lat_us  one launch per replay between two events, after a 256 MB scratch write (not timed)
//           that evicts L2. Includes the graph-launch latency: an upper bound.
// GB/s counts each byte once (weights + x + y); %4.3T, %curve (the H200 table) and %card (this
// GPU's measured curve, which an op is 100% of when it reads as fast as a plain read of its
// bytes) use `us`. Ops whose R copies fit in L2 are marked "warm" (their `us` is L2-hot; lat_us
// is cold).
//
// Usage: k3_bench_ops [--quick] [--no-sweep] [--filter SUBSTRING] [--sweep-only SUBSTRING]
//                    [--phases]
// (--sweep-only: time only the sweep plans whose description contains it, e.g. to profile one;
// --phases: under each timed tiled sweep plan, where its cold launches spend their time, from the
// kernel's phase stamps: skinny_phases.h)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/rng.h"
#include "cpu/ops_basic.h"
#include "cpu/sampling.h"
#include "cuda/argmax.h"
#include "cuda/attn_res.h"
#include "cuda/check.h"
#include "cuda/device_buffer.h"
#include "cuda/linear_bf16.h"
#include "cuda/linear_mxfp4.h"
#include "cuda/linear_plan.h"
#include "cuda/rms_norm.h"
#include "graph_timing.h"
#include "model/weight_matrix.h"
#include "read_curve.h"
#include "skinny_phases.h"

namespace k3 {
namespace {

using cuda::bf16;
using cuda::DeviceBuffer;

constexpr double kPeakTBps = 4.3;
constexpr double kL2Bytes = 60e6;
constexpr size_t kScratchBytes = 256ull << 20;
constexpr int kReplays = 50;
constexpr int kMaxCopies = 64;

struct Result {
  std::string kernel, shape, note;
  int m = 0;
  double bytes = 0, us = 0, lat_us = 0, maxrel = 0;
  bool warm = false;
};
std::vector<Result> g_results;
std::vector<std::string> g_sweeps;
std::string g_sweep_only;  // --sweep-only: the sweep times only plans whose str() contains it
bool g_phases = false;     // --phases: the phase stamps of each timed tiled sweep plan
bench::ReadCurve g_card;   // this GPU's read curve, measured first

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Timer {
  cudaStream_t st = nullptr;
  DeviceBuffer<uint8_t> scratch{kScratchBytes};
  cudaEvent_t a, b;
  Timer() {
    K3_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    K3_CUDA_CHECK(cudaEventCreate(&a));
    K3_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~Timer() {
    (void)cudaEventDestroy(a);
    (void)cudaEventDestroy(b);
    (void)cudaStreamDestroy(st);
  }
  double elapsed_us() {
    K3_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    K3_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return 1000.0 * ms;
  }
  // Median per-launch time of R back-to-back launches (copies 0..R-1) in one graph.
  double batched_us(const std::function<void(int, cudaStream_t)>& enqueue, int R) {
    return bench::graph_batched_us(enqueue, R, st, kReplays);
  }
  // Median time of one launch per replay after an L2-evicting scratch write.
  double cold_us(const std::function<void(int, cudaStream_t)>& enqueue, int R) {
    std::vector<cudaGraphExec_t> e;
    for (int c = 0; c < R; ++c) e.push_back(bench::capture_launches(enqueue, c, 1, st));
    std::vector<double> t;
    for (int i = 0; i < kReplays + 3; ++i) {
      K3_CUDA_CHECK(cudaMemsetAsync(scratch.data(), i & 0xff, kScratchBytes, st));
      K3_CUDA_CHECK(cudaEventRecord(a, st));
      K3_CUDA_CHECK(cudaGraphLaunch(e[i % R], st));
      K3_CUDA_CHECK(cudaEventRecord(b, st));
      const double us = elapsed_us();
      if (i >= 3) t.push_back(us);
    }
    for (auto x : e) K3_CUDA_CHECK(cudaGraphExecDestroy(x));
    return median(t);
  }
};

int copies_for(double bytes_per_copy) {
  const int r = static_cast<int>(std::ceil(2.2 * kL2Bytes / bytes_per_copy));
  return std::clamp(r, 1, kMaxCopies);
}

std::vector<float> bf16_floats(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_float(b[i]);
  return f;
}
// Uniform in [-scale*sqrt(3), scale*sqrt(3)) (variance scale^2), four values per draw: the big
// weights are hundreds of millions of values and Box-Muller would dominate the run.
std::vector<float> random_floats(Rng& rng, size_t n, float scale) {
  std::vector<float> v(n);
  const float a = scale * 1.7320508f / 32768.0f;
  for (size_t i = 0; i < n; i += 4) {
    const uint64_t u = rng.next_u64();
    for (size_t j = 0; j < 4 && i + j < n; ++j)
      v[i + j] = a * static_cast<float>(static_cast<int16_t>(u >> (16 * j)));
  }
  return v;
}
std::vector<uint16_t> random_bf16(Rng& rng, size_t n, float scale) {
  const auto f = random_floats(rng, n, scale);
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = float_to_bf16(f[i]);
  return v;
}

// max |gpu - ref| / rms(ref) over 64 sampled weight rows and all M tokens.
double gemm_maxrel(const WeightMatrix& w, const std::vector<float>& x, int M,
                   const std::vector<float>& y, Rng& rng) {
  double num = 0, den = 0;
  int cnt = 0;
  for (int s = 0; s < 64; ++s) {
    const int64_t r = s == 63 ? w.rows - 1 : static_cast<int64_t>(rng.uniform() * w.rows);
    for (int m = 0; m < M; ++m) {
      float ref = 0;
      cpu::linear_rows(w, r, 1, x.data() + static_cast<int64_t>(m) * w.cols, &ref);
      const double d = std::fabs(static_cast<double>(y[static_cast<size_t>(m) * w.rows + r]) - ref);
      num = std::isfinite(d) ? std::max(num, d) : INFINITY;
      den += static_cast<double>(ref) * ref;
      ++cnt;
    }
  }
  return num / std::sqrt(den / cnt + 1e-30);
}

std::vector<float> read_bf16(const DeviceBuffer<bf16>& d) {
  return bf16_floats(cuda::to_host<uint16_t>(d));
}

void record(Result r) {
  const double gbps = r.bytes / (r.us * 1e-6) / 1e9;
  const double curve = cuda::h200_read_curve_tbps(r.bytes) * 1e3;
  std::printf(
      "%-12s %-10s M=%-3d %8.2f us (lat %7.2f)  %7.1f GB/s  %5.1f%% of 4.3T  %5.1f%% of curve  "
      "%5.1f%% of card  maxrel %.1e  %s%s\n",
      r.kernel.c_str(), r.shape.c_str(), r.m, r.us, r.lat_us, gbps, 100 * gbps / (kPeakTBps * 1e3),
      100 * gbps / curve, g_card.percent(gbps, r.bytes), r.maxrel, r.warm ? "[warm] " : "",
      r.note.c_str());
  std::fflush(stdout);
  g_results.push_back(std::move(r));
}

// ---- GEMMs ----
struct GemmCase {
  const char* name;
  int64_t n, k;
  bool fp4;
};

void bench_gemm(Timer& t, const GemmCase& c, const std::vector<int>& ms, bool sweep, Rng& rng) {
  const int64_t N = c.n, K = c.k;
  const double wbytes =
      cuda::linear_weight_bytes(c.fp4 ? cuda::LinearWeight::MXFP4 : cuda::LinearWeight::BF16, N, K);
  const int R = copies_for(wbytes);
  const std::string shape = std::to_string(N) + "x" + std::to_string(K);
  // Weights: one random host matrix, R device copies.
  std::vector<uint16_t> wb;
  std::vector<uint8_t> wp, ws;
  WeightMatrix wm;
  wm.rows = N, wm.cols = K;
  if (c.fp4) {
    const std::vector<float> f =
        random_floats(rng, static_cast<size_t>(N * K), 1.0f / std::sqrt(static_cast<float>(K)));
    wp.resize(static_cast<size_t>(N * K / 2));
    ws.resize(static_cast<size_t>(N * K / 32));
    quantize_mxfp4(f.data(), N, K, wp.data(), ws.data());
    wm.format = WeightFormat::MXFP4, wm.data = wp.data(), wm.scales = ws.data();
  } else {
    wb = random_bf16(rng, static_cast<size_t>(N * K), 1.0f / std::sqrt(static_cast<float>(K)));
    wm.format = WeightFormat::BF16, wm.data = wb.data();
  }
  std::vector<DeviceBuffer<uint8_t>> dw, dws;
  for (int r = 0; r < R; ++r) {
    if (c.fp4) {
      dw.push_back(cuda::to_device<uint8_t>(wp));
      dws.push_back(cuda::to_device<uint8_t>(ws));
    } else {
      dw.emplace_back(wb.size() * 2);
      cuda::copy_to_device(dw.back(), reinterpret_cast<const uint8_t*>(wb.data()), wb.size() * 2);
    }
  }
  for (int M : ms) {
    const double bytes = wbytes + 2.0 * M * K + 2.0 * M * N;
    const auto xb = random_bf16(rng, static_cast<size_t>(M) * K, 1.0f);
    const auto xf = bf16_floats(xb);
    const auto dx = cuda::to_device<bf16>(xb);
    DeviceBuffer<bf16> dy(static_cast<size_t>(M) * N);

    auto ours = [&](const cuda::LinearPlan* p) {
      return [&, p](int copy, cudaStream_t s) {
        if (c.fp4) {
          if (p)
            cuda::linear_mxfp4(*p, dx.data(), K, dw[copy].data(), dws[copy].data(), M, dy.data(), N,
                               false, s);
          else
            cuda::linear_mxfp4(dx.data(), K, dw[copy].data(), dws[copy].data(), M, N, K, dy.data(),
                               N, false, s);
        } else {
          const bf16* w = reinterpret_cast<const bf16*>(dw[copy].data());
          if (p)
            cuda::linear_bf16(*p, dx.data(), K, w, M, dy.data(), N, false, s);
          else
            cuda::linear_bf16(dx.data(), K, w, M, N, K, dy.data(), N, false, s);
        }
      };
    };
    const cuda::LinearPlan plan =
        c.fp4 ? cuda::plan_linear_mxfp4(M, N, K) : cuda::plan_linear_bf16(M, N, K);
    Result r;
    r.kernel = c.fp4 ? "mxfp4" : "bf16";
    r.shape = shape;
    r.m = M;
    r.bytes = bytes;
    r.us = t.batched_us(ours(nullptr), R);
    r.lat_us = t.cold_us(ours(nullptr), R);
    r.maxrel = gemm_maxrel(wm, xf, M, read_bf16(dy), rng);
    r.note = std::string(c.name) + " | " + plan.str();
    record(r);

    if (sweep) {
      const auto cand =
          c.fp4 ? cuda::linear_mxfp4_candidates(M, N, K) : cuda::linear_bf16_candidates(M, N, K);
      // What the tuner times (linear_launch.cuh): the model's best GEMV plans, then its top
      // tilings and the best of each cluster size and warps-along-K count, then cuBLAS.
      const std::vector<cuda::LinearPlan> try_plans = cuda::detail::tuning_shortlist(
          cand,
          cuda::cublas_plan_applies(c.fp4 ? cuda::LinearWeight::MXFP4 : cuda::LinearWeight::BF16, M,
                                    1, false, cuda::batch_invariant()));
      // Then up to 6 more warpgroup tilings (model order; offered under K3_MXFP4_WGMMA=1) the
      // shortlist leaves out: the model does not price what sets them apart (instruction
      // counts), so the sweep shows more of them.
      std::vector<std::pair<cuda::LinearPlan, bool>> sweep_plans;
      for (const auto& p : try_plans) sweep_plans.push_back({p, false});
      int extra = 0;
      for (const auto& p : cand) {
        if (!p.wg || extra >= 6) continue;
        const bool listed = std::any_of(try_plans.begin(), try_plans.end(),
                                        [&](const auto& q) { return q.str() == p.str(); });
        if (!listed) sweep_plans.push_back({p, true}), ++extra;
      }
      double best = 1e30;
      std::string best_plan;
      for (const auto& [p, beyond] : sweep_plans) {
        if (p.str().find(g_sweep_only) == std::string::npos) continue;
        const double us = t.batched_us(ours(&p), R);
        std::printf("    sweep %-10s M=%-3d %8.2f us  model %6.2f  %s%s\n", shape.c_str(), M, us,
                    p.model_us, p.str().c_str(), beyond ? "  (not in the tuner's list)" : "");
        if (g_phases && !p.fallback && !p.cublas && !p.streams_rows()) {
          const cuda::LinearPlan plan_copy = p;
          auto stamped = [&](long long* stamps, cudaStream_t s) {
            if (c.fp4)
              cuda::linear_mxfp4(plan_copy, dx.data(), K, dw[0].data(), dws[0].data(), M, dy.data(),
                                 N, false, s, stamps);
            else
              cuda::linear_bf16(plan_copy, dx.data(), K,
                                reinterpret_cast<const bf16*>(dw[0].data()), M, dy.data(), N, false,
                                s, stamps);
          };
          std::printf(
              "      phases us (median/max over CTAs): %s\n",
              bench::skinny_phases(p, stamped, t.st, t.scratch.data(), kScratchBytes).c_str());
        }
        if (us < best) best = us, best_plan = p.str();
      }
      char line[512];
      std::snprintf(
          line, sizeof line, "%-6s %-10s M=%-3d default %7.2f us (%s) | best %7.2f us (%s)",
          r.kernel.c_str(), shape.c_str(), M, r.us, plan.str().c_str(), best, best_plan.c_str());
      g_sweeps.push_back(line);
    }

    if (!c.fp4) {  // cuBLAS on the same bf16 shape: the engine's cuBLAS plan (cublas_linear.h)
      const cuda::LinearPlan blas_plan = cuda::cublas_plan(M, N, K);
      auto blas = ours(&blas_plan);
      Result b = r;
      b.kernel = "cublas";
      b.us = t.batched_us(blas, R);
      b.lat_us = t.cold_us(blas, R);
      b.maxrel = gemm_maxrel(wm, xf, M, read_bf16(dy), rng);
      b.note = c.name;
      record(b);
    }
  }  // M
}

// ---- row ops ----
void bench_rms_norm(Timer& t, int M, Rng& rng) {
  const int64_t H = 7168;
  const double bytes = 4.0 * M * H + 4.0 * H;
  const int R = copies_for(2.0 * M * H);
  std::vector<DeviceBuffer<bf16>> x;
  std::vector<uint16_t> xb;
  for (int r = 0; r < R; ++r) {
    xb = random_bf16(rng, static_cast<size_t>(M * H), 1.0f);
    x.push_back(cuda::to_device<bf16>(xb));
  }
  std::vector<float> w(H);
  for (auto& v : w) v = 1.0f + 0.1f * rng.normal();
  const auto dw = cuda::to_device<float>(w);
  DeviceBuffer<bf16> y(static_cast<size_t>(M * H));
  auto op = [&](int c, cudaStream_t s) {
    cuda::rms_norm(x[c].data(), H, dw.data(), M, H, 1e-5f, y.data(), H, s);
  };
  Result r;
  r.kernel = "rms_norm", r.shape = "7168", r.m = M, r.bytes = bytes;
  r.us = t.batched_us(op, R);
  r.lat_us = t.cold_us(op, R);
  r.warm = R * 2.0 * M * H < 2 * kL2Bytes;
  op(R - 1, t.st);  // check the last copy's row 0
  K3_CUDA_CHECK(cudaStreamSynchronize(t.st));
  const auto got = read_bf16(y);
  std::vector<float> ref(H);
  const auto xf = bf16_floats(xb);
  cpu::rms_norm(xf.data(), w.data(), H, 1e-5f, ref.data());
  double e = 0;
  for (int64_t i = 0; i < H; ++i) e = std::max(e, static_cast<double>(std::fabs(got[i] - ref[i])));
  r.maxrel = e;  // |ref| ~ 1
  record(r);
}

void bench_attn_res(Timer& t, int M, Rng& rng) {
  const int64_t H = 7168;
  const int n = 9;  // the final mix: 8 banked blocks + the partial sum
  const double bytes = 2.0 * (n + 1) * M * H + 4.0 * H;
  const int R = copies_for(2.0 * n * M * H);
  std::vector<DeviceBuffer<bf16>> bank;
  for (int r = 0; r < R; ++r)
    bank.push_back(cuda::to_device<bf16>(random_bf16(rng, static_cast<size_t>(n * M * H), 1.0f)));
  const auto w = [&] {
    std::vector<float> v(H);
    for (auto& x : v) x = rng.normal() * 2.0f / std::sqrt(static_cast<float>(H));
    return v;
  }();
  const auto dw = cuda::to_device<float>(w);
  DeviceBuffer<bf16> y(static_cast<size_t>(M * H));
  auto op = [&](int c, cudaStream_t s) {
    cuda::attn_res_mix(bank[c].data(), n, M * H, H, dw.data(), M, H, 1e-5f, y.data(), H, nullptr,
                       s);
  };
  Result r;
  r.kernel = "attn_res", r.shape = "9x7168", r.m = M, r.bytes = bytes;
  r.us = t.batched_us(op, R);
  r.lat_us = t.cold_us(op, R);
  r.warm = R * 2.0 * n * M * H < 2 * kL2Bytes;
  r.note = "checked by k3_gpu_tests";
  record(r);
}

void bench_argmax(Timer& t, int M, Rng& rng) {
  const int64_t V = 163840;
  const double bytes = 4.0 * M * V + 8.0 * M;
  const int R = copies_for(4.0 * M * V);
  std::vector<DeviceBuffer<float>> x;
  std::vector<float> h(static_cast<size_t>(M * V));
  for (int r = 0; r < R; ++r) {
    h = random_floats(rng, h.size(), 1.0f);  // 16-bit values: many ties, as real logits can have
    x.push_back(cuda::to_device<float>(h));
  }
  DeviceBuffer<int64_t> ids(M);
  auto op = [&](int c, cudaStream_t s) { cuda::argmax(x[c].data(), V, M, V, ids.data(), s); };
  Result r;
  r.kernel = "argmax", r.shape = "163840", r.m = M, r.bytes = bytes;
  r.us = t.batched_us(op, R);
  r.lat_us = t.cold_us(op, R);
  r.warm = R * 4.0 * M * V < 2 * kL2Bytes;
  op(R - 1, t.st);  // check the last copy's row 0
  K3_CUDA_CHECK(cudaStreamSynchronize(t.st));
  const auto got = cuda::to_host<int64_t>(ids);
  r.maxrel = got[0] == cpu::argmax(h.data(), V) ? 0.0 : 1.0;  // the last copy's row 0
  r.note = "maxrel: 0 = same id as the CPU";
  record(r);
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  using namespace k3;
  bool quick = false, sweep = true;
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--no-sweep"))
      sweep = false;
    else if (!std::strcmp(argv[i], "--filter") && i + 1 < argc)
      filter = argv[++i];
    else if (!std::strcmp(argv[i], "--sweep-only") && i + 1 < argc)
      g_sweep_only = argv[++i];
    else if (!std::strcmp(argv[i], "--phases"))
      g_phases = true;
    else {
      std::fprintf(stderr,
                   "usage: k3_bench_ops [--quick] [--no-sweep] [--filter SUBSTRING] "
                   "[--sweep-only SUBSTRING] [--phases]\n");
      return 2;
    }
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("no GPU: skipped\n");
    return 77;
  }
  try {
    cudaDeviceProp p{};
    K3_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    std::printf("GPU: %s, %d SMs, L2 %zu MB, sm_%d%d\n", p.name, p.multiProcessorCount,
                static_cast<size_t>(p.l2CacheSize) >> 20, p.major, p.minor);
    Rng rng(12345);
    Timer t;
    g_card = bench::ReadCurve::measure(t.st);
    g_card.print();

    const std::vector<GemmCase> gemms = {
        {"q/k/v/g TP16", 768, 7168, false},     {"o TP16", 7168, 768, false},
        {"latent down", 3584, 7168, false},     {"latent up", 7168, 3584, false},
        {"shared g/u TP16", 384, 7168, false},  {"router", 896, 7168, false},
        {"q/k/v/g TP1", 12288, 7168, false},    {"o TP1", 7168, 12288, false},
        {"lm_head slice", 10240, 7168, false},  {"expert g/u", 3072, 3584, true},
        {"expert g|u fused", 6144, 3584, true}, {"expert down", 3584, 3072, true}};
    const std::vector<int> ms = quick ? std::vector<int>{1} : std::vector<int>{1, 8, 64};
    for (const auto& c : gemms) {
      const std::string id =
          std::string(c.fp4 ? "mxfp4 " : "bf16 ") + std::to_string(c.n) + "x" + std::to_string(c.k);
      if (!filter.empty() && id.find(filter) == std::string::npos) continue;
      bench_gemm(t, c, ms, sweep && !quick, rng);
    }
    for (int M : ms) {
      if (filter.empty() || std::string("rms_norm").find(filter) != std::string::npos)
        bench_rms_norm(t, M, rng);
      if (filter.empty() || std::string("attn_res").find(filter) != std::string::npos)
        bench_attn_res(t, M, rng);
      if (filter.empty() || std::string("argmax").find(filter) != std::string::npos)
        bench_argmax(t, M, rng);
    }

    if (!g_sweeps.empty()) {
      std::printf("\nplan sweep (batched us; default = the model's pick):\n");
      for (const auto& s : g_sweeps) std::printf("  %s\n", s.c_str());
    }
    std::printf("\n%-9s %-10s %3s %8s %8s %7s %6s %6s %6s %8s\n", "kernel", "shape", "M", "us",
                "lat_us", "GB/s", "%4.3T", "%curve", "%card", "maxrel");
    for (const auto& r : g_results) {
      const double gbps = r.bytes / (r.us * 1e-6) / 1e9;
      const double curve = cuda::h200_read_curve_tbps(r.bytes) * 1e3;
      std::printf("%-9s %-10s %3d %8.2f %8.2f %7.0f %6.1f %6.1f %6.1f %8.1e%s\n", r.kernel.c_str(),
                  r.shape.c_str(), r.m, r.us, r.lat_us, gbps, 100 * gbps / (kPeakTBps * 1e3),
                  100 * gbps / curve, g_card.percent(gbps, r.bytes), r.maxrel,
                  r.warm ? " warm" : "");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
