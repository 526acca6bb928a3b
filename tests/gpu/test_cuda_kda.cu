// cuda::kda_decode_step against the CPU KDA chain of cpu/layer_kda.cpp on fresh random inputs
// (the seed is printed; K3_TEST_SEED replays it): 3 consecutive steps with the state carried on
// the device, several rows on a permuted subset of slots, both gate forms, fp32 and bf16 state,
// head_dim 32 and 128. The output is poisoned with NaN before every launch.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "gpu/kda_test_util.h"

namespace k3 {
namespace {

using namespace kda_test;  // NOLINT: the fixture of this file and test_cuda_kda_runs.cu

void run_case(const Case& c) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed) + " " + name(c));
  Rng rng(seed);
  KdaLayer st(c, rng);
  const size_t Pz = static_cast<size_t>(st.P);
  DeviceBuffer<bf16> out(static_cast<size_t>(c.rows) * Pz);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Inputs in = make_inputs(rng, c, st.P);
    out.fill_bytes(0xff);
    st.launch(in.du, in.df, in.db, in.dz, out, nullptr);
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    // A bf16 state may differ by one rounding flip per step: start each CPU step from the GPU
    // state so the bound stays one ulp (fp32 state: carried independently on both sides).
    std::vector<float> ref_out(out.size());
    for (int r = 0; r < c.rows; ++r) st.cpu_row(r, in.u, in.f, in.b, in.z, ref_out.data() + r * Pz);
    expect_close(bf16_to_floats(cuda::to_host<uint16_t>(out)), ref_out, kOut, "out");
    const std::vector<float> gs = st.device_state();
    expect_close(gs, st.state, c.bf16_state ? kStateBf16 : kStateF32, "state (every slot)");
    EXPECT_EQ(bf16_to_floats(cuda::to_host<uint16_t>(st.d_conv_state)), st.conv_state)
        << "conv window (every slot)";
    if (c.bf16_state) st.state = gs;
  }
}

TEST(CudaKda, K3Tp16Fp32State) {
  run_case({6, 128, 5, 9, false, true});
}
TEST(CudaKda, K3Tp16Bf16State) {
  run_case({6, 128, 5, 9, true, true});
}
TEST(CudaKda, SoftplusFp32State) {
  run_case({6, 128, 3, 4, false, false});
}
TEST(CudaKda, SoftplusBf16State) {
  run_case({6, 128, 3, 4, true, false});
}
TEST(CudaKda, HeadDim32) {
  run_case({5, 32, 4, 7, false, true});
}
TEST(CudaKda, HeadDim32SoftplusBf16) {
  run_case({5, 32, 4, 7, true, false});
}
TEST(CudaKda, HeadDim64) {
  run_case({3, 64, 2, 3, false, true});
}

// A captured step replayed twice equals two eager steps bit for bit (same inputs each time).
TEST(CudaKda, GraphReplayEqualsEager) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const Case c{6, 128, 4, 6, false, true};
  Rng rng(seed);
  KdaLayer eager(c, rng);
  Rng rng2(seed);
  KdaLayer graph(c, rng2);  // same seed: identical weights, states and slots
  Inputs in = make_inputs(rng, c, eager.P);
  const size_t n = static_cast<size_t>(c.rows) * eager.P;
  DeviceBuffer<bf16> out_e(n), out_g(n);
  out_e.fill_bytes(0xff);
  out_g.fill_bytes(0xff);
  cudaStream_t s;
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  for (int i = 0; i < 2; ++i) eager.launch(in.du, in.df, in.db, in.dz, out_e, s);
  cudaGraph_t g;
  cudaGraphExec_t ge;
  K3_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  graph.launch(in.du, in.df, in.db, in.dz, out_g, s);
  K3_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  K3_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 2; ++i) K3_CUDA_CHECK(cudaGraphLaunch(ge, s));
  K3_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(cuda::to_host<uint16_t>(out_e), cuda::to_host<uint16_t>(out_g)) << "out";
  EXPECT_EQ(eager.device_state(), graph.device_state()) << "state";
  EXPECT_EQ(cuda::to_host<uint16_t>(eager.d_conv_state),
            cuda::to_host<uint16_t>(graph.d_conv_state))
      << "conv window";
  K3_CUDA_CHECK(cudaGraphExecDestroy(ge));
  K3_CUDA_CHECK(cudaGraphDestroy(g));
  K3_CUDA_CHECK(cudaStreamDestroy(s));
}

// Inputs read in place from one wide row (as from a fused projection GEMM), with NaN in the gaps
// and in the tail of each row, equal the packed call bit for bit: out, state and conv window.
void run_strided_case(const Case& c) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed) + " " + name(c));
  Rng rng(seed);
  KdaLayer packed(c, rng);
  Rng rng2(seed);
  KdaLayer strided(c, rng2);  // same seed: identical weights, states and slots
  const int64_t P = packed.P, H = c.heads, R = c.rows;
  // One row: [u 3P][gap 3][z P][gap 5][f P][gap 1][beta H][gap 7]; odd gaps on purpose.
  const int64_t off_u = 0, off_z = 3 * P + 3, off_f = off_z + P + 5, off_b = off_f + P + 1;
  const int64_t n = off_b + H + 7;
  const cuda::KdaDecodeStrides ld{n, n, n, n};
  const size_t out_n = static_cast<size_t>(R * P);
  DeviceBuffer<bf16> out_p(out_n), out_s(out_n);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Inputs in = make_inputs(rng, c, P);
    std::vector<uint16_t> wide(static_cast<size_t>(R * n), 0xffff);  // bf16 NaN everywhere
    const auto place = [&](const std::vector<float>& src, int64_t width, int64_t off) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < width; ++i)
          wide[static_cast<size_t>(r * n + off + i)] = float_to_bf16(src[r * width + i]);
    };
    place(in.u, 3 * P, off_u);
    place(in.z, P, off_z);
    place(in.f, P, off_f);
    place(in.b, H, off_b);
    const DeviceBuffer<bf16> d_wide = cuda::to_device<bf16>(wide);  // [R][n] bf16
    out_p.fill_bytes(0xff);
    out_s.fill_bytes(0xff);
    packed.launch(in.du, in.df, in.db, in.dz, out_p, nullptr);
    const bf16* base = d_wide.data();
    strided.launch(base + off_u, base + off_f, base + off_b, base + off_z, out_s.data(), nullptr,
                   ld);
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> op = cuda::to_host<uint16_t>(out_p);
    EXPECT_EQ(op, cuda::to_host<uint16_t>(out_s)) << "out";
    EXPECT_TRUE(std::none_of(op.begin(), op.end(), [](uint16_t b) {
      return std::isnan(bf16_to_float(b));
    })) << "packed out has NaN";
    EXPECT_EQ(packed.device_state(), strided.device_state()) << "state (every slot)";
    EXPECT_EQ(cuda::to_host<uint16_t>(packed.d_conv_state),
              cuda::to_host<uint16_t>(strided.d_conv_state))
        << "conv window (every slot)";
  }
}

TEST(CudaKda, StridedInputsEqualPackedFp32State) {
  run_strided_case({6, 128, 5, 9, false, true});
}
TEST(CudaKda, StridedInputsEqualPackedBf16StateD32) {
  run_strided_case({5, 32, 4, 7, true, false});
}

// A stride narrower than the row is a caller error.
TEST(CudaKda, StrideNarrowerThanRowRaises) {
  const Case c{2, 32, 1, 1, false, true};
  Rng rng(1);
  KdaLayer st(c, rng);
  DeviceBuffer<bf16> buf(static_cast<size_t>(8 * st.P)), out(static_cast<size_t>(st.P));
  const bf16* p = buf.data();
  EXPECT_THROW(st.launch(p, p, p, p, out.data(), nullptr, {3 * st.P - 1, 0, 0, 0}), Error);
  EXPECT_THROW(st.launch(p, p, p, p, out.data(), nullptr, {0, 0, 1, 0}), Error);
}

}  // namespace
}  // namespace k3
