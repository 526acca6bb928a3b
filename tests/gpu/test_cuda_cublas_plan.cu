// The cuBLAS plan kind (cuda/cublas_linear.h) where the skinny GEMM's contracts meet it: strided
// x and y with the columns past N untouched, the folded residual epilogue bit for bit against
// the GEMM and the separate adds, and a captured graph whose kernel edges are made programmatic:
// cuBLAS's nodes are recorded as foreign and keep full edges, the other kernel edges turn
// programmatic, and replays equal the eager launches bit for bit. Fresh random inputs per run
// (the seed is printed; K3_TEST_SEED replays it).
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/rng.h"
#include "cpu/ops_basic.h"
#include "cuda/check.h"
#include "cuda/cublas_linear.h"
#include "cuda/device_buffer.h"
#include "cuda/graph_pdl.h"
#include "cuda/linear_bf16.h"
#include "cuda/linear_plan.h"
#include "cuda/skinny_gemm.cuh"
#include "cuda/step_ops.h"
#include "gpu/gpu_check_util.h"
#include "model/weight_matrix.h"
#include "test_util.h"

namespace k3 {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;

constexpr gpu_test::Tol kGemmBf16Out{1.0, 1e-3};  // as test_cuda_ops.cu: only the k order differs

// The CPU oracle (cpu::linear_rows) for weight rows `rows` of w [N, K] bf16 and token rows
// x[m * ldx ..] (m < M), rounded to bf16 as the GPU stores it: [M][rows.size()].
std::vector<float> oracle_rows(const std::vector<uint16_t>& w, int64_t N, int64_t K,
                               const std::vector<uint16_t>& x, int64_t ldx, int64_t M,
                               const std::vector<int64_t>& rows) {
  WeightMatrix wm;
  wm.name = "w", wm.format = WeightFormat::BF16, wm.rows = N, wm.cols = K, wm.data = w.data();
  std::vector<float> xf(static_cast<size_t>(K)), out;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) xf[static_cast<size_t>(k)] = bf16_to_float(x[m * ldx + k]);
    for (const int64_t r : rows) {
      float y = 0.0f;
      cpu::linear_rows(wm, r, 1, xf.data(), &y);
      out.push_back(bf16_to_float(float_to_bf16(y)));
    }
  }
  return out;
}

// The GPU's y[m * ldy + r] (bf16 bits) for the same [M][rows] order.
std::vector<float> gather_rows(const std::vector<uint16_t>& y, int64_t ldy, int64_t M,
                               const std::vector<int64_t>& rows) {
  std::vector<float> out;
  for (int64_t m = 0; m < M; ++m)
    for (const int64_t r : rows) out.push_back(bf16_to_float(y[static_cast<size_t>(m * ldy + r)]));
  return out;
}

TEST(CudaCublasPlan, StridedOperandsAgainstTheOracle) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (const int64_t M : {1, 5, 64}) {
    const int64_t N = 300, K = 520, ldx = K + 24, ldy = N + 40;
    SCOPED_TRACE("M " + std::to_string(M));
    const auto xh = test::random_bf16(rng, static_cast<size_t>(M * ldx), 1.0f);
    const auto wh =
        test::random_bf16(rng, static_cast<size_t>(N * K), 1.0f / std::sqrt(static_cast<float>(K)));
    const auto x = cuda::to_device<bf16>(xh);
    const auto w = cuda::to_device<bf16>(wh);
    DeviceBuffer<bf16> y(static_cast<size_t>(M * ldy));
    y.fill_bytes(0xff);  // NaN: every element in [0, N) must be written, the rest kept
    cuda::linear_bf16(cuda::cublas_plan(static_cast<int>(M), N, K), x.data(), ldx, w.data(), M,
                      y.data(), ldy, false, nullptr);
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    const auto yh = cuda::to_host<uint16_t>(y);
    int64_t touched = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = N; c < ldy; ++c) touched += yh[static_cast<size_t>(m * ldy + c)] != 0xffff;
    EXPECT_EQ(touched, 0) << "columns past N written";
    std::vector<int64_t> rows(static_cast<size_t>(N));
    std::iota(rows.begin(), rows.end(), 0);
    gpu_test::expect_close(gather_rows(yh, ldy, M, rows), oracle_rows(wh, N, K, xh, ldx, M, rows),
                           kGemmBf16Out, "cuBLAS plan");
  }
}

// The epilogue (y = bf16(y + add); res += y or res = y) after the cuBLAS GEMM, against the
// cuBLAS GEMM alone and add_bf16 launches: bit for bit.
TEST(CudaCublasPlan, EpilogueEqualsTheSeparateAdds) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t M = 8, N = 7168, K = 768;
  const auto x = cuda::to_device<bf16>(test::random_bf16(rng, static_cast<size_t>(M * K), 1.0f));
  const auto w = cuda::to_device<bf16>(
      test::random_bf16(rng, static_cast<size_t>(N * K), 1.0f / std::sqrt(static_cast<float>(K))));
  const auto add = cuda::to_device<bf16>(test::random_bf16(rng, static_cast<size_t>(M * N), 1.0f));
  const auto res_h = test::random_bf16(rng, static_cast<size_t>(M * N), 2.0f);
  const cuda::LinearPlan plan = cuda::cublas_plan(static_cast<int>(M), N, K);
  for (const bool res_copy : {false, true}) {
    SCOPED_TRACE(res_copy ? "res = y" : "res += y");
    DeviceBuffer<bf16> y_ref(static_cast<size_t>(M * N)), res_ref = cuda::to_device<bf16>(res_h);
    cuda::linear_bf16(plan, x.data(), K, w.data(), M, y_ref.data(), N, false, nullptr);
    cuda::add_bf16(y_ref.data(), add.data(), M * N, y_ref.data(), nullptr);
    if (res_copy)
      K3_CUDA_CHECK(
          cudaMemcpy(res_ref.data(), y_ref.data(), y_ref.size() * 2, cudaMemcpyDeviceToDevice));
    else
      cuda::add_bf16(res_ref.data(), y_ref.data(), M * N, res_ref.data(), nullptr);

    DeviceBuffer<bf16> y(static_cast<size_t>(M * N)), res = cuda::to_device<bf16>(res_h);
    y.fill_bytes(0xff);
    cuda::detail::SkinnyArgs a;
    a.x = x.data(), a.ldx = K, a.w = w.data(), a.y = y.data(), a.ldy = N;
    a.m = static_cast<int>(M), a.n = static_cast<int>(N), a.k = static_cast<int>(K);
    a.add = add.data(), a.res = res.data(), a.res_copy = res_copy ? 1 : 0;
    K3_CUDA_CHECK(cuda::detail::launch_cublas_linear(plan, a, nullptr));
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(cuda::to_host<uint16_t>(y), cuda::to_host<uint16_t>(y_ref)) << "y";
    EXPECT_EQ(cuda::to_host<uint16_t>(res), cuda::to_host<uint16_t>(res_ref)) << "res";
  }
}

// With cuBLAS among the tuner's candidates (the default; the test turns it on): the tuned launch of
// a shape no other test uses matches the oracle on sampled rows, and its folded epilogue equals the
// plain launch then add_bf16 bit for bit, whichever plan the timings picked.
TEST(CudaCublasPlan, TunedWithCublasCandidates) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  struct Switches {
    bool blas = cuda::cublas_plans(), tuning = cuda::linear_tuning();
    Switches() { cuda::set_cublas_plans(true), cuda::set_linear_tuning(true); }
    ~Switches() { cuda::set_cublas_plans(blas), cuda::set_linear_tuning(tuning); }
  } on;
  const int64_t M = 48, N = 2056, K = 4104;
  const auto xh = test::random_bf16(rng, static_cast<size_t>(M * K), 1.0f);
  const auto wh =
      test::random_bf16(rng, static_cast<size_t>(N * K), 1.0f / std::sqrt(static_cast<float>(K)));
  const auto x = cuda::to_device<bf16>(xh);
  const auto w = cuda::to_device<bf16>(wh);
  const auto add = cuda::to_device<bf16>(test::random_bf16(rng, static_cast<size_t>(M * N), 1.0f));
  DeviceBuffer<bf16> y(static_cast<size_t>(M * N));
  y.fill_bytes(0xff);
  cuda::linear_bf16(x.data(), K, w.data(), M, N, K, y.data(), N, false, nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  const auto yh = cuda::to_host<uint16_t>(y);
  // Oracle on every 37th weight row (and the last).
  std::vector<int64_t> rows;
  for (int64_t n = 0; n < N; n += 37) rows.push_back(n);
  rows.push_back(N - 1);
  gpu_test::expect_close(gather_rows(yh, N, M, rows), oracle_rows(wh, N, K, xh, K, M, rows),
                         kGemmBf16Out, "tuned with cuBLAS candidates");

  cuda::add_bf16(y.data(), add.data(), M * N, y.data(), nullptr);
  DeviceBuffer<bf16> y_fused(static_cast<size_t>(M * N));
  cuda::LinearEpilogue epi;
  epi.add = add.data();
  cuda::linear_bf16(x.data(), K, w.data(), M, N, K, y_fused.data(), N, epi, nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(cuda::to_host<uint16_t>(y_fused), cuda::to_host<uint16_t>(y)) << "folded add";
}

// Every edge of the graph: (from, to, programmatic).
struct Edge {
  cudaGraphNode_t from, to;
  bool programmatic;
};
std::vector<Edge> edges_of(cudaGraph_t g) {
  size_t n = 0;
  K3_CUDA_CHECK(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n));
  std::vector<cudaGraphNode_t> from(n), to(n);
  std::vector<cudaGraphEdgeData> data(n);
  if (n > 0) K3_CUDA_CHECK(cudaGraphGetEdges(g, from.data(), to.data(), data.data(), &n));
  std::vector<Edge> out;
  for (size_t i = 0; i < n; ++i)
    out.push_back({from[i], to[i], data[i].type == cudaGraphDependencyTypeProgrammatic});
  return out;
}

// x -> GEMV (ours) -> h -> cuBLAS -> u -> tiled GEMM (ours) -> v -> GEMV (ours) -> z, captured
// under a ForeignNodeScope and made programmatic as the step's graphs are.
TEST(CudaCublasPlan, ForeignNodesKeepFullEdgesUnderPdl) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int64_t D = 1024, F = 2048;
  const auto x = cuda::to_device<bf16>(test::random_bf16(rng, static_cast<size_t>(D), 1.0f));
  auto weight = [&](int64_t n, int64_t k) {
    return cuda::to_device<bf16>(test::random_bf16(rng, static_cast<size_t>(n * k),
                                                   1.0f / std::sqrt(static_cast<float>(k))));
  };
  const auto w1 = weight(F, D), w2 = weight(D, F), w3 = weight(F, D), w4 = weight(D, F);
  DeviceBuffer<bf16> h(F), u(D), v(F), z(D);
  const auto gemv = [&](int64_t n, int64_t k) {
    for (const auto& p : cuda::linear_bf16_candidates(1, n, k))
      if (p.gemv()) return p;
    ADD_FAILURE() << "no GEMV plan for " << n << "x" << k;
    return cuda::LinearPlan{};
  };
  const auto tiled = [&](int64_t n, int64_t k) {
    for (const auto& p : cuda::linear_bf16_candidates(1, n, k))
      if (!p.gemv()) return p;
    ADD_FAILURE() << "no tiled plan for " << n << "x" << k;
    return cuda::LinearPlan{};
  };
  const cuda::LinearPlan p1 = gemv(F, D), p3 = tiled(F, D), p4 = gemv(D, F);
  const cuda::LinearPlan p2 = cuda::cublas_plan(1, D, F);
  cudaStream_t s = nullptr;
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const auto chain = [&] {
    cuda::linear_bf16(p1, x.data(), D, w1.data(), 1, h.data(), F, false, s);
    cuda::linear_bf16(p2, h.data(), F, w2.data(), 1, u.data(), D, false, s);
    cuda::linear_bf16(p3, u.data(), D, w3.data(), 1, v.data(), F, false, s);
    cuda::linear_bf16(p4, v.data(), F, w4.data(), 1, z.data(), D, false, s);
  };
  chain();  // eager: the handle, kernel attributes
  K3_CUDA_CHECK(cudaStreamSynchronize(s));
  const auto z_eager = cuda::to_host<uint16_t>(z);
  const auto u_eager = cuda::to_host<uint16_t>(u);

  std::set<cudaGraphNode_t> foreign;
  cudaGraph_t graph = nullptr;
  {
    const cuda::ForeignNodeScope scope(foreign);
    K3_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    chain();
    K3_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  }
  ASSERT_FALSE(foreign.empty()) << "the cuBLAS GEMM's nodes were not recorded";
  const int made = cuda::make_kernel_edges_programmatic(graph, foreign);
  EXPECT_GE(made, 1) << "the tiled GEMM -> GEMV edge";
  int full_around_foreign = 0;
  for (const Edge& e : edges_of(graph)) {
    const bool touches = foreign.count(e.from) || foreign.count(e.to);
    if (touches) {
      EXPECT_FALSE(e.programmatic) << "an edge of a cuBLAS node turned programmatic";
      ++full_around_foreign;
    }
  }
  EXPECT_GE(full_around_foreign, 2) << "GEMV -> cuBLAS and cuBLAS -> tiled";
  cudaGraphExec_t exec = nullptr;
  K3_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 3; ++r) {
    z.fill_bytes(0xff, s);
    u.fill_bytes(0xff, s);
    K3_CUDA_CHECK(cudaGraphLaunch(exec, s));
    K3_CUDA_CHECK(cudaStreamSynchronize(s));
    EXPECT_EQ(cuda::to_host<uint16_t>(u), u_eager) << "replay " << r << ": cuBLAS output";
    EXPECT_EQ(cuda::to_host<uint16_t>(z), z_eager) << "replay " << r;
  }
  K3_CUDA_CHECK(cudaGraphExecDestroy(exec));
  K3_CUDA_CHECK(cudaGraphDestroy(graph));
  K3_CUDA_CHECK(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace k3
