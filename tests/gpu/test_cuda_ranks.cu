// The multi-rank CUDA step (cuda/rank_group.h) against the single-rank CUDA backbone on the
// synthesized tiny checkpoints: every layout (TP, EP, DEP with uneven replicas, DCP and their
// mixes), both step paths, ranks as threads sharing this GPU with host-staged collectives.
//
// Standards. Layouts whose ranks compute each row exactly as the single rank does (data-parallel
// attention, expert parallelism: a pair's output is rounded on its owner and summed with zeros)
// must give the single rank's logits bit for bit under batch-invariant GEMM plans (the replicas'
// and the gathered expert rows' counts differ from the single rank's). TP and DCP sum fp32
// partials in another order (all-reduce, log-sum-exp merge): a flipped bf16 rounding is
// amplified by these random models, so they are held to the bf16 noise floor as the other GPU
// tests are: mean rel L2 of the logits within 1.5x the fp32-vs-bf16 CPU distance on the same
// tokens (or 2% outright).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "backbone_test_util.h"
#include "core/error.h"
#include "cpu/backbone.h"
#include "cpu/ops_moe.h"
#include "cpu/sampling.h"
#include "cuda/backbone.h"
#include "cuda/cuda_step_backend.h"
#include "cuda/linear_plan.h"
#include "cuda/rank_group.h"
#include "parallel/layout.h"
#include "run_command.h"
#include "runtime/deploy_config.h"
#include "serve/backend_generate.h"
#include "spec/drafter.h"
#include "spec/spec_generate.h"
#include "spec_test_models.h"
#include "synth/presets.h"
#include "synth/synthesize.h"
#include "test_util.h"

namespace k3 {
namespace {

using cuda::StepPath;
using parallel::ParallelLayout;

constexpr double kNoiseSlack = 1.5;
constexpr double kNoiseAbs = 0.02;
constexpr int kSteps = 24;

ParallelLayout layout(int tp, int dp, bool ep, int dcp = 1) {
  ParallelLayout l;
  l.tp = tp;
  l.dp = dp;
  l.ep = ep;
  l.dcp = dcp;
  return l;
}

std::string name(const ParallelLayout& l) {
  return "tp" + std::to_string(l.tp) + " dp" + std::to_string(l.dp) + (l.ep ? " ep" : "") +
         (l.dcp > 1 ? " dcp" + std::to_string(l.dcp) : "");
}

// Measured GEMM plans off for the test (the multi-rank backbone turns them off; the single rank
// must pick the same plans), restored after.
struct TuningOffScope {
  bool was = cuda::linear_tuning();
  TuningOffScope() { cuda::set_linear_tuning(false); }
  ~TuningOffScope() { cuda::set_linear_tuning(was); }
};

// `requests` requests teacher-forced for kSteps steps on the single rank and on the layout's
// ranks (request i on replica i % dp), one step of every request at a time.
void check_layout(const std::string& preset, const ParallelLayout& lo, int requests, StepPath path,
                  bool exact) {
  SCOPED_TRACE(preset + " " + name(lo) + (path == StepPath::Specialized ? " specialized" : ""));
  TuningOffScope tuning;
  BatchInvariantScope invariant(exact);
  const LoadedModel& m = tiny_model(preset);
  const ModelConfig& cfg = m.config;
  cuda::CudaBackboneOptions o = options(requests, /*graphs=*/false);
  o.capture_sizes = {requests};
  cuda::CudaBackbone single(cfg, m.weights, o);
  cuda::RankedOptions ro;
  ro.layout = lo;
  ro.backbone = o;
  ro.backbone.pool.slots = (requests + lo.dp - 1) / lo.dp;
  cuda::RankedBackbone ranks(cfg, m.weights, ro);
  ASSERT_EQ(ranks.slots(), lo.dp * ro.backbone.pool.slots);

  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  const size_t V = static_cast<size_t>(cfg.vocab_size), n = static_cast<size_t>(requests);
  std::vector<std::vector<int64_t>> tokens;
  for (size_t i = 0; i < n; ++i) tokens.push_back(random_prompt(cfg, seed + i, 6));
  std::vector<int32_t> single_slots, rank_slots;
  for (int i = 0; i < requests; ++i) {
    single_slots.push_back(i);
    rank_slots.push_back((i % lo.dp) * ro.backbone.pool.slots + i / lo.dp);
  }
  // The noise floor on every request's tokens, averaged as the distance is: one request's
  // fp32-vs-bf16 distance alone swings with where its first routing flip falls (one 24-step
  // request measured 0.078 against a noise of 0.235 on one seed, 0.334 against 0.164 on another).
  const cpu::CpuBackbone ref = bf16_reference(m), ref32 = fp32_reference(m);
  std::vector<cpu::DecodeState> st, st32;
  for (size_t i = 0; i < n; ++i) {
    st.push_back(ref.new_state());
    st32.push_back(ref32.new_state());
  }
  std::vector<float> want(n * V), got(n * V), cpu16(V), cpu32(V);
  std::vector<int64_t> rows(n);
  std::vector<float*> outs(n);
  for (size_t i = 0; i < n; ++i) {
    rows[i] = static_cast<int64_t>(i);
    outs[i] = got.data() + i * V;
  }
  double dist = 0, noise = 0;
  int identical = 0;
  const cpu::RouterMarginProbe probe;  // router margins of both CPU runs
  std::ostringstream per_step;         // "step: rank-vs-single / fp32-vs-bf16", shown on failure
  for (int t = 0; t < kSteps; ++t) {
    std::vector<int32_t> toks;
    for (size_t i = 0; i < n; ++i) toks.push_back(static_cast<int32_t>(tokens[i][t]));
    single.step(single_slots, toks, path);
    single.logits_to_host(requests, want.data());
    ranks.step(rank_slots, toks, path);
    ranks.logits_rows_to_host(rows, outs);
    double step_noise = 0, step_dist = 0;
    for (size_t i = 0; i < n; ++i) {
      ref.step(st[i], tokens[i][t], cpu16.data());
      ref32.step(st32[i], tokens[i][t], cpu32.data());
      step_noise += rel_l2(cpu32, cpu16) / static_cast<double>(n);
    }
    noise += step_noise;
    for (size_t i = 0; i < n; ++i) {
      const std::vector<float> g(got.begin() + i * V, got.begin() + (i + 1) * V);
      const std::vector<float> w(want.begin() + i * V, want.begin() + (i + 1) * V);
      for (float v : g) ASSERT_TRUE(std::isfinite(v)) << "step " << t << " request " << i;
      step_dist += rel_l2(g, w) / static_cast<double>(n);
      identical += g == w;
      if (exact)
        ASSERT_TRUE(g == w) << "step " << t << " request " << i << ": rel L2 " << rel_l2(g, w);
      if (t + 1 >= static_cast<int>(tokens[i].size()))
        tokens[i].push_back(cpu::argmax(w.data(), cfg.vocab_size));
    }
    dist += step_dist;
    per_step << ' ' << t << ": " << std::setprecision(2) << step_dist << " / " << step_noise;
  }
  std::printf(
      "  %s %s%s, %d requests x %d steps: vs single rank rel L2 %.2e mean, %d/%d rows "
      "bit-identical; fp32 vs bf16 CPU %.2e; smallest router margin %.1e\n",
      preset.c_str(), name(lo).c_str(), path == StepPath::Specialized ? " specialized" : "",
      requests, kSteps, dist / kSteps, identical, requests * kSteps, noise / kSteps,
      static_cast<double>(probe.min_margin()));
  EXPECT_LE(dist, std::max(kNoiseSlack * noise, kNoiseAbs * kSteps))
      << "per step (rank vs single rank / fp32 vs bf16 CPU):" << per_step.str();
}

TEST(CudaRanks, DataParallelExpertParallelIsBitIdenticalTiny) {
  for (const StepPath p : {StepPath::Stock, StepPath::Specialized})
    check_layout("tiny", layout(1, 2, true), 3, p, /*exact=*/true);  // uneven replicas: padded
}

TEST(CudaRanks, DataParallelExpertParallelIsBitIdenticalTinyKimiLinear) {
  for (const StepPath p : {StepPath::Stock, StepPath::Specialized})
    check_layout("tiny-kimi-linear", layout(1, 2, true), 2, p, /*exact=*/true);
}

TEST(CudaRanks, DataParallelWithoutExpertParallelIsBitIdentical) {
  check_layout("tiny", layout(1, 2, false), 3, StepPath::Specialized, /*exact=*/true);
}

TEST(CudaRanks, TensorParallelSlicedExpertsWithinNoiseFloor) {
  for (const StepPath p : {StepPath::Stock, StepPath::Specialized})
    check_layout("tiny", layout(2, 1, false), 2, p, /*exact=*/false);
}

TEST(CudaRanks, TensorAndExpertParallelWithinNoiseFloor) {
  for (const StepPath p : {StepPath::Stock, StepPath::Specialized}) {
    check_layout("tiny", layout(2, 1, true), 2, p, /*exact=*/false);
    check_layout("tiny", layout(4, 1, true), 3, p, /*exact=*/false);
  }
  check_layout("tiny-k3.1", layout(2, 1, true), 2, StepPath::Specialized, /*exact=*/false);
  check_layout("tiny-kimi-linear", layout(2, 1, true), 2, StepPath::Stock, /*exact=*/false);
}

TEST(CudaRanks, DecodeContextParallelWithinNoiseFloor) {
  for (const StepPath p : {StepPath::Stock, StepPath::Specialized})
    check_layout("tiny", layout(2, 1, true, 2), 2, p, /*exact=*/false);
  check_layout("tiny-kimi-linear", layout(2, 1, false, 2), 1, StepPath::Stock, /*exact=*/false);
}

TEST(CudaRanks, TwoReplicasOfTwoTensorRanksWithinNoiseFloor) {
  check_layout("tiny", layout(2, 2, true), 3, StepPath::Specialized, /*exact=*/false);
}

TEST(CudaRanks, RefusesLayoutsItCannotRun) {
  const LoadedModel& k31 = tiny_model("tiny-k3.1");
  cuda::RankedOptions ro;
  ro.backbone = options(1, false);
  ro.layout = layout(2, 1, false, 2);  // DCP with the DSA indexer
  EXPECT_THROW(cuda::RankedBackbone(k31.config, k31.weights, ro), Error);
  const LoadedModel& tiny = tiny_model("tiny");
  ro.layout = layout(4, 1, false);  // MXFP4 experts sliced into 16 columns: not whole blocks
  try {
    cuda::RankedBackbone(tiny.config, tiny.weights, ro);
    ADD_FAILURE() << "tp 4 without EP on MXFP4 experts of width 64 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("enable_expert_parallel"), std::string::npos) << e.what();
  }
  ro.layout = layout(3, 1, false);  // heads not divisible
  EXPECT_THROW(cuda::RankedBackbone(tiny.config, tiny.weights, ro), Error);
}

TEST(CudaRanks, StepChecksAndSlotCommands) {
  TuningOffScope tuning;
  const LoadedModel& m = tiny_model("tiny");
  cuda::RankedOptions ro;
  ro.layout = layout(1, 2, true);
  ro.backbone = options(2, false);
  ro.backbone.pool.slots = 1;
  cuda::RankedBackbone ranks(m.config, m.weights, ro);
  const std::vector<int32_t> bad_slot = {5}, tok = {1}, split = {0, 1, 0}, toks3 = {1, 2, 3};
  EXPECT_THROW(ranks.step(bad_slot, tok), Error);
  EXPECT_THROW(ranks.step(split, toks3), Error);  // slot 0's rows not consecutive (and too many)
  const std::vector<int32_t> big = {static_cast<int32_t>(m.config.vocab_size)}, s1 = {1};
  EXPECT_THROW(ranks.step(s1, big), Error);
  // Still usable after refused calls; positions advance per run, reset and set_position work.
  const std::vector<int32_t> both = {1, 0}, toks = {3, 4};
  ranks.step(both, toks);
  ranks.step(both, toks);
  EXPECT_EQ(ranks.position(0), 2);
  EXPECT_EQ(ranks.position(1), 2);
  ranks.set_position(1, 1);
  EXPECT_EQ(ranks.position(1), 1);
  ranks.reset_slot(0);
  EXPECT_EQ(ranks.position(0), 0);
  std::vector<float> hidden(2 * static_cast<size_t>(m.config.hidden_size));
  ranks.step(both, toks);
  ranks.hidden_to_host(2, hidden.data());
  for (float v : hidden) ASSERT_TRUE(std::isfinite(v));
}

// Drafts the known greedy continuation (plain generation's tokens), wrong from the third draft
// on every other step: verify steps then accept 2 and 3 drafts alternately, so commits keep a
// partial run (a restored KDA snapshot) as well as a whole one.
class KnownContinuation final : public spec::Drafter {
 public:
  KnownContinuation(std::vector<int64_t> continuation, size_t prompt, int64_t vocab)
      : cont_(std::move(continuation)), prompt_(prompt), vocab_(vocab) {}
  spec::DraftTokens propose(std::span<const int64_t> context, int n) override {
    spec::DraftTokens d;
    const size_t at = context.size() - prompt_;  // tokens generated so far
    for (int i = 0; i < n && at + i < cont_.size(); ++i) {
      const int64_t t = cont_[at + i];
      d.tokens.push_back(i == 2 && calls_ % 2 == 0 ? (t + 1) % vocab_ : t);
    }
    ++calls_;
    return d;
  }

 private:
  std::vector<int64_t> cont_;
  size_t prompt_;
  int64_t vocab_;
  int calls_ = 0;
};

// The serving backend over the ranks (`k3 serve --tensor-parallel-size ...` on the GPU): plain
// greedy generation equals the single-rank backend's for DEP, and speculative verify + commit
// (q runs, KDA snapshots on every rank, the idle replica padding a verify step) gives plain
// greedy's tokens, bit for bit with batch-invariant plans.
TEST(CudaRanks, ServingBackendRunsLayoutsWithSpeculativeVerify) {
  const BatchInvariantScope invariant(true);
  TuningOffScope tuning;
  const LoadedModel& m = tiny_model("tiny");
  cpu::GenerateRequest req;
  req.prompt = test::repetitive_prompt(7, 4, 4);
  req.max_new_tokens = 24;
  req.ignore_eos = true;
  const auto backend = [&](int tp, int dp, bool ep, int spec) {
    DeployConfig d;
    d.max_num_seqs = 2;
    d.max_model_len = 256;
    d.tensor_parallel_size = tp;
    d.data_parallel_size = dp;
    d.enable_expert_parallel = ep;
    if (spec > 0) {
      d.speculative_config.method = "ngram";
      d.speculative_config.num_speculative_tokens = spec;
    }
    return cuda::make_cuda_step_backend(LoadedModel::load(m.dir), d);
  };
  const cpu::GenerateResult single = serve::generate_on(*backend(1, 1, false, 0), req);
  for (const auto& [tp, dp] : {std::pair{2, 1}, std::pair{1, 2}}) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " dp " + std::to_string(dp));
    auto b = backend(tp, dp, true, 3);
    const cpu::GenerateResult plain = serve::generate_on(*b, req);
    if (tp == 1) EXPECT_EQ(plain.tokens, single.tokens);  // DEP: the single rank's rows
    KnownContinuation drafter(plain.tokens, req.prompt.size(), m.config.vocab_size);
    const spec::SpecGenerateResult r = serve::speculative_generate_on(*b, req, drafter, 3);
    EXPECT_EQ(r.result.tokens, plain.tokens);
    EXPECT_GT(r.stats.accepted, r.stats.steps);         // more than one draft accepted per step
    EXPECT_LT(r.stats.accepted, r.stats.draft_tokens);  // and some rejected
  }
}

// ---- processes: `k3 generate` under a multi-process launch ----

std::string k3_binary() {
  // k3 is built (and bundled) beside this test binary.
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "k3").string();
}

std::string synth_dir(const std::string& preset) {
  const auto dir = test::temp_dir("ranks_" + preset);
  SynthOptions so;
  so.seed = 11;
  synthesize_checkpoint(synth_preset(preset), dir.string(), so);
  return dir.string();
}

// `k3 generate` greedy ids on `ranks` processes (host-staged collectives: they share this GPU),
// or in one process when ranks == 0.
test::CommandResult generate(const std::string& dir, const std::string& flags, int ranks,
                             int port) {
  const std::string args = " generate --device cuda --show-ids --ignore-eos --max-tokens 12 " +
                           std::string("--prompt-ids 5,9,33,2,17,80 --model ") + dir + " " + flags;
  if (ranks == 0) return test::run_command(k3_binary() + args);
  std::string cmd = "export K3_WORLD_SIZE=" + std::to_string(ranks) +
                    " K3_MASTER_ADDR=127.0.0.1 K3_MASTER_PORT=" + std::to_string(port) +
                    " K3_RANK_COMM=host; ";
  for (int r = ranks - 1; r >= 1; --r)
    cmd += "K3_RANK=" + std::to_string(r) + " K3_LOCAL_RANK=" + std::to_string(r) + " " +
           k3_binary() + args + " >/dev/null 2>&1 & ";
  cmd += "K3_RANK=0 K3_LOCAL_RANK=0 " + k3_binary() + args + "; rc=$?; wait; exit $rc";
  return test::run_command(cmd);
}

// The ids generate prints: the leading digits and spaces of the first line that starts with a
// digit (stderr may follow on the same line).
std::string ids_of(const std::string& out) {
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && std::isdigit(static_cast<unsigned char>(line[0])))
      return line.substr(0, line.find_first_not_of("0123456789 "));
  return "";
}

TEST(CudaRanks, ProcessesGiveTheThreadsTokens) {
  if (test::run_command(k3_binary() + " --help").status != 0)
    GTEST_SKIP() << k3_binary() << " does not run here (not built beside the tests?)";
  const std::string dir = synth_dir("tiny");
  const int port = 29700 + static_cast<int>(::getpid() % 200);
  int run = 0;
  for (const std::string flags : {"--tp 2", "--tp 2 --ep --dcp 2", "--dp 2 --ep"}) {
    SCOPED_TRACE(flags);
    const auto threads = generate(dir, flags, 0, port);
    ASSERT_EQ(threads.status, 0) << threads.output;
    const auto procs = generate(dir, flags, 2, port + run++);  // a fresh port per launch
    ASSERT_EQ(procs.status, 0) << procs.output;
    ASSERT_FALSE(ids_of(threads.output).empty()) << threads.output;
    // Same layout, same plans, collectives summed in rank order either way: the same bits.
    EXPECT_EQ(ids_of(procs.output), ids_of(threads.output)) << procs.output;
  }
  // DEP under batch-invariant plans is the single rank's computation row for row.
  const auto single = test::run_command("K3_BATCH_INVARIANT=1 " + k3_binary() +
                                        " generate --device cuda --show-ids --ignore-eos "
                                        "--max-tokens 12 --prompt-ids 5,9,33,2,17,80 --model " +
                                        dir);
  ASSERT_EQ(single.status, 0) << single.output;
  ::setenv("K3_BATCH_INVARIANT", "1", 1);
  const auto dep = generate(dir, "--dp 2 --ep", 2, port + run);
  ::unsetenv("K3_BATCH_INVARIANT");
  ASSERT_EQ(dep.status, 0) << dep.output;
  EXPECT_EQ(ids_of(dep.output), ids_of(single.output)) << dep.output;
}

}  // namespace
}  // namespace k3
