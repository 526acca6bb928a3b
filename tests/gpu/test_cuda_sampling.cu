// GPU sampling (cuda/sampling.h) against cpu::sample_from_uniform on fresh random logits (the
// seed is printed; K3_TEST_SEED replays it): greedy, temperature only, top-k, top-p and both,
// many uniforms per row, K3's vocabulary and a small one full of ties. The token must be the
// CPU's except where the draw (or top_p) lies within kBoundary of a cumulative probability: the
// GPU adds the same double terms in a different order. Such cases are detected from the CPU's
// own cumulative sums and excluded (and counted; they are expected to be very rare).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "cpu/sampling.h"
#include "cuda/device_buffer.h"
#include "cuda/sampling.h"
#include "test_util.h"

namespace k3 {
namespace {

using cuda::DeviceBuffer;
using cuda::SampleRowParams;

// Summation-order differences of <= 163840 double probabilities are ~1e-16 x log2(n); 1e-12
// leaves a wide margin while excluding essentially nothing.
constexpr double kBoundary = 1e-12;
// Excluded boundary cases allowed per test (a correct kernel hits ~0 of them).
constexpr int kMaxBoundary = 3;

// The parameter combos, one per batch row.
const std::vector<SampleRowParams> kCombos{
    {0.0f, 0, 1.0f},      // greedy
    {0.0f, 40, 0.5f},     // greedy ignores top-k / top-p
    {1.0f, 0, 1.0f},      // temperature only
    {0.6f, 0, 1.0f},      //
    {1.7f, 0, 1.0f},      //
    {1.0f, 50, 1.0f},     // top-k
    {0.8f, 1, 1.0f},      // top-k 1 = greedy through the sampling path
    {1.0f, 0, 0.9f},      // top-p
    {1.2f, 0, 0.3f},      //
    {1.0f, 0, 1e-7f},     // top-p keeps only the first
    {0.9f, 40, 0.8f},     // both
    {1.3f, 2000, 0.95f},  //
};

cpu::SamplingParams to_cpu(const SampleRowParams& p) {
  cpu::SamplingParams c;
  c.temperature = p.temperature;
  c.top_k = p.top_k;
  c.top_p = p.top_p;
  return c;
}

// True when u (or top_p) sits within kBoundary of a cumulative sum that separates the CPU's
// and the GPU's choices: recomputes the CPU pipeline's sorted cumulative probabilities.
bool is_boundary(const float* logits, int64_t vocab, const cpu::SamplingParams& p, double u01,
                 int64_t cpu_id, int64_t gpu_id) {
  if (p.temperature == 0.0f) return false;
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  const int64_t kept = p.top_k > 0 ? std::min<int64_t>(p.top_k, vocab) : vocab;
  const double zmax = static_cast<double>(logits[order[0]]) / p.temperature;
  std::vector<double> q(static_cast<size_t>(kept)), cum(static_cast<size_t>(kept));
  double total = 0;
  for (int64_t i = 0; i < kept; ++i)
    total += (q[static_cast<size_t>(i)] =
                  std::exp(static_cast<double>(logits[order[i]]) / p.temperature - zmax));
  double c = 0;
  for (int64_t i = 0; i < kept; ++i)
    cum[static_cast<size_t>(i)] = (c += q[static_cast<size_t>(i)] / total);
  bool near = false;
  int64_t n = kept;
  if (p.top_p < 1.0f) {
    n = 0;
    while (n < kept && cum[static_cast<size_t>(n)] < p.top_p) ++n;
    n = std::min(n + 1, kept);
    for (int64_t i = 0; i < kept; ++i)
      near |= std::fabs(cum[static_cast<size_t>(i)] - p.top_p) <= kBoundary;
  }
  const double u = u01 * cum[static_cast<size_t>(n - 1)];
  int64_t ic = -1, ig = -1;
  for (int64_t i = 0; i < vocab; ++i) {
    if (order[i] == cpu_id) ic = i;
    if (order[i] == gpu_id) ig = i;
  }
  if (ic < 0 || ig < 0) return false;
  for (int64_t j = std::min(ic, ig); j < std::max(ic, ig) && j < kept; ++j)
    near |= std::fabs(cum[static_cast<size_t>(j)] - u) <= kBoundary;
  return near;
}

// rows = kCombos.size(); `draws` launches, each with fresh uniforms for every row.
void check_sampling(int64_t vocab, int draws, bool ties, float scale) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t rows = static_cast<int64_t>(kCombos.size()), stride = vocab + 5;
  std::vector<float> logits(static_cast<size_t>(rows * stride), NAN);  // the pad is never read
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < vocab; ++i) {
      float x = rng.normal() * scale;
      if (ties) x = std::round(x * 2.0f) / 2.0f;  // many equal logits, +0 and -0 among them
      if (ties && x == 0.0f && (rng.next_u64() & 1)) x = -0.0f;
      // Masked tokens have probability 0; token 0 never is, so every row keeps a distribution
      // (a vocabulary of 1 fully masked would be a user error, not a sampling case).
      if (rng.next_u64() % 97 == 0 && i > 0) x = -INFINITY;
      logits[static_cast<size_t>(r * stride + i)] = x;
    }
  auto d_logits = cuda::to_device<float>(logits);
  auto d_params = cuda::to_device<SampleRowParams>(kCombos);
  DeviceBuffer<double> d_u(static_cast<size_t>(rows));
  DeviceBuffer<int32_t> d_ids(static_cast<size_t>(rows));
  DeviceBuffer<uint8_t> ws(cuda::sample_rows_workspace_bytes(rows, vocab));
  int mismatches = 0, boundary = 0;
  std::string first;
  for (int d = 0; d < draws; ++d) {
    std::vector<double> u(static_cast<size_t>(rows));
    for (double& x : u) x = rng.uniform();
    if (d == 0) u[2] = 0.0;  // the extremes of [0, 1)
    if (d == 1) u[2] = 1.0 - 0x1.0p-53;
    cuda::copy_to_device(d_u, u.data(), u.size());
    d_ids.fill_bytes(0xff);
    cuda::sample_rows(d_logits.data(), stride, rows, vocab, d_params.data(), d_u.data(), ws.data(),
                      d_ids.data(), nullptr);
    K3_CUDA_CHECK_LAUNCH();
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<int32_t> ids = cuda::to_host<int32_t>(d_ids);
    for (int64_t r = 0; r < rows; ++r) {
      const float* lr = logits.data() + r * stride;
      const cpu::SamplingParams cp = to_cpu(kCombos[static_cast<size_t>(r)]);
      const int64_t want = cpu::sample_from_uniform(lr, vocab, cp, u[static_cast<size_t>(r)]);
      const int64_t got = ids[static_cast<size_t>(r)];
      ASSERT_TRUE(got >= 0 && got < vocab) << "row " << r << " id " << got;
      if (got == want) continue;
      if (is_boundary(lr, vocab, cp, u[static_cast<size_t>(r)], want, got)) {
        ++boundary;
        continue;
      }
      if (mismatches++ == 0)
        first = "draw " + std::to_string(d) + " row " + std::to_string(r) + " (T " +
                std::to_string(cp.temperature) + " k " + std::to_string(cp.top_k) + " p " +
                std::to_string(cp.top_p) + ") u " + std::to_string(u[static_cast<size_t>(r)]) +
                ": cpu " + std::to_string(want) + " gpu " + std::to_string(got);
    }
  }
  EXPECT_EQ(mismatches, 0) << "vocab " << vocab << ": first " << first;
  EXPECT_LE(boundary, kMaxBoundary) << "vocab " << vocab << " boundary cases";
}

TEST(CudaSampling, MatchesCpuAtK3Vocab) {
  check_sampling(163840, 12, false, 3.0f);
}

TEST(CudaSampling, MatchesCpuSmallVocabWithTies) {
  check_sampling(1000, 200, true, 2.0f);
  check_sampling(1, 20, false, 1.0f);      // a single token
  check_sampling(3000, 100, false, 0.3f);  // flat: the draw walks deep into the CDF
}

TEST(CudaSampling, GraphReplayReadsNewUniforms) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t rows = static_cast<int64_t>(kCombos.size()), vocab = 5000;
  const std::vector<float> logits =
      test::random_normal(rng, static_cast<size_t>(rows * vocab), 2.0f);
  auto d_logits = cuda::to_device<float>(logits);
  auto d_params = cuda::to_device<SampleRowParams>(kCombos);
  DeviceBuffer<double> d_u(static_cast<size_t>(rows));
  DeviceBuffer<int32_t> d_ids(static_cast<size_t>(rows));
  DeviceBuffer<uint8_t> ws(cuda::sample_rows_workspace_bytes(rows, vocab));
  cudaStream_t s;
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  K3_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  cuda::sample_rows(d_logits.data(), vocab, rows, vocab, d_params.data(), d_u.data(), ws.data(),
                    d_ids.data(), s);
  K3_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  K3_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  int mismatches = 0;
  for (int d = 0; d < 20; ++d) {
    std::vector<double> u(static_cast<size_t>(rows));
    for (double& x : u) x = rng.uniform();
    cuda::copy_to_device(d_u, u.data(), u.size());
    d_ids.fill_bytes(0xff);
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    K3_CUDA_CHECK(cudaGraphLaunch(ge, s));
    K3_CUDA_CHECK(cudaStreamSynchronize(s));
    const std::vector<int32_t> ids = cuda::to_host<int32_t>(d_ids);
    for (int64_t r = 0; r < rows; ++r) {
      const cpu::SamplingParams cp = to_cpu(kCombos[static_cast<size_t>(r)]);
      const float* lr = logits.data() + r * vocab;
      const int64_t want = cpu::sample_from_uniform(lr, vocab, cp, u[static_cast<size_t>(r)]);
      const int64_t got = ids[static_cast<size_t>(r)];
      if (got != want && !is_boundary(lr, vocab, cp, u[static_cast<size_t>(r)], want, got))
        ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0);
  K3_CUDA_CHECK(cudaGraphExecDestroy(ge));
  K3_CUDA_CHECK(cudaGraphDestroy(g));
  K3_CUDA_CHECK(cudaStreamDestroy(s));
}

// Where the CPU raises, the GPU returns an in-range id: NaN logits count as -inf.
TEST(CudaSampling, NanLogitsStayInRange) {
  const int64_t vocab = 300;
  std::vector<float> logits(static_cast<size_t>(vocab), NAN);
  logits[17] = 1.0f;
  logits[42] = 1.5f;
  const std::vector<SampleRowParams> p{{1.0f, 0, 1.0f}};
  auto d_logits = cuda::to_device<float>(logits);
  auto d_params = cuda::to_device<SampleRowParams>(p);
  auto d_u = cuda::to_device<double>(std::vector<double>{0.99});
  DeviceBuffer<int32_t> d_ids(1);
  DeviceBuffer<uint8_t> ws(cuda::sample_rows_workspace_bytes(1, vocab));
  cuda::sample_rows(d_logits.data(), vocab, 1, vocab, d_params.data(), d_u.data(), ws.data(),
                    d_ids.data(), nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  const int32_t id = cuda::to_host<int32_t>(d_ids)[0];
  EXPECT_TRUE(id == 17 || id == 42) << id;
}

}  // namespace
}  // namespace k3

namespace k3 {
namespace {

// Timing only (run with --gtest_also_run_disabled_tests): K3's vocabulary at 1 and 64 rows.
TEST(CudaSampling, DISABLED_TimeK3Vocab) {
  const int64_t vocab = 163840;
  for (int64_t rows : {1, 8, 64}) {
    Rng rng(7);
    const std::vector<float> logits =
        test::random_normal(rng, static_cast<size_t>(rows * vocab), 3.0f);
    std::vector<SampleRowParams> p(static_cast<size_t>(rows), SampleRowParams{0.8f, 0, 0.95f});
    std::vector<double> u(static_cast<size_t>(rows), 0.5);
    auto d_logits = cuda::to_device<float>(logits);
    auto d_params = cuda::to_device<SampleRowParams>(p);
    auto d_u = cuda::to_device<double>(u);
    DeviceBuffer<int32_t> d_ids(static_cast<size_t>(rows));
    DeviceBuffer<uint8_t> ws(cuda::sample_rows_workspace_bytes(rows, vocab));
    cudaEvent_t a, b;
    K3_CUDA_CHECK(cudaEventCreate(&a));
    K3_CUDA_CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i)
      cuda::sample_rows(d_logits.data(), vocab, rows, vocab, d_params.data(), d_u.data(), ws.data(),
                        d_ids.data(), nullptr);
    const int iters = 20;
    K3_CUDA_CHECK(cudaEventRecord(a));
    for (int i = 0; i < iters; ++i)
      cuda::sample_rows(d_logits.data(), vocab, rows, vocab, d_params.data(), d_u.data(), ws.data(),
                        d_ids.data(), nullptr);
    K3_CUDA_CHECK(cudaEventRecord(b));
    K3_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    K3_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    std::printf("sample_rows rows %lld vocab %lld: %.1f us, workspace %.1f MB\n",
                static_cast<long long>(rows), static_cast<long long>(vocab), 1000.0 * ms / iters,
                ws.size() / 1e6);
    K3_CUDA_CHECK(cudaEventDestroy(a));
    K3_CUDA_CHECK(cudaEventDestroy(b));
  }
}

}  // namespace
}  // namespace k3
