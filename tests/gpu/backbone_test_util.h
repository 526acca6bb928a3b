// Helpers shared by the CUDA backbone tests: cached tiny synthetic models, random prompts,
// backbone options and logit distances.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "cpu/backbone.h"
#include "cuda/backbone.h"
#include "cuda/linear_plan.h"
#include "model/loaded_model.h"
#include "synth/presets.h"
#include "synth/synthesize.h"
#include "test_util.h"

namespace k3 {

inline const LoadedModel& tiny_model(const std::string& preset) {
  static std::map<std::string, std::unique_ptr<LoadedModel>> cache;
  auto& slot = cache[preset];
  if (!slot) {
    const auto dir = test::temp_dir("gpu_backbone_" + preset);
    SynthOptions so;
    so.seed = 7;
    synthesize_checkpoint(synth_preset(preset), dir.string(), so);
    slot = LoadedModel::load(dir.string());
  }
  return *slot;
}

// Rows of a batched step against the same rows alone: the batched GEMMs run other plans (other
// K splits: bf16 flips that the layers amplify), so they agree to rounding, not bits; a row
// mixed up with another or a wrong slot is O(1) off.
constexpr double kLogitRel = 0.02;      // relative L2 of a row's logits
constexpr double kBatchedMaxRel = 0.1;  // max |d| / rms of a row's logits

inline std::vector<int64_t> random_prompt(const ModelConfig& c, uint64_t seed, size_t n) {
  Rng r(seed);
  std::vector<int64_t> p;
  for (size_t i = 0; i < n; ++i)
    p.push_back(static_cast<int64_t>(r.next_u64() % static_cast<uint64_t>(c.vocab_size)));
  return p;
}

inline cuda::CudaBackboneOptions options(int rows, bool graphs, int64_t context = 256) {
  cuda::CudaBackboneOptions o;
  o.max_rows = rows;
  o.pool.slots = rows;
  o.pool.max_context = context;
  o.pool.page_size = 16;  // several pages per request, so the block table is exercised
  o.use_graphs = graphs;
  return o;
}

// The CPU references the GPU tests measure against: the bf16 one (the oracle) and the fp32 one,
// whose distance from the oracle on the same tokens is the model's bf16 noise floor.
inline cpu::CpuBackbone bf16_reference(const LoadedModel& m) {
  return cpu::CpuBackbone(m.config, m.weights, {DType::BF16, DType::F32});
}
inline cpu::CpuBackbone fp32_reference(const LoadedModel& m) {
  cpu::Numerics fp32;
  fp32.bf16_activations = false;
  return cpu::CpuBackbone(m.config, m.weights, {DType::F32, DType::F32, cpu::LatentFormat::F32},
                          fp32);
}

inline double rms(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s / static_cast<double>(v.size()));
}

inline double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(a[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Batch-invariant GEMM plans (cuda::set_batch_invariant) for a scope: set before the backbones
// of the test are built (their first steps pick the plans).
struct BatchInvariantScope {
  bool was;
  explicit BatchInvariantScope(bool on) : was(cuda::batch_invariant()) {
    cuda::set_batch_invariant(on);
  }
  ~BatchInvariantScope() { cuda::set_batch_invariant(was); }
  BatchInvariantScope(const BatchInvariantScope&) = delete;
  BatchInvariantScope& operator=(const BatchInvariantScope&) = delete;
};

// Rows computed beside others against the same rows alone: bit for bit with batch-invariant
// plans, else within the batched-rows bounds.
inline void expect_rows_match(const std::vector<float>& got, const std::vector<float>& want,
                              bool exact, const std::string& what);

// Expects `got` within the batched-vs-alone bounds of `want`.
inline void expect_batched_close(const std::vector<float>& got, const std::vector<float>& want,
                                 const std::string& what) {
  double worst = 0;
  const double r = rms(want);
  for (size_t v = 0; v < want.size(); ++v)
    worst = std::max(worst, std::fabs(static_cast<double>(got[v]) - want[v]) / r);
  EXPECT_LE(rel_l2(got, want), kLogitRel) << what;
  EXPECT_LE(worst, kBatchedMaxRel) << what;
}

inline void expect_rows_match(const std::vector<float>& got, const std::vector<float>& want,
                              bool exact, const std::string& what) {
  if (exact)
    EXPECT_TRUE(got == want) << what << ": not bit-identical (rel L2 " << rel_l2(got, want) << ")";
  else
    expect_batched_close(got, want, what);
}

}  // namespace k3
