// Steps with runs: consecutive rows of one slot are that request's next tokens in order (a
// prefill chunk, a verify's q positions), all in one step. On every tiny preset (KDA, MLA with
// and without the DSA indexer, Kimi-Linear) a step of runs gives each token's logits as feeding
// the tokens one step at a time does (to the batched-rows bound: other GEMM plans; bit for bit
// with batch-invariant plans), leaves each slot at the same position, and decodes on from there
// alike, on both paths. Snapshots beyond those reserved and runs past the context are refused.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backbone_test_util.h"
#include "core/error.h"
#include "cuda/backbone.h"

namespace k3 {
namespace {

// Slot 0 takes 5 tokens, slot 1 one, slot 2 three.
const std::vector<int32_t> kSlots = {0, 0, 0, 0, 0, 1, 2, 2, 2};
constexpr int kRuns = 3;

void check_runs(const std::string& preset, cuda::StepPath path, bool exact) {
  SCOPED_TRACE(preset + (path == cuda::StepPath::Specialized ? " specialized" : " stock") +
               (exact ? " batch-invariant" : ""));
  const BatchInvariantScope invariant(exact);
  const LoadedModel& m = tiny_model(preset);
  const size_t V = static_cast<size_t>(m.config.vocab_size);
  const int R = static_cast<int>(kSlots.size());
  cuda::CudaBackboneOptions o = options(R, true);
  o.pool.slots = kRuns;
  o.capture_sizes = {1, 2, 3, R};
  cuda::CudaBackbone runs(m.config, m.weights, o);
  cuda::CudaBackbone single(m.config, m.weights, o);
  runs.reserve_snapshots(4);
  const std::vector<int64_t> prompt = random_prompt(m.config, 77, kSlots.size());
  std::vector<int32_t> toks(prompt.begin(), prompt.end());
  runs.step(kSlots, toks, path, /*keep_kda_states=*/true);
  std::vector<float> run_logits(V * R);
  runs.logits_to_host(R, run_logits.data());

  // Token t of each run, one step per t.
  std::vector<float> l(V * kRuns);
  for (int t = 0; t < 5; ++t) {
    std::vector<int32_t> s, tk;
    std::vector<int> row;
    for (int r = 0, off = 0; r < R; ++r) {
      off = (r > 0 && kSlots[r - 1] == kSlots[r]) ? off + 1 : 0;
      if (off != t) continue;
      s.push_back(kSlots[r]);
      tk.push_back(toks[r]);
      row.push_back(r);
    }
    single.step(s, tk, path);
    single.logits_to_host(static_cast<int64_t>(s.size()), l.data());
    for (size_t i = 0; i < s.size(); ++i)
      expect_rows_match({run_logits.begin() + row[i] * V, run_logits.begin() + (row[i] + 1) * V},
                        {l.begin() + i * V, l.begin() + (i + 1) * V}, exact,
                        "row " + std::to_string(row[i]));
  }
  for (int s = 0; s < kRuns; ++s) EXPECT_EQ(runs.position(s), single.position(s)) << "slot " << s;
  EXPECT_EQ(runs.position(0), 5);

  // Both decode on from the same positions and states.
  const std::vector<int32_t> all = {0, 1, 2}, next = {3, 5, 7};
  std::vector<float> a(V * kRuns), b(V * kRuns);
  for (int i = 0; i < 3; ++i) {
    runs.step(all, next, path);
    single.step(all, next, path);
    runs.logits_to_host(kRuns, a.data());
    single.logits_to_host(kRuns, b.data());
  }
  for (int s = 0; s < kRuns; ++s)
    expect_rows_match({a.begin() + s * V, a.begin() + (s + 1) * V},
                      {b.begin() + s * V, b.begin() + (s + 1) * V}, exact,
                      "decoding on, slot " + std::to_string(s));
}

TEST(CudaRuns, StepOfRunsEqualsTokenByTokenStock) {
  for (const char* preset : {"tiny", "tiny-k3.1", "tiny-kimi-linear"})
    check_runs(preset, cuda::StepPath::Stock, false);
}
TEST(CudaRuns, StepOfRunsEqualsTokenByTokenSpecialized) {
  for (const char* preset : {"tiny", "tiny-k3.1", "tiny-kimi-linear"})
    check_runs(preset, cuda::StepPath::Specialized, false);
}
// With batch-invariant GEMM plans a token's row computes the same bits whatever rows are beside
// it, so the run step equals the token-by-token steps exactly.
TEST(CudaRuns, BatchInvariantRunsAreBitIdentical) {
  for (const char* preset : {"tiny", "tiny-k3.1", "tiny-kimi-linear"})
    for (const auto path : {cuda::StepPath::Stock, cuda::StepPath::Specialized})
      check_runs(preset, path, true);
}

// (Split runs are refused in CudaBackbone.RefusesBadSteps.)
TEST(CudaRuns, RefusesMissingSnapshotsAndRunsPastTheContext) {
  const LoadedModel& m = tiny_model("tiny");
  cuda::CudaBackboneOptions o = options(4, false);
  cuda::CudaBackbone g(m.config, m.weights, o);
  const std::vector<int32_t> run = {0, 0, 0}, toks = {1, 2, 3};
  EXPECT_THROW(g.step(run, toks, cuda::StepPath::Stock, /*keep_kda_states=*/true), Error)
      << "no snapshots reserved";
  g.reserve_snapshots(2);
  g.step(run, toks, cuda::StepPath::Stock, true);
  EXPECT_EQ(g.position(0), 3);
  cuda::CudaBackboneOptions small = options(4, false, /*context=*/4);
  cuda::CudaBackbone h(m.config, m.weights, small);
  h.step(run, toks);  // 3 of 4 tokens
  EXPECT_THROW(h.step({run.data(), 2}, {toks.data(), 2}), Error) << "run past the context";
}

}  // namespace
}  // namespace k3
