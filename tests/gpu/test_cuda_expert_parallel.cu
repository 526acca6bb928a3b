// One expert-parallel rank's slice of the routed experts on the GPU (the k3_bench_step rank):
// the backbone holds experts [begin, begin + count) of the router's E, the others left empty as
// parallel::RankWeights leaves them, and runs alone with its collectives stubbed. Oracle: the
// CPU reference on the whole model with every other expert's weights zero (a zero expert adds
// exactly 0 to the routed sum), teacher-forced, on both step paths, to the bf16 noise floor; and
// the GPU step of that zeroed whole model, which must match the slice bit for bit under
// batch-invariant plans (the slice skips the pairs a zero expert would add 0 for).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <string>
#include <vector>

#include "backbone_test_util.h"
#include "core/error.h"
#include "cpu/backbone.h"
#include "cpu/sampling.h"
#include "cuda/backbone.h"
#include "test_util.h"

namespace k3 {
namespace {

using cuda::StepPath;

// Against the CPU: 2.5x the fp32-vs-bf16 distance on the same tokens (the other tests' 1.5x
// failed 3 of 8 seeds on tiny-kimi-linear, at this change and before it: ratios 0.06-2.34 seen,
// one routing near-tie over 40 steps is enough), or 2% outright. The exact GPU oracle above is
// the sharp check of the slice.
constexpr double kNoiseSlack = 2.5;
constexpr double kNoiseAbs = 0.02;  // as test_cuda_backbone.cu: a mean rel L2 always accepted
constexpr int kSteps = 40;

bool held(int e, int begin, int count) {
  return e >= begin && e < begin + count;
}

// The rank's weights: experts outside [begin, begin + count) empty.
ModelWeights ep_slice(const ModelWeights& w, int begin, int count) {
  ModelWeights r = w;
  for (LayerWeights& L : r.layers)
    for (size_t e = 0; e < L.moe_w.experts.size(); ++e)
      if (!held(static_cast<int>(e), begin, count)) L.moe_w.experts[e] = ExpertWeights{};
  return r;
}

// The oracle's weights: experts outside the range zero (storage kept in `keep`).
ModelWeights zero_outside(const ModelWeights& w, int begin, int count,
                          std::deque<std::vector<uint8_t>>& keep) {
  ModelWeights r = w;
  const auto zero = [&](WeightMatrix& m) {
    const uint64_t data = m.format == WeightFormat::MXFP4
                              ? static_cast<uint64_t>(m.rows * m.cols / 2)
                              : m.storage_bytes();
    m.data = keep.emplace_back(data, uint8_t{0}).data();  // +0 in bf16 / fp32 / e2m1
    if (m.format == WeightFormat::MXFP4)
      m.scales = keep.emplace_back(static_cast<size_t>(m.rows * m.cols / 32), uint8_t{127}).data();
  };
  for (LayerWeights& L : r.layers)
    for (size_t e = 0; e < L.moe_w.experts.size(); ++e)
      if (!held(static_cast<int>(e), begin, count))
        for (WeightMatrix* m :
             {&L.moe_w.experts[e].w1, &L.moe_w.experts[e].w3, &L.moe_w.experts[e].w2})
          zero(*m);
  return r;
}

void check_rank(const std::string& preset, int begin, int count) {
  const LoadedModel& m = tiny_model(preset);
  const ModelConfig& cfg = m.config;
  std::deque<std::vector<uint8_t>> keep;
  const ModelWeights oracle_w = zero_outside(m.weights, begin, count, keep);
  const cpu::CpuBackbone ref(cfg, oracle_w, {DType::BF16, DType::F32});
  cpu::Numerics fp32;
  fp32.bf16_activations = false;
  const cpu::CpuBackbone ref32(cfg, oracle_w, {DType::F32, DType::F32, cpu::LatentFormat::F32},
                               fp32);
  const ModelWeights rank_w = ep_slice(m.weights, begin, count);
  cuda::CudaBackboneOptions o = options(2, true);
  o.capture_sizes = {1};
  o.stub_collectives = true;
  const BatchInvariantScope invariant(true);
  cuda::CudaBackbone gpu(cfg, rank_w, o);
  cuda::CudaBackboneOptions wo = options(2, true);
  wo.capture_sizes = {1};
  cuda::CudaBackbone whole(cfg, oracle_w, wo);  // every expert, the others' weights zero

  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  cpu::DecodeState st = ref.new_state(), st32 = ref32.new_state();
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  std::vector<float> want(V), want32(V), stock(V), spec(V), whole_stock(V), whole_spec(V);
  std::vector<int64_t> tokens = random_prompt(cfg, seed, 6);
  double d_stock = 0, d_spec = 0, d_ref32 = 0;
  for (int i = 0; i < kSteps; ++i) {
    const int64_t t = tokens[static_cast<size_t>(i)];
    ref.step(st, t, want.data());
    ref32.step(st32, t, want32.data());
    const int32_t s0 = 0, s1 = 1, tok = static_cast<int32_t>(t);
    gpu.step({&s0, 1}, {&tok, 1}, StepPath::Stock);
    gpu.logits_to_host(1, stock.data());
    gpu.step({&s1, 1}, {&tok, 1}, StepPath::Specialized);
    gpu.logits_to_host(1, spec.data());
    whole.step({&s0, 1}, {&tok, 1}, StepPath::Stock);
    whole.logits_to_host(1, whole_stock.data());
    whole.step({&s1, 1}, {&tok, 1}, StepPath::Specialized);
    whole.logits_to_host(1, whole_spec.data());
    ASSERT_TRUE(stock == whole_stock) << "step " << i << ": slice vs zeroed whole model, stock";
    ASSERT_TRUE(spec == whole_spec) << "step " << i << ": slice vs zeroed whole model, specialized";
    for (size_t v = 0; v < V; ++v)
      ASSERT_TRUE(std::isfinite(stock[v]) && std::isfinite(spec[v])) << "step " << i;
    d_stock += rel_l2(stock, want);
    d_spec += rel_l2(spec, want);
    d_ref32 += rel_l2(want32, want);
    if (i + 1 >= static_cast<int>(tokens.size()))
      tokens.push_back(cpu::argmax(want.data(), cfg.vocab_size));
  }
  std::printf(
      "  %s, experts [%d, %d) of %d, %d steps: stock vs CPU rel L2 %.2e, specialized %.2e, fp32 "
      "CPU %.2e (mean)\n",
      preset.c_str(), begin, begin + count, static_cast<int>(cfg.num_experts), kSteps,
      d_stock / kSteps, d_spec / kSteps, d_ref32 / kSteps);
  const double bound = std::max(kNoiseSlack * d_ref32, kNoiseAbs * kSteps);
  EXPECT_LE(d_stock, bound) << preset << " stock";
  EXPECT_LE(d_spec, bound) << preset << " specialized";
}

TEST(CudaExpertParallel, RankSliceEqualsCpuWithOtherExpertsZeroTiny) {
  check_rank("tiny", 8, 8);  // EP2 rank 1 of 16 experts, MXFP4, latent MoE
}

TEST(CudaExpertParallel, RankSliceEqualsCpuWithOtherExpertsZeroTinyKimiLinear) {
  check_rank("tiny-kimi-linear", 2, 4);  // experts 2..5 of 8, bf16 experts, no latent
}

TEST(CudaExpertParallel, RefusesSlicesWithoutStubsAndNonContiguousSlices) {
  const LoadedModel& m = tiny_model("tiny");
  const ModelWeights slice = ep_slice(m.weights, 0, 8);
  EXPECT_THROW(cuda::CudaBackbone(m.config, slice, options(1, false)), Error);
  ModelWeights gap = m.weights;
  for (LayerWeights& L : gap.layers)
    if (L.moe) L.moe_w.experts[3] = ExpertWeights{};
  cuda::CudaBackboneOptions o = options(1, false);
  o.stub_collectives = true;
  EXPECT_THROW(cuda::CudaBackbone(m.config, gap, o), Error);
  ModelWeights partial = m.weights;
  for (LayerWeights& L : partial.layers)
    if (L.moe) L.moe_w.experts[5].w2 = WeightMatrix{};
  EXPECT_THROW(cuda::CudaBackbone(m.config, partial, o), Error);
}

}  // namespace
}  // namespace k3
