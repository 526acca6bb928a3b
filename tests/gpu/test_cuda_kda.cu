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

#include "core/numeric.h"
#include "core/rng.h"
#include "cpu/ops_basic.h"
#include "cpu/ops_kda.h"
#include "cuda/device_buffer.h"
#include "cuda/kda_decode.h"
#include "gpu/gpu_check_util.h"
#include "model/config.h"
#include "model/weight_matrix.h"
#include "test_util.h"

namespace k3 {
namespace {

using gpu_test::bf16_ulp;
using gpu_test::expect_close;
using gpu_test::rms;
using gpu_test::Tol;

// ---- Tolerances: |gpu - ref| <= ulps * ulp_bf16(|ref|) + rel * RMS(ref). The GPU sums the
// column dots in a different order than the CPU loops; everything else is the same fp32 math.
constexpr Tol kOut{1.0, 1e-3};        // bf16 out: one rounding flip + fp32 order noise
constexpr Tol kStateF32{0.0, 1e-5};   // fp32 state carried 3 steps on each side
constexpr Tol kStateBf16{1.0, 1e-6};  // bf16 state, each step from the same (GPU) input state
// conv window: exact (a shift of bf16 values).

using cuda::bf16;
using cuda::DeviceBuffer;

std::vector<float> to_floats(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_float(b[i]);
  return f;
}
std::vector<uint16_t> to_bits(const std::vector<float>& f) {
  std::vector<uint16_t> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = float_to_bf16(f[i]);
  return b;
}

struct Case {
  int heads, head_dim, rows, slots;
  bool bf16_state;
  bool lower_bound;  // K3 gate form; else the softplus form
};

std::string name(const Case& c) {
  return "H" + std::to_string(c.heads) + " D" + std::to_string(c.head_dim) + " rows" +
         std::to_string(c.rows) + " slots" + std::to_string(c.slots) +
         (c.bf16_state ? " bf16-state" : " fp32-state") + (c.lower_bound ? " lb" : " softplus");
}

constexpr int kKernel = 4;
constexpr float kLowerBound = -5.0f;

// Everything one layer needs on both sides; host state mirrors the device state.
struct KdaLayer {
  Case c;
  int64_t P;
  std::vector<float> conv_w, dt_bias, a_log, o_norm;  // fp32 weights
  std::vector<float> conv_state;                      // [slots][3][P][K-1], bf16 values
  std::vector<float> state;                           // [slots][H][D][D]
  std::vector<int32_t> slot_of_row;
  DeviceBuffer<float> d_conv_w, d_dt, d_alog, d_onorm;
  DeviceBuffer<bf16> d_conv_state;
  DeviceBuffer<float> d_state_f32;
  DeviceBuffer<bf16> d_state_bf16;
  DeviceBuffer<int32_t> d_slots;
  cuda::KdaDecodeWeights w;
  cuda::KdaDecodeShape shape;

  KdaLayer(const Case& cs, Rng& rng) : c(cs), P(static_cast<int64_t>(cs.heads) * cs.head_dim) {
    const size_t Pz = static_cast<size_t>(P), D = static_cast<size_t>(c.head_dim);
    conv_w = test::random_normal(rng, 3 * Pz * kKernel, 0.5f);
    dt_bias.resize(Pz);
    for (auto& x : dt_bias) x = rng.uniform(-4.0f, 1.0f);
    a_log.resize(static_cast<size_t>(c.heads));
    for (auto& x : a_log) x = std::log(rng.uniform(1.0f, 16.0f));
    o_norm = test::random_normal(rng, D, 0.1f);
    for (auto& x : o_norm) x += 1.0f;
    conv_state = to_floats(test::random_bf16(rng, c.slots * 3 * Pz * (kKernel - 1), 1.0f));
    state = test::random_normal(rng, c.slots * c.heads * D * D, 0.1f);
    if (c.bf16_state) state = to_floats(to_bits(state));
    // rows map to a permuted subset of the slots: the others must keep their values.
    std::vector<int32_t> perm(static_cast<size_t>(c.slots));
    for (int s = 0; s < c.slots; ++s) perm[s] = s;
    for (int s = c.slots - 1; s > 0; --s)
      std::swap(perm[s], perm[static_cast<size_t>(rng.uniform() * (s + 1)) % (s + 1)]);
    slot_of_row.assign(perm.begin(), perm.begin() + c.rows);

    d_conv_w = cuda::to_device<float>(conv_w);
    d_dt = cuda::to_device<float>(dt_bias);
    d_alog = cuda::to_device<float>(a_log);
    d_onorm = cuda::to_device<float>(o_norm);
    d_conv_state = cuda::to_device<bf16>(to_bits(conv_state));
    if (c.bf16_state)
      d_state_bf16 = cuda::to_device<bf16>(to_bits(state));
    else
      d_state_f32 = cuda::to_device<float>(state);
    d_slots = cuda::to_device<int32_t>(slot_of_row);
    w = {d_conv_w.data(),
         d_dt.data(),
         d_alog.data(),
         d_onorm.data(),
         c.lower_bound ? kLowerBound : std::numeric_limits<float>::quiet_NaN(),
         1e-5f,
         1.0f / std::sqrt(static_cast<float>(c.head_dim))};
    shape = {c.rows, c.heads, c.head_dim, kKernel};
  }

  void launch(const DeviceBuffer<bf16>& u, const DeviceBuffer<bf16>& f, const DeviceBuffer<bf16>& b,
              const DeviceBuffer<bf16>& z, DeviceBuffer<bf16>& out, cudaStream_t stream) {
    launch(u.data(), f.data(), b.data(), z.data(), out.data(), stream, {});
  }
  void launch(const bf16* u, const bf16* f, const bf16* b, const bf16* z, bf16* out,
              cudaStream_t stream, const cuda::KdaDecodeStrides& ld) {
    if (c.bf16_state)
      cuda::kda_decode_step(u, f, b, z, w, d_slots.data(), d_conv_state.data(), d_state_bf16.data(),
                            out, shape, stream, ld);
    else
      cuda::kda_decode_step(u, f, b, z, w, d_slots.data(), d_conv_state.data(), d_state_f32.data(),
                            out, shape, stream, ld);
  }
  std::vector<float> device_state() const {
    return c.bf16_state ? to_floats(cuda::to_host<uint16_t>(d_state_bf16))
                        : cuda::to_host<float>(d_state_f32);
  }

  // The CPU chain of cpu/layer_kda.cpp for one row on the host state; returns out (bf16 values).
  void cpu_row(int r, const std::vector<float>& u, const std::vector<float>& f,
               const std::vector<float>& bl, const std::vector<float>& z, float* out) {
    const int H = c.heads, D = c.head_dim;
    const size_t Pz = static_cast<size_t>(P);
    const int64_t slot = slot_of_row[r];
    std::vector<float> qkv(3 * Pz);
    for (int s = 0; s < 3; ++s) {
      WeightMatrix wm;
      wm.name = "conv";
      wm.format = WeightFormat::F32;
      wm.rows = P;
      wm.cols = kKernel;
      wm.data = conv_w.data() + s * Pz * kKernel;
      float* win = conv_state.data() + (slot * 3 + s) * Pz * (kKernel - 1);
      cpu::kda_short_conv_step(u.data() + (r * 3 + s) * Pz, win, wm, P, kKernel,
                               qkv.data() + s * Pz);
    }
    float* q = qkv.data();
    float* k = qkv.data() + Pz;
    for (int h = 0; h < H; ++h) {
      cpu::l2_normalize(q + h * D, D, ModelConfig::kQkL2NormEps);
      cpu::l2_normalize(k + h * D, D, ModelConfig::kQkL2NormEps);
    }
    std::vector<float> g(Pz), beta(static_cast<size_t>(H)), o(Pz);
    cpu::kda_decay_gate(f.data() + r * Pz, dt_bias.data(), a_log.data(), H, D,
                        c.lower_bound ? std::optional<float>(kLowerBound) : std::nullopt, g.data());
    for (int h = 0; h < H; ++h) beta[h] = cpu::sigmoid(bl[r * H + h]);
    float* S = state.data() + slot * H * static_cast<int64_t>(D) * D;
    cpu::kda_recurrence_step(S, q, k, qkv.data() + 2 * Pz, g.data(), beta.data(), H, D, w.scale,
                             o.data());
    if (c.bf16_state)  // as decode_state.cpp stores it
      for (int64_t i = 0; i < static_cast<int64_t>(H) * D * D; ++i) S[i] = round_bf16(S[i]);
    cpu::kda_gated_norm(o.data(), z.data() + r * Pz, o_norm.data(), H, D, w.eps, out);
    for (size_t i = 0; i < Pz; ++i) out[i] = round_bf16(out[i]);
  }
};

struct Inputs {
  std::vector<float> u, f, b, z;  // bf16 values
  DeviceBuffer<bf16> du, df, db, dz;
};
Inputs make_inputs(Rng& rng, const Case& c, int64_t P) {
  Inputs in;
  auto gen = [&](size_t n, std::vector<float>& v, DeviceBuffer<bf16>& d) {
    const auto bits = test::random_bf16(rng, n, 1.0f);
    v = to_floats(bits);
    d = cuda::to_device<bf16>(bits);
  };
  const size_t R = static_cast<size_t>(c.rows), Pz = static_cast<size_t>(P);
  gen(R * 3 * Pz, in.u, in.du);
  gen(R * Pz, in.f, in.df);
  gen(R * c.heads, in.b, in.db);
  gen(R * Pz, in.z, in.dz);
  return in;
}

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
    expect_close(to_floats(cuda::to_host<uint16_t>(out)), ref_out, kOut, "out");
    const std::vector<float> gs = st.device_state();
    expect_close(gs, st.state, c.bf16_state ? kStateBf16 : kStateF32, "state (every slot)");
    EXPECT_EQ(to_floats(cuda::to_host<uint16_t>(st.d_conv_state)), st.conv_state)
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
