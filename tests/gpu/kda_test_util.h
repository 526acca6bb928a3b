// The KDA decode kernel's test fixture: one layer's random weights and slot states on the host
// (the CPU chain of cpu/layer_kda.cpp runs on them) and on the device (cuda::kda_decode_step),
// and random step inputs. Shared by test_cuda_kda.cu and test_cuda_kda_runs.cu.
#pragma once

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
#include "gpu/op_test_util.h"
#include "model/config.h"
#include "model/weight_matrix.h"
#include "test_util.h"

namespace k3::kda_test {

using gpu_test::bf16_ulp;
using gpu_test::expect_close;
using gpu_test::rms;
using gpu_test::Tol;

// ---- Tolerances: |gpu - ref| <= ulps * ulp_bf16(|ref|) + rel * RMS(ref). The GPU sums the
// column dots in a different order than the CPU loops; everything else is the same fp32 math.
constexpr Tol kOut{1.0, 1e-3};  // bf16 out: one rounding flip + fp32 order noise
// fp32 state carried 3 steps on each side: 1e-5 of the RMS, and 64 fp32 ulps (1/1024 of a bf16
// ulp) of the value, for the rare entries far above the RMS (seed 4745814616765790265: 6 fp32
// ulps off at 1.06, with 1e-5 of the RMS below that).
constexpr Tol kStateF32{1.0 / 1024, 1e-5};
constexpr Tol kStateBf16{1.0, 1e-6};  // bf16 state, each step from the same (GPU) input state
// conv window: exact (a shift of bf16 values).

using cuda::bf16;
using cuda::DeviceBuffer;

using gpu_test::bf16_to_floats;
inline std::vector<uint16_t> to_bits(const std::vector<float>& f) {
  std::vector<uint16_t> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = float_to_bf16(f[i]);
  return b;
}

struct Case {
  int heads, head_dim, rows, slots;
  bool bf16_state;
  bool lower_bound;  // K3 gate form; else the softplus form
};

inline std::string name(const Case& c) {
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
    conv_state = bf16_to_floats(test::random_bf16(rng, c.slots * 3 * Pz * (kKernel - 1), 1.0f));
    state = test::random_normal(rng, c.slots * c.heads * D * D, 0.1f);
    if (c.bf16_state) state = bf16_to_floats(to_bits(state));
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
              cudaStream_t stream, const cuda::KdaDecodeStrides& ld,
              const cuda::KdaSnapshots& snap = {}) {
    if (c.bf16_state)
      cuda::kda_decode_step(u, f, b, z, w, d_slots.data(), d_conv_state.data(), d_state_bf16.data(),
                            out, shape, stream, ld, snap);
    else
      cuda::kda_decode_step(u, f, b, z, w, d_slots.data(), d_conv_state.data(), d_state_f32.data(),
                            out, shape, stream, ld, snap);
  }
  // Rows feed these slots (consecutive rows of one slot: a run of its tokens).
  void set_rows(const std::vector<int32_t>& slots) {
    slot_of_row = slots;
    d_slots = cuda::to_device<int32_t>(slots);
    shape.rows = static_cast<int64_t>(slots.size());
    c.rows = static_cast<int>(slots.size());
  }
  std::vector<float> device_state() const {
    return c.bf16_state ? bf16_to_floats(cuda::to_host<uint16_t>(d_state_bf16))
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
inline Inputs make_inputs(Rng& rng, const Case& c, int64_t P) {
  Inputs in;
  auto gen = [&](size_t n, std::vector<float>& v, DeviceBuffer<bf16>& d) {
    const auto bits = test::random_bf16(rng, n, 1.0f);
    v = bf16_to_floats(bits);
    d = cuda::to_device<bf16>(bits);
  };
  const size_t R = static_cast<size_t>(c.rows), Pz = static_cast<size_t>(P);
  gen(R * 3 * Pz, in.u, in.du);
  gen(R * Pz, in.f, in.df);
  gen(R * c.heads, in.b, in.db);
  gen(R * Pz, in.z, in.dz);
  return in;
}

}  // namespace k3::kda_test
