// MLA absorbed decode over a paged cache and the router top-k, against float64 / CPU oracles on
// fresh random inputs (the seed is printed; K3_TEST_SEED replays it). Outputs are poisoned with
// NaN (ids with -1) before each launch, so every element must be written.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "cpu/ops_basic.h"
#include "cpu/ops_moe.h"
#include "cuda/device_buffer.h"
#include "cuda/mla_decode.h"
#include "cuda/router.h"
#include "gpu/gpu_check_util.h"
#include "model/weight_matrix.h"
#include "test_util.h"

namespace k3 {
namespace {

using gpu_test::bf16_ulp;
using gpu_test::expect_close;
using gpu_test::rms;
using gpu_test::Tol;

// ---- Tolerances: |gpu - ref| <= ulps * ulp_bf16(|ref|) + rel * RMS(ref), ref in float64 on the
// same bf16 inputs. fp32 math over <= 4100 tokens x 576 terms stays near 1e-6 of the RMS. ----
constexpr Tol kMlaF32Out{0.0, 1e-5};
constexpr Tol kMlaBf16Out{1.0, 1e-6};      // one rounding of an fp32 value already close
constexpr double kRouterWeightRel = 1e-6;  // expf vs std::exp: a few ulps of each weight
constexpr double kRouterTieGap = 1e-6;     // closer choice scores are redrawn

using cuda::bf16;
using cuda::DeviceBuffer;

int sm_count() {
  int dev = 0, n = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  K3_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

// ============================== MLA decode ==============================

constexpr int kKvLora = 512, kRope = 64, kD = kKvLora + kRope, kPage = 64;

// One batch: per-row token lists (positions into the row's cache), paged cache on a shuffled
// page pool; unused pages and slots hold NaN, so a stray read poisons the output.
struct MlaCase {
  int rows = 0, heads = 0, max_pages = 0, max_sel = 0;
  std::vector<int> seq;               // [rows] cached tokens
  std::vector<std::vector<int>> sel;  // [rows][n] positions, empty when dense
  std::vector<uint16_t> q_abs, q_pe;  // [rows][heads][512], [rows][heads][64] bf16 bits
  std::vector<uint16_t> cache;        // [pages][64][576] bf16 bits
  std::vector<int32_t> block_table;   // [rows][max_pages]
};

MlaCase make_case(Rng& rng, const std::vector<int>& seq, int heads, bool sparse) {
  MlaCase c;
  c.rows = static_cast<int>(seq.size());
  c.heads = heads;
  c.seq = seq;
  int total = 0;
  for (int s : seq) {
    c.max_pages = std::max(c.max_pages, (s + kPage - 1) / kPage);
    total += (s + kPage - 1) / kPage;
  }
  c.max_pages = std::max(c.max_pages, 1);
  const int pool = total + 3;  // a few pages nobody owns
  std::vector<int> perm(static_cast<size_t>(pool));
  std::iota(perm.begin(), perm.end(), 0);
  for (int i = pool - 1; i > 0; --i)
    std::swap(perm[static_cast<size_t>(i)], perm[rng.next_u64() % static_cast<uint64_t>(i + 1)]);
  c.cache.assign(static_cast<size_t>(pool) * kPage * kD, 0xffff);  // NaN
  c.block_table.assign(static_cast<size_t>(c.rows) * c.max_pages, -1);
  int next = 0;
  for (int r = 0; r < c.rows; ++r) {
    for (int p = 0; p * kPage < seq[r]; ++p)
      c.block_table[static_cast<size_t>(r) * c.max_pages + p] = perm[static_cast<size_t>(next++)];
    for (int t = 0; t < seq[r]; ++t) {
      const int64_t page = c.block_table[static_cast<size_t>(r) * c.max_pages + t / kPage];
      const size_t off = (static_cast<size_t>(page) * kPage + t % kPage) * kD;
      for (int d = 0; d < kD; ++d) c.cache[off + d] = float_to_bf16(rng.normal());
    }
  }
  c.sel.resize(static_cast<size_t>(c.rows));
  if (sparse) {
    for (int r = 0; r < c.rows; ++r) {  // a random subset of about a third, in random order
      std::vector<int> all(static_cast<size_t>(seq[r]));
      std::iota(all.begin(), all.end(), 0);
      for (int i = seq[r] - 1; i > 0; --i)
        std::swap(all[static_cast<size_t>(i)], all[rng.next_u64() % static_cast<uint64_t>(i + 1)]);
      all.resize(static_cast<size_t>(seq[r] / 3 + 1));
      c.sel[static_cast<size_t>(r)] = all;
      c.max_sel = std::max(c.max_sel, static_cast<int>(all.size()));
    }
  }
  c.q_abs = test::random_bf16(rng, static_cast<size_t>(c.rows) * heads * kKvLora);
  c.q_pe = test::random_bf16(rng, static_cast<size_t>(c.rows) * heads * kRope);
  return c;
}

// float64: s_t = (q_abs.c_t + q_pe.pe_t) * scale over the row's tokens, softmax, o = sum p c.
std::vector<double> mla_reference(const MlaCase& c, double scale) {
  std::vector<double> o(static_cast<size_t>(c.rows) * c.heads * kKvLora, 0.0);
  for (int r = 0; r < c.rows; ++r) {
    std::vector<int> toks = c.sel[static_cast<size_t>(r)];
    if (toks.empty()) {
      toks.resize(static_cast<size_t>(c.seq[r]));
      std::iota(toks.begin(), toks.end(), 0);
    }
    for (int h = 0; h < c.heads; ++h) {
      const size_t qh = static_cast<size_t>(r) * c.heads + h;
      std::vector<double> s(toks.size());
      double mx = -INFINITY;
      for (size_t i = 0; i < toks.size(); ++i) {
        const int t = toks[i];
        const int64_t page = c.block_table[static_cast<size_t>(r) * c.max_pages + t / kPage];
        const uint16_t* row = &c.cache[(static_cast<size_t>(page) * kPage + t % kPage) * kD];
        double d = 0;
        for (int k = 0; k < kKvLora; ++k)
          d +=
              static_cast<double>(bf16_to_float(c.q_abs[qh * kKvLora + k])) * bf16_to_float(row[k]);
        for (int k = 0; k < kRope; ++k)
          d += static_cast<double>(bf16_to_float(c.q_pe[qh * kRope + k])) *
               bf16_to_float(row[kKvLora + k]);
        s[i] = d * scale;
        mx = std::max(mx, s[i]);
      }
      double sum = 0;
      for (double& v : s) sum += (v = std::exp(v - mx));
      for (size_t i = 0; i < toks.size(); ++i) {
        const int t = toks[i];
        const int64_t page = c.block_table[static_cast<size_t>(r) * c.max_pages + t / kPage];
        const uint16_t* row = &c.cache[(static_cast<size_t>(page) * kPage + t % kPage) * kD];
        for (int k = 0; k < kKvLora; ++k) o[qh * kKvLora + k] += s[i] / sum * bf16_to_float(row[k]);
      }
    }
  }
  return o;
}

// The case on the device, and a launch of it.
struct MlaDev {
  DeviceBuffer<bf16> q_abs, q_pe, cache;
  DeviceBuffer<int32_t> bt, seq, sel, nsel;
  DeviceBuffer<uint8_t> ws, out;
  cuda::MlaDecodePlan plan;
  bool sparse = false;

  // ring 0: the CUDA-core split kernel; 2, 4 or 5: the tensor-core one (MlaDecodePlan::
  // tensor_cores) with that tile ring (MlaDecodePlan::ring_tiles).
  MlaDev(const MlaCase& c, int force_splits, int ring) {
    q_abs = cuda::to_device<bf16>(c.q_abs);
    q_pe = cuda::to_device<bf16>(c.q_pe);
    cache = cuda::to_device<bf16>(c.cache);
    bt = cuda::to_device<int32_t>(c.block_table);
    seq = cuda::to_device<int32_t>(std::vector<int32_t>(c.seq.begin(), c.seq.end()));
    sparse = c.max_sel > 0;
    int64_t max_tokens = 0;
    if (sparse) {
      std::vector<int32_t> s(static_cast<size_t>(c.rows) * c.max_sel, -1), n;
      for (int r = 0; r < c.rows; ++r) {
        const auto& v = c.sel[static_cast<size_t>(r)];
        std::copy(v.begin(), v.end(), s.begin() + static_cast<int64_t>(r) * c.max_sel);
        n.push_back(static_cast<int32_t>(v.size()));
      }
      sel = cuda::to_device<int32_t>(s);
      nsel = cuda::to_device<int32_t>(n);
      max_tokens = c.max_sel;
    } else {
      max_tokens = *std::max_element(c.seq.begin(), c.seq.end());
    }
    const cuda::MlaDecodePlan p{.rows = c.rows,
                                .heads = c.heads,
                                .kv_lora = kKvLora,
                                .rope = kRope,
                                .page_size = kPage,
                                .max_pages = c.max_pages,
                                .max_sel = c.max_sel,
                                .max_tokens = max_tokens};
    cuda::MlaDecodePlan asked = p;
    asked.tensor_cores = ring > 0;
    asked.ring_tiles = ring > 0 ? ring : 2;
    plan = cuda::plan_mla_decode(asked, sm_count());
    if (force_splits > 0) plan.splits = force_splits;
    ws = DeviceBuffer<uint8_t>(cuda::mla_decode_workspace_bytes(plan));
    out = DeviceBuffer<uint8_t>(static_cast<size_t>(c.rows) * c.heads * kKvLora * 4);
  }
  void launch(float scale, bool bf16_out, cudaStream_t stream) {
    cuda::mla_decode(plan, q_abs.data(), q_pe.data(), cache.data(), bt.data(), seq.data(),
                     sparse ? sel.data() : nullptr, sparse ? nsel.data() : nullptr, scale,
                     ws.data(), out.data(), bf16_out, stream);
  }
  std::vector<float> result(bool bf16_out) {
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    const size_t n = out.size() / 4;
    std::vector<float> f(n);
    if (bf16_out) {
      std::vector<uint16_t> h(n);
      K3_CUDA_CHECK(cudaMemcpy(h.data(), out.data(), 2 * n, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < n; ++i) f[i] = bf16_to_float(h[i]);
    } else {
      K3_CUDA_CHECK(cudaMemcpy(f.data(), out.data(), 4 * n, cudaMemcpyDeviceToHost));
    }
    return f;
  }
};

const float kScale = 1.0f / std::sqrt(192.0f);  // K3: 1/sqrt(qk_nope 128 + qk_rope 64)

// The split kernels under test (MlaDev's ring): the CUDA-core one, then the tensor-core one with
// each tile ring.
const int kRings[] = {0, 2, 4, 5};
std::string kernel_name(int ring) {
  return ring == 0 ? "fp32 kernel" : "mma kernel, ring " + std::to_string(ring);
}

// Every split kernel of kRings, each against the same float64 reference and tolerances.
void check_mla(const std::vector<int>& seq, int heads, bool sparse, int force_splits) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const MlaCase c = make_case(rng, seq, heads, sparse);
  const std::vector<double> ref = mla_reference(c, kScale);
  for (int ring : kRings) {
    MlaDev d(c, force_splits, ring);
    const std::string what = kernel_name(ring) + ", heads " + std::to_string(heads) +
                             (sparse ? " sparse" : " dense") + ", splits " +
                             std::to_string(d.plan.splits);
    for (bool bf16_out : {false, true}) {
      d.out.fill_bytes(0xff);
      d.launch(kScale, bf16_out, nullptr);
      K3_CUDA_CHECK_LAUNCH();
      expect_close(d.result(bf16_out), ref, bf16_out ? kMlaBf16Out : kMlaF32Out,
                   what + (bf16_out ? ", bf16 out" : ", fp32 out"));
    }
  }
}

const std::vector<int> kSeqs{1, 7, 300, 4100};

// 20 heads: two CTA head groups of 10.
TEST(CudaMla, DenseMatchesFloat64) {
  for (int heads : {4, 6, 16, 20}) check_mla(kSeqs, heads, false, 0);
}

TEST(CudaMla, SplitCountDoesNotMatter) {
  for (int splits : {1, 3, 200}) check_mla(kSeqs, 6, false, splits);
}

// DSA: a selected subset equals dense attention over the gathered tokens (the reference).
TEST(CudaMla, SparseSelectedEqualsGatheredDense) {
  for (int heads : {6, 16}) check_mla(kSeqs, heads, true, 0);
}

void check_graph_replay(int ring) {
  SCOPED_TRACE(kernel_name(ring));
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const MlaCase c = make_case(rng, kSeqs, 6, false);
  MlaDev d(c, 0, ring);
  d.launch(kScale, false, nullptr);
  const std::vector<float> eager = d.result(false);
  cudaStream_t s;
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  K3_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  d.launch(kScale, false, s);
  K3_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  K3_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  auto replay = [&] {
    d.out.fill_bytes(0xff);
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    K3_CUDA_CHECK(cudaGraphLaunch(ge, s));
    K3_CUDA_CHECK(cudaStreamSynchronize(s));
    return d.result(false);
  };
  const std::vector<float> got = replay();
  EXPECT_EQ(std::memcmp(got.data(), eager.data(), 4 * got.size()), 0) << "replay != eager";
  // The lengths live in device memory: the same graph serves the next step's (shorter) lengths.
  MlaCase c2 = c;
  c2.seq = {1, 5, 64, 2000};
  cuda::copy_to_device(d.seq, c2.seq.data(), c2.seq.size());
  expect_close(replay(), mla_reference(c2, kScale), kMlaF32Out, "replay with new seq_len");
  K3_CUDA_CHECK(cudaGraphExecDestroy(ge));
  K3_CUDA_CHECK(cudaGraphDestroy(g));
  K3_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST(CudaMla, GraphReplayEqualsEager) {
  for (int ring : kRings) check_graph_replay(ring);
}

TEST(CudaMla, RefusesUnsupportedShapes) {
  // Other shapes take the generic kernel (test_cuda_mla_generic.cu), up to kv_lora 1024 in
  // multiples of 8 and rope 128.
  for (auto [kv_lora, rope] : {std::pair{2048, 64}, std::pair{260, 64}, std::pair{512, 200}}) {
    const cuda::MlaDecodePlan p{
        .rows = 1, .heads = 6, .kv_lora = kv_lora, .rope = rope, .page_size = 64, .max_pages = 1};
    EXPECT_THROW(cuda::plan_mla_decode(p, 132), k3::Error) << kv_lora << " / " << rope;
  }
}

// ============================== router ==============================

// ties: logits from 5 levels and no bias, so many choice scores are exactly equal and the
// order falls back to the lower id (no redraw).
void check_router(int E, int top_k, bool with_bias, bool renormalize, bool ties = false,
                  bool merge_tree = false) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int rows = 37;
  std::vector<float> bias;
  if (with_bias) bias = test::random_normal(rng, static_cast<size_t>(E), 0.05f);
  std::vector<float> logits(static_cast<size_t>(rows) * E);
  for (int r = 0; r < rows; ++r) {
    float* lg = &logits[static_cast<size_t>(r) * E];
    if (ties) {
      for (int e = 0; e < E; ++e) lg[e] = static_cast<float>(rng.next_u64() % 5) - 2.0f;
      continue;
    }
    for (;;) {  // redraw the row until its top_k + 1 choice scores are well separated
      for (int e = 0; e < E; ++e) lg[e] = 2.0f * rng.normal();
      std::vector<float> ch(static_cast<size_t>(E));
      for (int e = 0; e < E; ++e) ch[e] = cpu::sigmoid(lg[e]) + (with_bias ? bias[e] : 0.0f);
      std::sort(ch.begin(), ch.end(), std::greater<float>());
      bool ok = true;
      for (int i = 0; i < std::min(top_k, E - 1); ++i)
        ok = ok && ch[i] - ch[i + 1] >= kRouterTieGap;
      if (ok) break;
    }
  }
  // Oracle: cpu::route with an fp32 identity gate, so its router GEMM returns the logits exactly.
  std::vector<float> eye(static_cast<size_t>(E) * E, 0.0f);
  for (int e = 0; e < E; ++e) eye[static_cast<size_t>(e) * E + e] = 1.0f;
  const WeightMatrix gate{
      .name = "test.gate", .format = WeightFormat::F32, .rows = E, .cols = E, .data = eye.data()};
  const cpu::RouterConfig cfg{.num_experts = E,
                              .top_k = top_k,
                              .renormalize = renormalize,
                              .routed_scaling_factor = 2.827f};
  std::vector<int> ref_ids(static_cast<size_t>(rows) * top_k);
  std::vector<float> ref_w(ref_ids.size());
  for (int r = 0; r < rows; ++r)
    cpu::route(gate, with_bias ? bias.data() : nullptr, &logits[static_cast<size_t>(r) * E], cfg,
               &ref_ids[static_cast<size_t>(r) * top_k], &ref_w[static_cast<size_t>(r) * top_k]);

  const cuda::RouterPlan p{.num_experts = E,
                           .top_k = top_k,
                           .renormalize = renormalize,
                           .routed_scaling_factor = cfg.routed_scaling_factor,
                           .merge_tree = merge_tree};
  DeviceBuffer<float> d_logits = cuda::to_device<float>(logits);
  DeviceBuffer<float> d_bias = cuda::to_device<float>(bias);
  DeviceBuffer<int32_t> d_ids(ref_ids.size());
  DeviceBuffer<float> d_w(ref_ids.size());
  d_ids.fill_bytes(0xff);
  d_w.fill_bytes(0xff);
  cuda::router_topk(p, d_logits.data(), with_bias ? d_bias.data() : nullptr, rows, d_ids.data(),
                    d_w.data(), nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<int32_t> ids = cuda::to_host<int32_t>(d_ids);
  const std::vector<float> w = cuda::to_host<float>(d_w);
  int64_t bad_ids = 0, bad_w = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    bad_ids += ids[i] != ref_ids[i];
    bad_w += !(std::fabs(w[i] - ref_w[i]) <= kRouterWeightRel * std::fabs(ref_w[i]));
  }
  const std::string what = "E " + std::to_string(E) + " top " + std::to_string(top_k) +
                           (with_bias ? " bias" : "") + (renormalize ? " renorm" : "") +
                           (merge_tree ? " merge tree" : " radix");
  EXPECT_EQ(bad_ids, 0) << what << ": expert ids differ";
  EXPECT_EQ(bad_w, 0) << what << ": weights differ";
}

// Both selects (RouterPlan::merge_tree).
TEST(CudaRouter, MatchesCpuRoute) {
  for (bool tree : {false, true}) {
    for (auto [E, k] : {std::pair{896, 16}, std::pair{64, 6}, std::pair{16, 4}, std::pair{8, 8},
                        std::pair{1024, 32}, std::pair{1000, 17}, std::pair{33, 1}})
      for (bool bias : {false, true})
        for (bool renorm : {false, true}) check_router(E, k, bias, renorm, false, tree);
    for (auto [E, k] : {std::pair{896, 16}, std::pair{40, 32}, std::pair{1024, 32}})
      check_router(E, k, false, true, true, tree);
  }
}

TEST(CudaRouter, RefusesUnsupportedPlans) {
  using P = cuda::RouterPlan;
  EXPECT_THROW(cuda::check_router_plan(P{.num_experts = 896, .top_k = 16, .num_expert_group = 8}),
               k3::Error);
  EXPECT_THROW(cuda::check_router_plan(P{.num_experts = 896, .top_k = 33}), k3::Error);
  EXPECT_THROW(cuda::check_router_plan(P{.num_experts = 2048, .top_k = 16}), k3::Error);
}

}  // namespace
}  // namespace k3
