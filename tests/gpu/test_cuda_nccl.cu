// NcclCommunicator on the one GPU of the test machine: a world of one process (the TCP bootstrap
// with world 1 opens no socket), where every collective is an identity or a copy and must be
// exact. Multi-rank runs need one process per GPU: tools/launch_ranks.sh N build/k3_nccl_check.
// Inputs are fresh random values (seed printed; K3_TEST_SEED replays it); outputs are poisoned
// with NaN / -1 bytes before each collective, so every element must be written.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backbone_test_util.h"
#include "core/error.h"
#include "core/numeric.h"
#include "core/rng.h"
#include "cuda/backbone.h"
#include "cuda/device_buffer.h"
#include "cuda/linear_plan.h"
#include "cuda/nccl_communicator.h"
#include "parallel/tcp_bootstrap.h"
#include "test_util.h"

namespace k3 {
namespace {

// ---- Tolerances: none. With one rank a sum has one term and the data movers copy bits, so
// every comparison is bitwise. ----

using cuda::bf16;
using cuda::DeviceBuffer;
using cuda::DevType;

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// One communicator for the suite (ncclCommInitRank takes a while), destroyed before main returns.
class Nccl : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    parallel::BootstrapConfig cfg;
    cfg.master_addr = "127.0.0.1";
    cfg.world = 1;
    boot_ = new parallel::TcpBootstrap(cfg);
    int dev = 0;
    K3_CUDA_CHECK(cudaGetDevice(&dev));
    comm_ = new cuda::NcclCommunicator(*boot_, dev);
    K3_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  static void TearDownTestSuite() {
    K3_CUDA_CHECK(cudaStreamSynchronize(stream_));
    K3_CUDA_CHECK(cudaStreamDestroy(stream_));
    delete comm_;
    delete boot_;
    comm_ = nullptr;
    boot_ = nullptr;
  }
  void sync() { K3_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  static parallel::TcpBootstrap* boot_;
  static cuda::NcclCommunicator* comm_;
  static cudaStream_t stream_;
};
parallel::TcpBootstrap* Nccl::boot_ = nullptr;
cuda::NcclCommunicator* Nccl::comm_ = nullptr;
cudaStream_t Nccl::stream_ = nullptr;

TEST_F(Nccl, WorldOfOne) {
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->size(), 1);
  int dev = -1;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  EXPECT_EQ(comm_->device(), dev);
  // Set to 0 by the constructor unless the environment already had a value.
  EXPECT_NE(std::getenv("NCCL_NVLS_ENABLE"), nullptr);
}

TEST_F(Nccl, SizeOneCollectivesAreExactCopies) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  for (int64_t n : {int64_t{1}, int64_t{1001}, (int64_t{1} << 20) + 3}) {
    SCOPED_TRACE("n " + std::to_string(n));
    const std::vector<float> x = test::random_normal(rng, static_cast<size_t>(n));
    const std::vector<uint16_t> xb = test::random_bf16(rng, static_cast<size_t>(n));

    DeviceBuffer<float> d = cuda::to_device<float>(x);  // [n] fp32
    comm_->all_reduce_sum(d.data(), n, stream_);
    sync();
    EXPECT_TRUE(same_bits(cuda::to_host<float>(d), x)) << "all_reduce f32";

    DeviceBuffer<bf16> db = cuda::to_device<bf16>(xb);  // [n] bf16
    comm_->all_reduce_sum(db.data(), n, stream_);
    sync();
    EXPECT_TRUE(same_bits(cuda::to_host<uint16_t>(db), xb)) << "all_reduce bf16";

    DeviceBuffer<float> out(static_cast<size_t>(n));  // [world = 1, n] fp32
    out.fill_bytes(0xff, stream_);
    comm_->all_gather(d.data(), n, out.data(), stream_);
    sync();
    EXPECT_TRUE(same_bits(cuda::to_host<float>(out), x)) << "all_gather f32";

    DeviceBuffer<bf16> outb(static_cast<size_t>(n));  // [n] bf16
    outb.fill_bytes(0xff, stream_);
    const int64_t counts[1] = {n};
    comm_->all_to_all_v(db.data(), counts, outb.data(), counts, DevType::BF16, stream_);
    sync();
    EXPECT_TRUE(same_bits(cuda::to_host<uint16_t>(outb), xb)) << "all_to_all_v bf16";

    comm_->broadcast(d.data(), n, DevType::F32, 0, stream_);
    comm_->barrier(stream_);
    sync();
    EXPECT_TRUE(same_bits(cuda::to_host<float>(d), x)) << "broadcast f32";
  }
  // Zero sizes are legal and touch nothing.
  DeviceBuffer<int32_t> poison(4);  // [4] int32, stays -1
  poison.fill_bytes(0xff, stream_);
  const int64_t zero[1] = {0};
  comm_->all_reduce_sum(poison.data(), 0, DevType::I32, stream_);
  comm_->all_gather(poison.data(), 0, DevType::I32, poison.data(), stream_);
  comm_->all_to_all_v(poison.data(), zero, poison.data(), zero, DevType::I32, stream_);
  comm_->broadcast(poison.data(), 0, DevType::I32, 0, stream_);
  sync();
  EXPECT_EQ(cuda::to_host<int32_t>(poison), std::vector<int32_t>(4, -1));
}

// The collectives of one step captured in a CUDA graph and replayed on new inputs: they read
// nothing from the host at replay time, so the replay sees the new data.
TEST_F(Nccl, CapturedInAGraph) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  constexpr int64_t kN = 4096;
  DeviceBuffer<bf16> act(kN);      // [kN] bf16, all-reduced in place
  DeviceBuffer<int32_t> ids(kN);   // [kN] int32
  DeviceBuffer<int32_t> gath(kN);  // [world = 1, kN] int32
  DeviceBuffer<int32_t> recv(kN);  // [kN] int32
  const int64_t counts[1] = {kN};
  auto step = [&] {
    comm_->all_reduce_sum(act.data(), kN, stream_);
    comm_->all_gather(ids.data(), kN, gath.data(), stream_);
    comm_->all_to_all_v(ids.data(), counts, recv.data(), counts, DevType::I32, stream_);
    comm_->barrier(stream_);
  };
  act.fill_bytes(0, stream_);
  ids.fill_bytes(0, stream_);
  step();  // eager warm-up: NCCL may set up its connections on first use
  sync();

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  K3_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
  step();
  K3_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  K3_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    const std::vector<uint16_t> a = test::random_bf16(rng, kN);
    std::vector<int32_t> id(kN);
    for (auto& v : id) v = static_cast<int32_t>(rng.next_u64());
    cuda::copy_to_device(act, a.data(), a.size());
    cuda::copy_to_device(ids, id.data(), id.size());
    gath.fill_bytes(0xff, stream_);
    recv.fill_bytes(0xff, stream_);
    K3_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    sync();
    EXPECT_TRUE(same_bits(cuda::to_host<uint16_t>(act), a)) << "replay " << replay;
    EXPECT_EQ(cuda::to_host<int32_t>(gath), id) << "replay " << replay;
    EXPECT_EQ(cuda::to_host<int32_t>(recv), id) << "replay " << replay;
  }
  K3_CUDA_CHECK(cudaGraphExecDestroy(exec));
  K3_CUDA_CHECK(cudaGraphDestroy(graph));
}

TEST_F(Nccl, ReduceScatterAndSplit) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  constexpr int64_t kN = 1000;
  const std::vector<uint16_t> a = test::random_bf16(rng, kN);
  DeviceBuffer<bf16> in(kN), out(kN);  // [world = 1][kN] -> [kN] bf16
  cuda::copy_to_device(in, a.data(), a.size());
  out.fill_bytes(0xff, stream_);
  comm_->reduce_scatter_sum(in.data(), out.data(), kN, DevType::BF16, stream_);
  sync();
  EXPECT_TRUE(same_bits(cuda::to_host<uint16_t>(out), a));
  // The tp group of a one-replica layout: a split of the world with one color.
  const auto sub = comm_->split(/*color=*/0, /*key=*/0);
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(sub->rank(), 0);
  out.fill_bytes(0xff, stream_);
  sub->reduce_scatter_sum(in.data(), out.data(), kN, DevType::BF16, stream_);
  sync();
  EXPECT_TRUE(same_bits(cuda::to_host<uint16_t>(out), a));
  EXPECT_THROW(comm_->split(-1, 0), Error);
}

// One rank of an expert-parallel, tensor-parallel layout of one GPU: every collective of the
// step (TP sums, the EP gather and reduce-scatter) runs through NCCL inside the captured graphs
// (the specialized ones with programmatic edges that skip NCCL's nodes), and with one rank each
// is an identity, so the step must equal the plain single-rank step bit for bit.
TEST_F(Nccl, BackboneRankWithCollectivesInGraphsEqualsSingleRank) {
  const bool tuning = cuda::linear_tuning();
  cuda::set_linear_tuning(false);  // the same plans for both backbones
  for (const std::string preset : {"tiny", "tiny-kimi-linear"}) {
    SCOPED_TRACE(preset);
    const LoadedModel& m = tiny_model(preset);
    cuda::CudaBackboneOptions o = options(2, /*graphs=*/true);
    o.capture_sizes = {1, 2};
    cuda::CudaBackbone plain(m.config, m.weights, o);
    o.ranks.layout.ep = true;
    o.ranks.world = comm_;
    o.ranks.tp = comm_;
    cuda::CudaBackbone rank(m.config, m.weights, o);
    EXPECT_EQ(rank.graphs_captured(), 2) << "specialized graphs with NCCL nodes, at load";
    const size_t V = static_cast<size_t>(m.config.vocab_size);
    std::vector<float> a(2 * V), b(2 * V);
    const auto p0 = random_prompt(m.config, 3, 10), p1 = random_prompt(m.config, 4, 10);
    const std::vector<int32_t> slots = {0, 1};
    for (int i = 0; i < 10; ++i) {
      const std::vector<int32_t> toks = {static_cast<int32_t>(p0[i]), static_cast<int32_t>(p1[i])};
      const cuda::StepPath path = i % 2 ? cuda::StepPath::Specialized : cuda::StepPath::Stock;
      plain.step(slots, toks, path);
      rank.step(slots, toks, path);
      plain.logits_to_host(2, a.data());
      rank.logits_to_host(2, b.data());
      ASSERT_TRUE(a == b) << "step " << i << ": rel L2 " << rel_l2(b, a);
    }
    EXPECT_GE(rank.graphs_captured(), 3) << "the stock step was captured too";
  }
  cuda::set_linear_tuning(tuning);
}

TEST_F(Nccl, BadArgumentsRaise) {
  DeviceBuffer<float> d(8);  // [8] fp32
  EXPECT_THROW(comm_->broadcast(d.data(), 8, DevType::F32, 1, stream_), Error);
  EXPECT_THROW(comm_->all_reduce_sum(d.data(), -1, stream_), Error);
  const int64_t neg[1] = {-2};
  EXPECT_THROW(comm_->all_to_all_v(d.data(), neg, d.data(), neg, DevType::F32, stream_), Error);
  EXPECT_THROW(cuda::select_local_device(0, 1 << 20), Error);
  sync();
}

}  // namespace
}  // namespace k3
