// k3_bench_attn: KDA decode step, MLA absorbed decode, router top-k (here) and the DSA indexer
// (bench_dsa.cu) at Kimi K3 per-rank shapes vs the H200 read curve (shared/spec/h200-ceilings.md),
// a correctness check per line. Timing (attn_harness.h): one CUDA graph of R back-to-back
// launches, each on its own copy of the big operand (KDA: distinct state + conv slots; MLA:
// distinct cache pages), R so one replay touches > 132 MB (2.2x L2): state / cache reads are
// cold. us = median of 50 replays / R. Small operands (KDA u/f/z/beta, MLA q) are one copy; the
// router is tiny: warm, R = 32 on one copy.
// Bytes: KDA per (row, head) 2 D^2 sizeof(state) + 3D (kernel-1) 2 2 (conv window r+w) +
// (6D + 1) 2 (u, f, z, beta, out), as kda_decode.cu; MLA rows seq_len 1152 + q (rows heads 576 2)
// + o (rows heads 512 4, fp32); router rows E 4 + E 4 (bias) + rows top_k 8.
// check: max |gpu - ref| / rms(ref) on row 0 (KDA out + state vs the CPU chain of layer_kda.cpp;
// MLA all heads vs float64; router ids + weights vs cpu::route). [--filter kda|mla|router|dsa]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "attn_harness.h"
#include "bench_dsa.h"
#include "core/numeric.h"
#include "core/rng.h"
#include "cpu/ops_basic.h"
#include "cpu/ops_kda.h"
#include "cpu/ops_moe.h"
#include "cuda/check.h"
#include "cuda/device_buffer.h"
#include "cuda/kda_decode.h"
#include "cuda/linear_plan.h"
#include "cuda/mla_decode.h"
#include "cuda/router.h"
#include "model/config.h"
#include "model/weight_matrix.h"

namespace k3 {
namespace {

using bench::copies_for;
using bench::floats;
using bench::fmt;
using bench::maxrel;
using bench::random_bf16;
using bench::record;
using bench::Result;
using bench::Timer;
using cuda::bf16;
using cuda::DeviceBuffer;

// ---- KDA decode step ----
template <typename StateT>
void bench_kda(Timer& t, int H, int rows, Rng& rng) {
  constexpr int D = 128, K = 4;  // K3: head_dim 128, short_conv_kernel_size 4
  constexpr bool kBf16 = sizeof(StateT) == 2;
  const int64_t P = static_cast<int64_t>(H) * D;
  const size_t Pz = static_cast<size_t>(P), DD = static_cast<size_t>(D) * D;
  const double slot_bytes = 2.0 * H * DD * sizeof(StateT) + 3.0 * P * (K - 1) * 2 * 2;
  const double bytes = rows * (slot_bytes + (6.0 * P + H) * 2);
  const int R = copies_for(rows * slot_bytes);
  const size_t slots = static_cast<size_t>(R) * rows;
  // Weights as in test_cuda_kda.cu.
  std::vector<float> conv_w(3 * Pz * K), dt(Pz), a_log(H), o_norm(D);
  for (auto& x : conv_w) x = 0.5f * rng.normal();
  for (auto& x : dt) x = rng.uniform(-4.0f, 1.0f);
  for (auto& x : a_log) x = std::log(rng.uniform(1.0f, 16.0f));
  for (auto& x : o_norm) x = 1.0f + 0.1f * rng.normal();
  const auto d_conv_w = cuda::to_device<float>(conv_w), d_dt = cuda::to_device<float>(dt);
  const auto d_alog = cuda::to_device<float>(a_log), d_onorm = cuda::to_device<float>(o_norm);
  const float lb = -5.0f;
  cuda::KdaDecodeWeights w;
  w.conv = d_conv_w.data(), w.dt_bias = d_dt.data(), w.a_log = d_alog.data();
  w.o_norm = d_onorm.data(), w.gate_lower_bound = lb, w.eps = 1e-5f;
  w.scale = 1.0f / std::sqrt(static_cast<float>(D));
  const cuda::KdaDecodeShape shape{rows, H, D, K};
  // One random slot (state ~ N(0, 0.1^2), bf16 window) replicated into every slot.
  std::vector<float> s0(H * DD);
  for (auto& x : s0) x = 0.1f * rng.normal();
  if (kBf16)
    for (auto& x : s0) x = round_bf16(x);
  const auto cw0 = random_bf16(rng, 3 * Pz * (K - 1), 1.0f);
  DeviceBuffer<StateT> state(slots * H * DD);
  DeviceBuffer<bf16> conv(slots * 3 * Pz * (K - 1));
  std::vector<uint16_t> hb(kBf16 ? s0.size() : 0);
  for (size_t i = 0; i < hb.size(); ++i) hb[i] = float_to_bf16(s0[i]);
  K3_CUDA_CHECK(cudaMemcpy(state.data(), kBf16 ? static_cast<const void*>(hb.data()) : s0.data(),
                           s0.size() * sizeof(StateT), cudaMemcpyHostToDevice));
  cuda::copy_to_device(conv, reinterpret_cast<const bf16*>(cw0.data()), cw0.size());
  for (size_t s = 1; s < slots; ++s) {
    K3_CUDA_CHECK(cudaMemcpy(state.data() + s * H * DD, state.data(), H * DD * sizeof(StateT),
                             cudaMemcpyDeviceToDevice));
    K3_CUDA_CHECK(cudaMemcpy(conv.data() + s * cw0.size(), conv.data(), cw0.size() * 2,
                             cudaMemcpyDeviceToDevice));
  }
  std::vector<int32_t> slot_of(slots);  // copy c, row r -> slot c * rows + r
  for (size_t i = 0; i < slots; ++i) slot_of[i] = static_cast<int32_t>(i);
  const auto d_slots = cuda::to_device<int32_t>(slot_of);
  const auto u = random_bf16(rng, rows * 3 * Pz, 1.0f), f = random_bf16(rng, rows * Pz, 1.0f);
  const auto bl = random_bf16(rng, static_cast<size_t>(rows) * H, 1.0f);
  const auto z = random_bf16(rng, rows * Pz, 1.0f);
  const auto du = cuda::to_device<bf16>(u), df = cuda::to_device<bf16>(f);
  const auto db = cuda::to_device<bf16>(bl), dz = cuda::to_device<bf16>(z);
  DeviceBuffer<bf16> out(rows * Pz);
  auto op = [&](int c, cudaStream_t s) {
    cuda::kda_decode_step(du.data(), df.data(), db.data(), dz.data(), w,
                          d_slots.data() + static_cast<size_t>(c) * rows, conv.data(), state.data(),
                          out.data(), shape, s);
  };
  Result r{"kda", "H" + std::to_string(H) + "x128 " + (kBf16 ? "bf16" : "fp32") + "-state", "",
           rows, bytes};
  r.us = t.batched_us(op, R);
  // Check: row 0 (slot 0) of one more eager step against the CPU chain from the current state.
  auto host_state = [&] {  // slot 0
    std::vector<uint16_t> b(H * DD * sizeof(StateT) / 2);
    K3_CUDA_CHECK(cudaMemcpy(b.data(), state.data(), 2 * b.size(), cudaMemcpyDeviceToHost));
    if (kBf16) return floats(b);
    std::vector<float> v(H * DD);
    std::memcpy(v.data(), b.data(), 4 * v.size());
    return v;
  };
  std::vector<float> S = host_state();
  std::vector<uint16_t> winb(cw0.size());
  K3_CUDA_CHECK(cudaMemcpy(winb.data(), conv.data(), 2 * winb.size(), cudaMemcpyDeviceToHost));
  std::vector<float> win = floats(winb);
  out.fill_bytes(0xff);
  op(0, t.stream());
  K3_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
  const std::vector<float> got_out = floats(cuda::to_host<uint16_t>(out));
  const std::vector<float> got_S = host_state();
  std::vector<float> uf = floats(u), ff = floats(f), zf = floats(z), qkv(3 * Pz), g(Pz), beta(H),
                     o(Pz), ref(Pz);
  for (int s = 0; s < 3; ++s) {
    WeightMatrix wm;
    wm.name = "conv", wm.format = WeightFormat::F32, wm.rows = P, wm.cols = K;
    wm.data = conv_w.data() + s * Pz * K;
    cpu::kda_short_conv_step(uf.data() + s * Pz, win.data() + s * Pz * (K - 1), wm, P, K,
                             qkv.data() + s * Pz);
  }
  for (int h = 0; h < H; ++h) {
    cpu::l2_normalize(qkv.data() + h * D, D, ModelConfig::kQkL2NormEps);
    cpu::l2_normalize(qkv.data() + Pz + h * D, D, ModelConfig::kQkL2NormEps);
    beta[h] = cpu::sigmoid(bf16_to_float(bl[h]));
  }
  cpu::kda_decay_gate(ff.data(), dt.data(), a_log.data(), H, D, std::optional<float>(lb), g.data());
  cpu::kda_recurrence_step(S.data(), qkv.data(), qkv.data() + Pz, qkv.data() + 2 * Pz, g.data(),
                           beta.data(), H, D, w.scale, o.data());
  cpu::kda_gated_norm(o.data(), zf.data(), o_norm.data(), H, D, w.eps, ref.data());
  std::vector<double> ro(ref.begin(), ref.end()), rs(S.begin(), S.end());
  for (size_t i = 0; i < Pz; ++i) ro[i] = round_bf16(ref[i]);
  if (kBf16)
    for (size_t i = 0; i < rs.size(); ++i) rs[i] = round_bf16(S[i]);
  r.check = fmt("out %.1e state %.1e", maxrel(got_out.data(), ro.data(), Pz),
                maxrel(got_S.data(), rs.data(), rs.size()));
  record(r);
}

// ---- MLA absorbed decode (dense, paged) ----
constexpr int kKvLora = 512, kRope = 64, kRow = kKvLora + kRope, kPage = 64;

// ring 0: the CUDA-core split kernel; 2, 4 or 5: the tensor-core one (MlaDecodePlan::
// tensor_cores) with that tile ring (MlaDecodePlan::ring_tiles).
void bench_mla(Timer& t, int heads, int ctx, int rows, int ring, int sms, Rng& rng) {
  const int ppr = (ctx + kPage - 1) / kPage;  // pages per row
  const double cache_bytes = static_cast<double>(rows) * ctx * kRow * 2;
  const double bytes = cache_bytes + rows * heads * (kRow * 2.0 + kKvLora * 4.0);
  const int R = copies_for(cache_bytes);
  const size_t page_elems = static_cast<size_t>(kPage) * kRow, row_elems = ppr * page_elems;
  const size_t blocks = static_cast<size_t>(R) * rows;  // one distinct page run per (copy, row)
  // One row's pages on the host, replicated into every (copy, row) run on the device.
  const auto base = random_bf16(rng, row_elems, 1.0f);
  const DeviceBuffer<bf16> cache = bench::replicated<bf16>(base, blocks);
  const auto d_bt = bench::run_page_tables(blocks, ppr);  // [copy][row][ppr]
  const auto d_seq = cuda::to_device<int32_t>(std::vector<int32_t>(rows, ctx));
  const auto q_abs = random_bf16(rng, static_cast<size_t>(rows) * heads * kKvLora, 1.0f);
  const auto q_pe = random_bf16(rng, static_cast<size_t>(rows) * heads * kRope, 1.0f);
  const auto d_qa = cuda::to_device<bf16>(q_abs), d_qp = cuda::to_device<bf16>(q_pe);
  cuda::MlaDecodePlan p0;
  p0.rows = rows, p0.heads = heads, p0.kv_lora = kKvLora, p0.rope = kRope, p0.page_size = kPage;
  p0.max_pages = ppr, p0.max_sel = 0, p0.max_tokens = ctx;
  p0.tensor_cores = ring > 0;
  p0.ring_tiles = ring > 0 ? ring : 2;
  const cuda::MlaDecodePlan plan = cuda::plan_mla_decode(p0, sms);
  DeviceBuffer<uint8_t> ws(cuda::mla_decode_workspace_bytes(plan));
  DeviceBuffer<float> out(static_cast<size_t>(rows) * heads * kKvLora);
  const float scale = 1.0f / std::sqrt(192.0f);
  auto op = [&](int c, cudaStream_t s) {
    cuda::mla_decode(plan, d_qa.data(), d_qp.data(), cache.data(),
                     d_bt.data() + static_cast<size_t>(c) * rows * ppr, d_seq.data(), nullptr,
                     nullptr, scale, ws.data(), out.data(), false, s);
  };
  Result r{"mla",
           "H" + std::to_string(heads) + " ctx" + std::to_string(ctx / 1024) + "k splits" +
               std::to_string(plan.splits) + (ring > 0 ? " mma" + std::to_string(ring) : " fp32"),
           "", rows, bytes};
  r.us = t.batched_us(op, R);
  // Check: row 0 (all heads) against float64 over the base pages.
  out.fill_bytes(0xff);
  op(0, t.stream());
  K3_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
  std::vector<float> got(static_cast<size_t>(heads) * kKvLora);
  K3_CUDA_CHECK(cudaMemcpy(got.data(), out.data(), 4 * got.size(), cudaMemcpyDeviceToHost));
  const std::vector<float> cf = floats(base);
  std::vector<double> ref(got.size(), 0.0), s(static_cast<size_t>(ctx));
  for (int h = 0; h < heads; ++h) {
    double mx = -INFINITY, sum = 0;
    for (int tk = 0; tk < ctx; ++tk) {
      const float* row = &cf[static_cast<size_t>(tk) * kRow];
      double d = 0;
      for (int k = 0; k < kKvLora; ++k)
        d += static_cast<double>(bf16_to_float(q_abs[h * kKvLora + k])) * row[k];
      for (int k = 0; k < kRope; ++k)
        d += static_cast<double>(bf16_to_float(q_pe[h * kRope + k])) * row[kKvLora + k];
      s[tk] = d * scale;
      mx = std::max(mx, s[tk]);
    }
    for (double& v : s) sum += (v = std::exp(v - mx));
    for (int tk = 0; tk < ctx; ++tk)
      for (int k = 0; k < kKvLora; ++k)
        ref[h * kKvLora + k] += s[tk] / sum * cf[static_cast<size_t>(tk) * kRow + k];
  }
  r.check = fmt("out %.1e", maxrel(got.data(), ref.data(), got.size()));
  record(r);
}

// ---- router top-k ----
void bench_router(Timer& t, int rows, bool merge_tree, Rng& rng) {
  const int E = 896, top_k = 16;
  std::vector<float> logits(static_cast<size_t>(rows) * E), bias(E);
  for (auto& x : logits) x = 2.0f * rng.normal();
  for (auto& x : bias) x = 0.05f * rng.normal();
  const auto dl = cuda::to_device<float>(logits), dbias = cuda::to_device<float>(bias);
  DeviceBuffer<int32_t> ids(static_cast<size_t>(rows) * top_k);
  DeviceBuffer<float> wts(static_cast<size_t>(rows) * top_k);
  const cuda::RouterPlan p{.num_experts = E,
                           .top_k = top_k,
                           .renormalize = true,
                           .routed_scaling_factor = 2.827f,
                           .merge_tree = merge_tree};
  cuda::check_router_plan(p);
  auto op = [&](int, cudaStream_t s) {
    cuda::router_topk(p, dl.data(), dbias.data(), rows, ids.data(), wts.data(), s);
  };
  Result r{"router", merge_tree ? "E896 top16 merge tree" : "E896 top16 radix", "", rows,
           rows * E * 4.0 + E * 4.0 + rows * top_k * 8.0};
  r.warm = true;
  r.us = t.batched_us(op, 32);  // 32 launches on one (L2-warm) copy
  // Check: row 0 against cpu::route with an fp32 identity gate (its GEMM returns the logits).
  ids.fill_bytes(0xff), wts.fill_bytes(0xff);
  op(0, t.stream());
  K3_CUDA_CHECK(cudaStreamSynchronize(t.stream()));
  const auto gi = cuda::to_host<int32_t>(ids);
  const auto gw = cuda::to_host<float>(wts);
  std::vector<float> eye(static_cast<size_t>(E) * E, 0.0f);
  for (int e = 0; e < E; ++e) eye[static_cast<size_t>(e) * E + e] = 1.0f;
  const WeightMatrix gate{
      .name = "bench.gate", .format = WeightFormat::F32, .rows = E, .cols = E, .data = eye.data()};
  cpu::RouterConfig cfg;
  cfg.num_experts = E, cfg.top_k = top_k, cfg.routed_scaling_factor = p.routed_scaling_factor;
  std::vector<int> ri(top_k);
  std::vector<float> rw(top_k);
  cpu::route(gate, bias.data(), logits.data(), cfg, ri.data(), rw.data());
  int bad = 0;
  for (int i = 0; i < top_k; ++i) bad += gi[i] != ri[i];
  const std::vector<double> rwd(rw.begin(), rw.end());
  r.check = fmt("ids %.0f/16 w %.1e", top_k - bad, maxrel(gw.data(), rwd.data(), top_k));
  record(r);
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  using namespace k3;
  const std::string filter = argc == 3 && !std::strcmp(argv[1], "--filter") ? argv[2] : "";
  const bool known =
      filter.empty() || filter == "kda" || filter == "mla" || filter == "router" || filter == "dsa";
  if ((argc != 1 && filter.empty()) || !known) {
    std::fprintf(stderr, "usage: k3_bench_attn [--filter kda|mla|router|dsa]\n");
    return 2;
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("no GPU: skipped\n");
    return 77;
  }
  auto want = [&](const char* id) { return filter.empty() || filter == id; };
  try {
    cudaDeviceProp p{};
    K3_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
    std::printf("GPU: %s, %d SMs, L2 %zu MB, sm_%d%d\n", p.name, p.multiProcessorCount,
                static_cast<size_t>(p.l2CacheSize) >> 20, p.major, p.minor);
    Rng rng(12345);
    Timer t;
    bench::measure_card_curve(t.stream());
    const int row_counts[] = {1, 8, 64};
    if (want("kda"))
      for (int H : {6, 96})  // TP16, TP1
        for (int rows : row_counts) {
          bench_kda<float>(t, H, rows, rng);
          bench_kda<bf16>(t, H, rows, rng);
        }
    if (want("mla"))
      for (int heads : {6, 16})
        for (int ctx : {1024, 32768})
          for (int rows : row_counts)
            for (int ring : {0, 2, 4, 5})
              bench_mla(t, heads, ctx, rows, ring, p.multiProcessorCount, rng);
    if (want("router"))
      for (int rows : row_counts)
        for (bool tree : {false, true}) bench_router(t, rows, tree, rng);
    if (want("dsa"))  // K3.1's indexer: 32 heads x 128, top 2048
      for (int ctx : {32768, 131072})
        for (int rows : {1, 8}) {
          for (bool mma : {false, true}) bench::bench_dsa_scores(t, rows, ctx, mma, rng);
          for (bool split : {false, true}) bench::bench_dsa_topk(t, rows, ctx, split, rng);
        }
    bench::print_table();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
