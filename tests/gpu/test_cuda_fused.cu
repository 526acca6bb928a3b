// Kernels of the specialized decode step against their CPU / host oracles on fresh random inputs
// (the seed is printed; K3_TEST_SEED replays it): the fused AttnRes mix + RMSNorm, the L2
// prefetch, the compacted expert grouping and the router top-k that groups in its last CTA. Outputs
// are poisoned before each launch (NaN for bf16, 0x7f7f7f7f for int32), so every element must be
// written.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "cpu/ops_attn_res.h"
#include "cpu/ops_basic.h"
#include "cuda/attn_res.h"
#include "cuda/attn_res_norm.h"
#include "cuda/device_buffer.h"
#include "cuda/l2_prefetch.h"
#include "cuda/moe_dispatch.h"
#include "cuda/router.h"
#include "gpu/gpu_check_util.h"
#include "test_util.h"

namespace k3 {
namespace {

using gpu_test::bf16_ulp;
using gpu_test::expect_close;
using gpu_test::Tol;

// ---- Tolerances ----
// The mix h against cpu::attn_res_mix -> bf16: the scores' 7168-term sums run in another order,
// so p moves by ~1e-7 relative; a bf16 rounding may flip (1 ulp), and where the mix cancels,
// the absolute error is ~1e-7 of the sources (the RMS term), as in test_cuda_ops' kAttnRes.
constexpr Tol kMixVsCpu{1.0, 1e-4};
// x against the CPU chain (attn_res_mix, bf16, rms_norm, bf16): where the GPU's h equals the
// CPU's, only the sum of squares' order differs, so |dx| <= 1 bf16 ulp of the reference; where
// h itself differs by dh, x may move by dh * inv * |w| plus two roundings (kFlippedUlps).
constexpr double kNormUlps = 1.0;
constexpr double kFlippedUlps = 2.0;
// Elements of x that differ at all: rare 1-ulp flips from the fp32 reduction order.
constexpr double kMaxFlipFraction = 0.01;
// h against cuda::attn_res_mix on the same inputs: identical bits (same cluster shape and order).

using cuda::bf16;
using cuda::DeviceBuffer;

std::vector<float> bf16_to_floats(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_float(b[i]);
  return f;
}

// A bf16 device buffer poisoned with NaN, read back as bits.
DeviceBuffer<bf16> poisoned_bf16(size_t n) {
  DeviceBuffer<bf16> d(n);
  d.fill_bytes(0xff);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

// Rows [rows, hidden] out of a strided buffer [rows, stride].
std::vector<uint16_t> unstride(const std::vector<uint16_t>& a, int64_t rows, int64_t hidden,
                               int64_t stride) {
  std::vector<uint16_t> o(static_cast<size_t>(rows * hidden));
  for (int64_t r = 0; r < rows; ++r)
    std::copy(a.begin() + r * stride, a.begin() + r * stride + hidden, o.begin() + r * hidden);
  return o;
}

int64_t count_diff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

// ============================== AttnRes mix + RMSNorm ==============================

TEST(CudaAttnResNorm, MatchesCpuChain) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const float eps = 1e-5f;
  for (const int64_t hidden : {int64_t{7168}, int64_t{203}}) {
    for (const int n : {1, 3, 9}) {
      for (const int64_t rows : {int64_t{1}, int64_t{8}, int64_t{64}}) {
        const std::string what = "attn_res_norm n " + std::to_string(n) + " rows " +
                                 std::to_string(rows) + " hidden " + std::to_string(hidden);
        SCOPED_TRACE(what);
        const int64_t per = rows * hidden;
        const size_t H = static_cast<size_t>(hidden);
        // Sources of very different RMS (as the bank's blocks), O(1) scores, a norm weight ~1.
        std::vector<uint16_t> bank;  // [n][rows][hidden] bf16 bits
        for (int j = 0; j < n; ++j) {
          const auto b = test::random_bf16(rng, static_cast<size_t>(per), std::exp(rng.normal()));
          bank.insert(bank.end(), b.begin(), b.end());
        }
        const std::vector<float> val = bf16_to_floats(bank);
        const auto score_w = test::random_normal(rng, H, 2.0f / std::sqrt(float(hidden)));
        std::vector<float> norm_w(H);
        for (auto& w : norm_w) w = 1.0f + 0.3f * rng.normal();
        const auto dbank = cuda::to_device<bf16>(bank);
        const auto dsw = cuda::to_device<float>(score_w);
        const auto dnw = cuda::to_device<float>(norm_w);

        // Bank form, exposing h; and the stock mix on the same inputs.
        auto dx = poisoned_bf16(static_cast<size_t>(per));
        auto dh = poisoned_bf16(static_cast<size_t>(per));
        auto dmix = poisoned_bf16(static_cast<size_t>(per));
        cuda::attn_res_mix_norm(dbank.data(), n, per, hidden, dsw.data(), rows, hidden, eps,
                                dnw.data(), dx.data(), hidden, nullptr, dh.data(), hidden);
        cuda::attn_res_mix(dbank.data(), n, per, hidden, dsw.data(), rows, hidden, eps, dmix.data(),
                           hidden, nullptr, nullptr);
        K3_CUDA_CHECK(cudaDeviceSynchronize());
        const auto x_bits = cuda::to_host<uint16_t>(dx);
        const auto h_bits = cuda::to_host<uint16_t>(dh);
        const auto mix_bits = cuda::to_host<uint16_t>(dmix);
        EXPECT_EQ(count_diff(h_bits, mix_bits), 0) << "h must equal attn_res_mix bit for bit";
        if (n == 1) {
          EXPECT_EQ(0, std::memcmp(h_bits.data(), bank.data(), h_bits.size() * 2))
              << "one source: h = v_0 bit for bit";
        }

        // CPU chain per row: mix -> bf16 -> rms_norm -> bf16 (h_ref, x_ref); inv from h_ref.
        std::vector<float> h_ref(static_cast<size_t>(per)), x_ref(static_cast<size_t>(per));
        std::vector<float> inv_ref(static_cast<size_t>(rows));
        std::vector<float> row(H);
        for (int64_t r = 0; r < rows; ++r) {
          std::vector<const float*> src;
          for (int j = 0; j < n; ++j) src.push_back(val.data() + j * per + r * hidden);
          cpu::attn_res_mix(src.data(), n, score_w.data(), hidden, eps, row.data());
          for (auto& v : row) v = round_bf16(v);
          std::copy(row.begin(), row.end(), h_ref.begin() + r * hidden);
          double ss = 0;
          for (float v : row) ss += double(v) * v;
          inv_ref[static_cast<size_t>(r)] = float(1.0 / std::sqrt(ss / double(hidden) + eps));
          cpu::rms_norm(row.data(), norm_w.data(), hidden, eps, row.data());
          for (auto& v : row) v = round_bf16(v);
          std::copy(row.begin(), row.end(), x_ref.begin() + r * hidden);
        }
        const auto h = bf16_to_floats(h_bits), x = bf16_to_floats(x_bits);
        expect_close(h, h_ref, kMixVsCpu, what + " h vs cpu");

        int64_t bad = 0, flips = 0, first = -1;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t i = 0; i < hidden; ++i) {
            const size_t k = static_cast<size_t>(r * hidden + i);
            const double dh_abs = std::fabs(double(h[k]) - h_ref[k]);
            // Where h differs, each side rounds its own value: a cancelling mix can leave the
            // GPU's x well above a near-zero reference, so the ulp is the larger one's.
            const float big = std::max(std::fabs(x[k]), std::fabs(x_ref[k]));
            const double lim =
                dh_abs == 0.0 ? kNormUlps * bf16_ulp(x_ref[k])
                              : dh_abs * inv_ref[static_cast<size_t>(r)] * std::fabs(norm_w[i]) +
                                    kFlippedUlps * bf16_ulp(big);
            const double d = std::fabs(double(x[k]) - x_ref[k]);
            if (!std::isfinite(x[k]) || !(d <= lim)) {
              if (first < 0) first = static_cast<int64_t>(k);
              ++bad;
            }
            flips += !(x[k] == x_ref[k]);
          }
        }
        EXPECT_EQ(bad, 0) << "x: " << bad << " of " << per << " outside tolerance; first #" << first
                          << " got " << (first >= 0 ? x[first] : 0.0f) << " ref "
                          << (first >= 0 ? x_ref[first] : 0.0f);
        EXPECT_LE(double(flips), kMaxFlipFraction * double(per))
            << "x: " << flips << " of " << per << " elements differ from the CPU chain";

        // Pointer form over separate, padded buffers (pads NaN: never read), x written over the
        // last source (in place, same stride), no h: the same x bits (deterministic).
        const int64_t stride = hidden + 8;
        std::vector<DeviceBuffer<bf16>> bufs;
        cuda::AttnResSources s;
        for (int j = 0; j < n; ++j) {
          std::vector<uint16_t> padded(static_cast<size_t>(rows * stride), 0xffff);
          for (int64_t r = 0; r < rows; ++r)
            std::copy(bank.begin() + j * per + r * hidden,
                      bank.begin() + j * per + (r + 1) * hidden, padded.begin() + r * stride);
          bufs.push_back(cuda::to_device<bf16>(padded));
          s.src[j] = bufs.back().data();
        }
        cuda::attn_res_mix_norm(s, n, stride, dsw.data(), rows, hidden, eps, dnw.data(),
                                bufs.back().data(), stride, nullptr);
        K3_CUDA_CHECK(cudaDeviceSynchronize());
        const auto x2 = unstride(cuda::to_host<uint16_t>(bufs.back()), rows, hidden, stride);
        EXPECT_EQ(count_diff(x2, x_bits), 0) << "pointer form / in place differs from bank form";
      }
    }
  }
}

// No norm weight (null) is a plain RMSNorm of h; a launch is rejected on bad arguments.
TEST(CudaAttnResNorm, NullWeightAndErrors) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int n = 4;
  const int64_t rows = 5, hidden = 2048, per = rows * hidden;
  const auto bank = test::random_bf16(rng, static_cast<size_t>(n * per));
  const auto score_w = test::random_normal(rng, hidden, 2.0f / std::sqrt(float(hidden)));
  const auto dbank = cuda::to_device<bf16>(bank);
  const auto dsw = cuda::to_device<float>(score_w);
  auto dx = poisoned_bf16(static_cast<size_t>(per));
  auto dh = poisoned_bf16(static_cast<size_t>(per));
  cuda::attn_res_mix_norm(dbank.data(), n, per, hidden, dsw.data(), rows, hidden, 1e-6f, nullptr,
                          dx.data(), hidden, nullptr, dh.data(), hidden);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  const auto h = bf16_to_floats(cuda::to_host<uint16_t>(dh));
  const auto x = bf16_to_floats(cuda::to_host<uint16_t>(dx));
  std::vector<float> ref(static_cast<size_t>(per));
  for (int64_t r = 0; r < rows; ++r) {  // the norm of the GPU's own h: only the ss order differs
    cpu::rms_norm(h.data() + r * hidden, nullptr, hidden, 1e-6f, ref.data() + r * hidden);
  }
  for (auto& v : ref) v = round_bf16(v);
  expect_close(x, ref, Tol{kNormUlps, 0.0}, "attn_res_norm null weight");

  EXPECT_THROW(cuda::attn_res_mix_norm(dbank.data(), 17, per, hidden, dsw.data(), rows, hidden,
                                       1e-6f, nullptr, dx.data(), hidden, nullptr),
               Error);
  // hidden above the 32768 the registers hold (strides valid; rejected before any launch)
  EXPECT_THROW(cuda::attn_res_mix_norm(dbank.data(), n, rows * 40000, 40000, dsw.data(), rows,
                                       40000, 1e-6f, nullptr, dx.data(), 40000, nullptr),
               Error);
}

// ============================== L2 prefetch ==============================

TEST(CudaL2Prefetch, LeavesDataUnchanged) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  // Buffers of odd sizes; ranges at odd offsets (unaligned starts and ends) and whole buffers.
  const size_t sizes[] = {(3u << 20) + 37, 4096, 1, 129, (1u << 20)};
  std::vector<std::vector<uint8_t>> host;
  std::vector<DeviceBuffer<uint8_t>> dev;
  for (size_t sz : sizes) {
    std::vector<uint8_t> h(sz);
    for (auto& b : h) b = static_cast<uint8_t>(rng.next_u64());
    dev.push_back(cuda::to_device<uint8_t>(h));
    host.push_back(std::move(h));
  }
  cuda::L2PrefetchList list;
  list.r[list.n++] = {dev[0].data() + 3, sizes[0] - 3};
  list.r[list.n++] = {dev[1].data(), sizes[1]};
  list.r[list.n++] = {dev[2].data(), 1};
  list.r[list.n++] = {dev[3].data() + 1, 127};
  list.r[list.n++] = {dev[4].data(), 0};  // empty range inside a list
  list.r[list.n++] = {dev[4].data() + 100, sizes[4] - 200};
  EXPECT_EQ(list.total(), sizes[0] - 3 + sizes[1] + 1 + 127 + sizes[4] - 200);

  cudaStream_t stream;
  K3_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const bool by_load : {false, true})  // ragged ranges: the loads stay in bounds
    for (const int ctas : {1, 8, 16, 64}) cuda::l2_prefetch(list, ctas, stream, by_load);
  K3_CUDA_CHECK(cudaStreamSynchronize(stream));
  K3_CUDA_CHECK(cudaGetLastError());
  for (size_t i = 0; i < dev.size(); ++i)
    EXPECT_TRUE(cuda::to_host<uint8_t>(dev[i]) == host[i]) << "buffer " << i << " changed";

  // An empty list, or one of zero-byte ranges, enqueues nothing (checked under stream capture).
  cuda::L2PrefetchList empty, zeros;
  zeros.r[zeros.n++] = {nullptr, 0};
  zeros.r[zeros.n++] = {dev[0].data(), 0};
  EXPECT_EQ(zeros.total(), 0u);
  K3_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cuda::l2_prefetch(empty, 16, stream);
  cuda::l2_prefetch(zeros, 16, stream);
  cudaGraph_t graph;
  K3_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  size_t nodes = 123;
  K3_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  EXPECT_EQ(nodes, 0u) << "an empty prefetch list must launch nothing";
  K3_CUDA_CHECK(cudaGraphDestroy(graph));

  cuda::L2PrefetchList bad;
  bad.r[bad.n++] = {nullptr, 64};
  EXPECT_THROW(cuda::l2_prefetch(bad, 16, stream), Error);
  EXPECT_THROW(cuda::l2_prefetch(list, 0, stream), Error);
  K3_CUDA_CHECK(cudaStreamDestroy(stream));
}

// ============================== compacted expert grouping ==============================

struct Grouping {
  std::vector<int32_t> slot_expert, slot_offsets, row_index, position;
};

// Host oracle: the pairs of local experts [begin, begin + E) ordered by local id, then by pair
// index (stable); others get position -1. Compact packs the active experts into the first
// slots and leaves the tail empty at the grouped total.
Grouping group_reference(const std::vector<int32_t>& ids, int top_k, int begin, int E,
                         bool compact) {
  const int n = static_cast<int>(ids.size());
  const auto local = [&](int e) { return e >= begin && e < begin + E; };
  std::vector<int> count(static_cast<size_t>(E), 0);
  int grouped = 0;
  for (int e : ids)
    if (local(e)) ++count[static_cast<size_t>(e - begin)], ++grouped;
  Grouping g;
  g.slot_expert.assign(static_cast<size_t>(E), -1);
  g.slot_offsets.assign(static_cast<size_t>(E) + 1, grouped);
  std::vector<int> start(static_cast<size_t>(E));
  int run = 0, active = 0;
  for (int e = 0; e < E; ++e) {
    start[static_cast<size_t>(e)] = run;
    const int c = count[static_cast<size_t>(e)];
    if (!compact) {
      g.slot_offsets[static_cast<size_t>(e)] = run;
      g.slot_expert[static_cast<size_t>(e)] = c > 0 ? e : -1;
    } else if (c > 0) {
      g.slot_offsets[static_cast<size_t>(active)] = run;
      g.slot_expert[static_cast<size_t>(active)] = e;
      ++active;
    }
    run += c;
  }
  g.row_index.assign(static_cast<size_t>(grouped), -1);
  g.position.assign(static_cast<size_t>(n), -1);
  std::vector<int> next = start;
  for (int p = 0; p < n; ++p) {  // ascending p: stable within an expert
    const int e = ids[static_cast<size_t>(p)];
    if (!local(e)) continue;
    const int pos = next[static_cast<size_t>(e - begin)]++;
    g.position[static_cast<size_t>(p)] = pos;
    g.row_index[static_cast<size_t>(pos)] = p / top_k;
  }
  return g;
}

// The device grouping; row_index is compared over the grouped positions only (the rest is
// not written).
Grouping group_device(const DeviceBuffer<int32_t>& ids, int64_t rows, int top_k,
                      cuda::LocalExperts local, bool compact, size_t grouped) {
  const size_t n = static_cast<size_t>(rows * top_k);
  const size_t E = static_cast<size_t>(local.count);
  DeviceBuffer<int32_t> se(E), so(E + 1), ri(n), po(n);
  for (auto* b : {&se, &so, &ri, &po}) b->fill_bytes(0x7f);
  if (compact)
    cuda::moe_group_by_expert_compact(ids.data(), rows, top_k, local, se.data(), so.data(),
                                      ri.data(), po.data(), nullptr);
  else
    cuda::moe_group_by_expert(ids.data(), rows, top_k, local, se.data(), so.data(), ri.data(),
                              po.data(), nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> row_index = cuda::to_host<int32_t>(ri);
  row_index.resize(grouped);
  return {cuda::to_host<int32_t>(se), cuda::to_host<int32_t>(so), row_index,
          cuda::to_host<int32_t>(po)};
}

TEST(CudaMoeDispatch, CompactMatchesReference) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int top_k = 16;
  // (router experts, local range): every expert held, and an EP16 rank's 56 of 896.
  struct Case {
    int total;
    cuda::LocalExperts local;
  };
  for (const Case c : {Case{56, {0, 56}}, Case{896, {0, 896}}, Case{896, {112, 56}}}) {
    const int E = c.total;
    for (const int64_t rows : {int64_t{1}, int64_t{8}, int64_t{64}}) {
      for (const bool skewed : {false, true}) {
        const std::string what = "E " + std::to_string(E) + " local [" +
                                 std::to_string(c.local.begin) + ", +" +
                                 std::to_string(c.local.count) + ") rows " + std::to_string(rows) +
                                 (skewed ? " skewed" : " uniform");
        SCOPED_TRACE(what);
        // Per row, top_k distinct experts (as the router's top-k); skewed draws them from a
        // pool of 2 * top_k experts scattered over [0, E), so rows share experts heavily.
        std::vector<int> pool(static_cast<size_t>(E));
        std::iota(pool.begin(), pool.end(), 0);
        for (int i = E - 1; i > 0; --i)
          std::swap(pool[static_cast<size_t>(i)],
                    pool[rng.next_u64() % static_cast<uint64_t>(i + 1)]);
        const int span = skewed ? std::min(E, 2 * top_k) : E;
        std::vector<int32_t> ids;
        for (int64_t r = 0; r < rows; ++r) {
          std::vector<int> cand(pool.begin(), pool.begin() + span);
          for (int j = 0; j < top_k; ++j) {  // partial Fisher-Yates: top_k distinct
            const int pick = j + static_cast<int>(rng.next_u64() % static_cast<uint64_t>(span - j));
            std::swap(cand[static_cast<size_t>(j)], cand[static_cast<size_t>(pick)]);
            ids.push_back(cand[static_cast<size_t>(j)]);
          }
        }
        const auto dids = cuda::to_device<int32_t>(ids);
        const int b = c.local.begin, L = c.local.count;
        const Grouping ref = group_reference(ids, top_k, b, L, true);
        const Grouping ref_full = group_reference(ids, top_k, b, L, false);
        const size_t grouped = ref.row_index.size();
        const Grouping got = group_device(dids, rows, top_k, c.local, true, grouped);
        const Grouping full = group_device(dids, rows, top_k, c.local, false, grouped);

        EXPECT_EQ(got.slot_expert, ref.slot_expert) << "compact slot_expert";
        EXPECT_EQ(got.slot_offsets, ref.slot_offsets) << "compact slot_offsets";
        EXPECT_EQ(got.row_index, ref.row_index) << "compact row_index";
        EXPECT_EQ(got.position, ref.position) << "compact position";
        EXPECT_EQ(full.slot_expert, ref_full.slot_expert) << "stock slot_expert";
        EXPECT_EQ(full.slot_offsets, ref_full.slot_offsets) << "stock slot_offsets";
        EXPECT_EQ(got.row_index, full.row_index) << "row_index differs from the stock grouping";
        EXPECT_EQ(got.position, full.position) << "position differs from the stock grouping";

        // The slots the grouped GEMM is launched over cover every grouped pair; the rest are
        // empty.
        const int n = static_cast<int>(ids.size());
        const int slots = std::min(L, n);
        int active = 0;
        while (active < L && got.slot_expert[static_cast<size_t>(active)] >= 0) ++active;
        EXPECT_LE(active, slots);
        EXPECT_EQ(got.slot_offsets[static_cast<size_t>(slots)], static_cast<int>(grouped));
        for (int s = active; s < L; ++s) EXPECT_EQ(got.slot_expert[static_cast<size_t>(s)], -1);
        if (L < E) EXPECT_LT(grouped, ids.size()) << "some pairs should be another rank's";
      }
    }
  }
}

// router_topk_grouped equals router_topk then moe_group_by_expert_compact, every output bit for
// bit, over repeated launches on one counter (each launch must leave it zero for the next),
// with fresh logits per launch so a stale grouping cannot pass; the grouped launch by either
// select against the radix select's router_topk, so the two selects agree too.
TEST(CudaMoeDispatch, RouterGroupingEqualsTopkThenGrouping) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const int E = 896, top_k = 16;
  cuda::RouterPlan plan;
  plan.num_experts = E;
  plan.top_k = top_k;
  std::vector<float> bias(static_cast<size_t>(E));
  for (float& b : bias) b = 0.05f * rng.normal();
  const auto d_bias = cuda::to_device<float>(bias);
  DeviceBuffer<int32_t> done(1);
  done.fill_bytes(0);
  for (const cuda::LocalExperts local : {cuda::LocalExperts{112, 56}, cuda::LocalExperts{0, E}}) {
    const size_t LE = static_cast<size_t>(local.count);
    for (const int64_t rows : {int64_t{1}, int64_t{3}, int64_t{32}}) {
      SCOPED_TRACE("local [" + std::to_string(local.begin) + ", +" + std::to_string(local.count) +
                   ") rows " + std::to_string(rows));
      const size_t n = static_cast<size_t>(rows * top_k);
      DeviceBuffer<int32_t> ids0(n), ids1(n), se0(LE), se1(LE), so0(LE + 1), so1(LE + 1), ri0(n),
          ri1(n), po0(n), po1(n);
      DeviceBuffer<float> w0(n), w1(n);
      for (int launch = 0; launch < 4; ++launch) {
        std::vector<float> logits(static_cast<size_t>(rows) * E);
        for (float& v : logits) v = 2.0f * rng.normal();
        const auto d_logits = cuda::to_device<float>(logits);
        for (auto* b : {&ids0, &ids1, &se0, &se1, &so0, &so1, &ri0, &ri1, &po0, &po1})
          b->fill_bytes(0x7f);
        plan.merge_tree = false;
        cuda::router_topk(plan, d_logits.data(), d_bias.data(), rows, ids0.data(), w0.data(),
                          nullptr);
        plan.merge_tree = launch % 2 == 1;
        cuda::moe_group_by_expert_compact(ids0.data(), rows, top_k, local, se0.data(), so0.data(),
                                          ri0.data(), po0.data(), nullptr);
        cuda::RouterGrouping g;
        g.local = local;
        g.slot_expert = se1.data();
        g.slot_offsets = so1.data();
        g.row_index = ri1.data();
        g.position = po1.data();
        g.done = done.data();
        cuda::router_topk_grouped(plan, d_logits.data(), d_bias.data(), rows, ids1.data(),
                                  w1.data(), g, nullptr);
        K3_CUDA_CHECK(cudaDeviceSynchronize());
        SCOPED_TRACE(plan.merge_tree ? "grouped by the merge tree" : "grouped by the radix select");
        EXPECT_EQ(cuda::to_host<int32_t>(ids1), cuda::to_host<int32_t>(ids0)) << "ids";
        EXPECT_EQ(cuda::to_host<float>(w1), cuda::to_host<float>(w0)) << "weights";
        EXPECT_EQ(cuda::to_host<int32_t>(se1), cuda::to_host<int32_t>(se0)) << "slot_expert";
        const std::vector<int32_t> offsets = cuda::to_host<int32_t>(so0);
        EXPECT_EQ(cuda::to_host<int32_t>(so1), offsets) << "slot_offsets";
        EXPECT_EQ(cuda::to_host<int32_t>(po1), cuda::to_host<int32_t>(po0)) << "position";
        std::vector<int32_t> r0 = cuda::to_host<int32_t>(ri0), r1 = cuda::to_host<int32_t>(ri1);
        const size_t grouped = static_cast<size_t>(offsets[LE]);  // written positions only
        r0.resize(grouped);
        r1.resize(grouped);
        EXPECT_EQ(r1, r0) << "row_index";
        EXPECT_EQ(cuda::to_host<int32_t>(done)[0], 0) << "the counter must be left at zero";
      }
    }
  }
  const cuda::RouterGrouping none;
  DeviceBuffer<float> logits(static_cast<size_t>(33) * E);
  DeviceBuffer<int32_t> ids(33 * top_k);
  DeviceBuffer<float> w(33 * top_k);
  EXPECT_THROW(cuda::router_topk_grouped(plan, logits.data(), nullptr, 33, ids.data(), w.data(),
                                         none, nullptr),
               Error)
      << "33 x 16 pairs are above the fused grouping's 512";
}

}  // namespace
}  // namespace k3
