// Multi-rank CPU layouts (src/parallel): the in-process communicator's collectives, then TP,
// EP, DEP and DCP decode runs on the synthesized tiny models against the single-rank backbone.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/rng.h"
#include "cpu/backbone.h"
#include "cpu/sampling.h"
#include "model/loaded_model.h"
#include "parallel/communicator.h"
#include "parallel/parallel_backbone.h"
#include "parallel/parallel_step_backend.h"
#include "run_command.h"
#include "runtime/deploy_config.h"
#include "serve/step_backend.h"
#include "synth/presets.h"
#include "synth/synthesize.h"
#include "test_util.h"

namespace k3 {
namespace {

using parallel::Communicator;
using parallel::InProcessGroup;
using parallel::ParallelCpuBackbone;
using parallel::ParallelLayout;

// Logit tolerance, relative to the largest |logit| of the single-rank step. TP and DCP change
// the fp32 summation order (o_proj / down partial sums, the log-sum-exp merge). The difference
// (~2^-24 relative) mostly vanishes in the bf16 rounding of the sublayer output, so most steps
// are bit-identical; when it flips one bf16 rounding (2^-8 relative) the change propagates, and
// the worst case seen on these runs is 8.5e-3. Selections are discontinuous: a flip next to a
// MoE or DSA top-k tie changes an expert / token and moves the logits by ~0.2 relative (seen with
// other prompts). The prompts below (fixed, like the synthetic model) have no such tie, so the
// greedy tokens must match exactly; a failure reports the top-2 gap and the logit difference.
constexpr double kLogitRelTol = 0.03;

// Runs fn(rank, comm) on n threads of one group; rethrows the first failure.
void on_ranks(int n, const std::function<void(int, Communicator&)>& fn) {
  InProcessGroup g(n);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r, g.comm(r));
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        g.abort();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

TEST(Communicator, CollectivesGiveIdenticalBitsOnEveryRank) {
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  for (int n = 1; n <= 4; ++n) {
    SCOPED_TRACE("ranks " + std::to_string(n));
    const int64_t len = 1000;
    // Inputs of every rank, drawn up front so the expected values are known here.
    std::vector<std::vector<float>> in;
    Rng rng(seed + static_cast<uint64_t>(n));
    for (int r = 0; r < n; ++r) in.push_back(test::random_normal(rng, len, 10.0f));
    std::vector<float> want_sum(static_cast<size_t>(len));
    for (int64_t i = 0; i < len; ++i) {
      float s = in[0][static_cast<size_t>(i)];
      for (int r = 1; r < n; ++r) s += in[static_cast<size_t>(r)][static_cast<size_t>(i)];
      want_sum[static_cast<size_t>(i)] = s;  // rank order
    }
    // all_to_all_v: rank s sends count(s, d) = (s * 7 + d * 3) % 5 values v = 1000 s + 10 d + k.
    auto count = [](int s, int d) { return static_cast<int64_t>((s * 7 + d * 3) % 5); };
    std::vector<std::vector<float>> reduced(static_cast<size_t>(n));
    on_ranks(n, [&](int r, Communicator& c) {
      ASSERT_EQ(c.rank(), r);
      ASSERT_EQ(c.size(), n);
      // Three rounds, so buffer reuse between collectives is exercised.
      for (int round = 0; round < 3; ++round) {
        std::vector<float> v = in[static_cast<size_t>(r)];
        c.all_reduce_sum(v.data(), len);
        reduced[static_cast<size_t>(r)] = v;

        std::vector<float> gathered(static_cast<size_t>(n * len));
        c.all_gather(in[static_cast<size_t>(r)].data(), len, gathered.data());
        for (int s = 0; s < n; ++s)
          for (int64_t i = 0; i < len; ++i)
            ASSERT_EQ(gathered[static_cast<size_t>(s * len + i)],
                      in[static_cast<size_t>(s)][static_cast<size_t>(i)]);

        std::vector<int64_t> sc(static_cast<size_t>(n));
        std::vector<float> send;
        for (int d = 0; d < n; ++d) {
          sc[static_cast<size_t>(d)] = count(r, d);
          for (int64_t k = 0; k < count(r, d); ++k) send.push_back(1000.0f * r + 10.0f * d + k);
        }
        const std::vector<int64_t> rc = parallel::exchange_counts(c, sc);
        int64_t total = 0;
        for (int s = 0; s < n; ++s) {
          ASSERT_EQ(rc[static_cast<size_t>(s)], count(s, r));
          total += rc[static_cast<size_t>(s)];
        }
        std::vector<float> recv(static_cast<size_t>(total), -1.0f);
        c.all_to_all_v(send.data(), sc.data(), recv.data(), rc.data());
        size_t at = 0;
        for (int s = 0; s < n; ++s)
          for (int64_t k = 0; k < count(s, r); ++k)
            ASSERT_EQ(recv[at++], 1000.0f * s + 10.0f * r + k);

        std::vector<float> b = in[static_cast<size_t>(r)];
        const int root = (round + 1) % n;
        c.broadcast(b.data(), len, root);
        ASSERT_EQ(b, in[static_cast<size_t>(root)]);
        c.barrier();
      }
    });
    for (int r = 0; r < n; ++r) {
      // Bit-identical on every rank, and equal to the rank-order sum.
      ASSERT_EQ(0, std::memcmp(reduced[static_cast<size_t>(r)].data(), want_sum.data(),
                               want_sum.size() * 4))
          << r;
    }
  }
}

TEST(Communicator, MismatchedCollectivesAndFailedRanksRaiseInsteadOfHanging) {
  // Rank 1 calls a different collective: both ranks see the mismatch.
  EXPECT_THROW(on_ranks(2,
                        [](int r, Communicator& c) {
                          float v[4] = {1, 2, 3, 4};
                          if (r == 0)
                            c.all_reduce_sum(v, 4);
                          else
                            c.barrier();
                        }),
               Error);
  // Different element counts in one all-reduce.
  EXPECT_THROW(on_ranks(3,
                        [](int r, Communicator& c) {
                          float v[4] = {1, 2, 3, 4};
                          c.all_reduce_sum(v, r == 2 ? 3 : 4);
                        }),
               Error);
  // A rank that fails before a collective aborts the group; the others do not wait forever.
  EXPECT_THROW(on_ranks(3,
                        [](int r, Communicator& c) {
                          if (r == 1) fail("rank 1 failed");
                          c.barrier();
                        }),
               Error);
}

// ---- Decode runs against the single-rank backbone --------------------------------------------

const LoadedModel& tiny_model(const std::string& preset) {
  static std::map<std::string, std::unique_ptr<LoadedModel>> cache;
  auto& slot = cache[preset];
  if (!slot) {
    const auto dir = test::temp_dir("parallel_" + preset);
    SynthOptions so;
    so.seed = 1;
    synthesize_checkpoint(synth_preset(preset), dir.string(), so);
    slot = LoadedModel::load(dir.string());
  }
  return *slot;
}

// One request of a run: its prompt, DP replica, the global step it joins at, and how many
// tokens it consumes (the prompt, then its own greedy tokens).
struct Request {
  std::vector<int64_t> prompt;
  int dp_rank = 0;
  int start = 0;
  int steps = 0;
};

struct Trace {
  std::vector<std::vector<float>> logits;  // [steps][vocab]
  std::vector<int64_t> tokens;             // the token consumed at each step
};

int64_t next_token(const Request& q, const Trace& tr, size_t k) {
  return k < q.prompt.size()
             ? q.prompt[k]
             : cpu::argmax(tr.logits.back().data(), static_cast<int64_t>(tr.logits.back().size()));
}

// Activation rounding and state dtypes of a run (default: bf16 activations, bf16 conv / latent).
struct Precision {
  cpu::Numerics num;
  cpu::StateDtypes dt{DType::BF16, DType::F32};
};

Trace run_single(const LoadedModel& m, const Request& q, const Precision& pr) {
  const cpu::CpuBackbone b(m.config, m.weights, pr.dt, pr.num);
  cpu::DecodeState st = b.new_state();
  Trace tr;
  std::vector<float> logits(static_cast<size_t>(m.config.vocab_size));
  for (size_t k = 0; k < static_cast<size_t>(q.steps); ++k) {
    const int64_t t = next_token(q, tr, k);
    b.step(st, t, logits.data());
    tr.tokens.push_back(t);
    tr.logits.push_back(logits);
  }
  return tr;
}

// All requests batched through the parallel backbone, each joining at its start step.
std::vector<Trace> run_parallel(const LoadedModel& m, const ParallelLayout& layout,
                                const std::vector<Request>& reqs, const Precision& pr) {
  const ParallelCpuBackbone b(m.config, m.weights, pr.dt, layout, pr.num);
  const size_t V = static_cast<size_t>(m.config.vocab_size);
  std::vector<parallel::ParallelState> states;
  for (const auto& q : reqs) states.push_back(b.new_state(q.dp_rank));
  std::vector<Trace> traces(reqs.size());
  int last = 0;
  for (const auto& q : reqs) last = std::max(last, q.start + q.steps);
  for (int s = 0; s < last; ++s) {
    std::vector<parallel::ParallelState*> batch;
    std::vector<int64_t> toks;
    std::vector<size_t> ids;
    for (size_t i = 0; i < reqs.size(); ++i) {
      const Request& q = reqs[i];
      if (s < q.start || s >= q.start + q.steps) continue;
      const size_t k = static_cast<size_t>(s - q.start);
      batch.push_back(&states[i]);
      toks.push_back(next_token(q, traces[i], k));
      ids.push_back(i);
    }
    std::vector<float> logits(batch.size() * V, std::nanf(""));
    b.step(batch, toks, logits.data());
    for (size_t j = 0; j < ids.size(); ++j) {
      traces[ids[j]].tokens.push_back(toks[j]);
      traces[ids[j]].logits.emplace_back(logits.begin() + static_cast<std::ptrdiff_t>(j * V),
                                         logits.begin() + static_cast<std::ptrdiff_t>((j + 1) * V));
    }
  }
  return traces;
}

std::vector<int64_t> prompt_of(uint64_t seed, size_t n) {
  Rng r(seed);
  std::vector<int64_t> p;
  for (size_t i = 0; i < n; ++i) p.push_back(static_cast<int64_t>(r.next_u64() % 256));
  return p;
}

// Every request's logits within kLogitRelTol at every step; greedy tokens identical.
void expect_matches_single(const std::string& preset, const ParallelLayout& layout,
                           const std::vector<Request>& reqs, const Precision& pr = {},
                           double tol = kLogitRelTol) {
  const LoadedModel& m = tiny_model(preset);
  SCOPED_TRACE(preset + " tp=" + std::to_string(layout.tp) + " dp=" + std::to_string(layout.dp) +
               " ep=" + std::to_string(layout.ep) + " dcp=" + std::to_string(layout.dcp));
  const std::vector<Trace> par = run_parallel(m, layout, reqs, pr);
  double worst = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const Trace ref = run_single(m, reqs[i], pr);
    for (size_t k = 0; k + 1 < ref.tokens.size(); ++k) {  // diagnose a divergence first
      if (par[i].tokens[k + 1] == ref.tokens[k + 1]) continue;
      std::vector<float> l = ref.logits[k];
      std::sort(l.begin(), l.end());
      ADD_FAILURE() << "request " << i << " greedy token " << k + 1 << " differs: top-2 gap "
                    << l[l.size() - 1] - l[l.size() - 2] << ", max logit diff "
                    << test::max_abs_diff(par[i].logits[k], ref.logits[k]);
      break;
    }
    ASSERT_EQ(par[i].tokens, ref.tokens) << "request " << i;
    for (size_t k = 0; k < ref.logits.size(); ++k) {
      double scale = 0;
      for (float v : ref.logits[k]) scale = std::max(scale, std::fabs(static_cast<double>(v)));
      const double rel = test::max_abs_diff(par[i].logits[k], ref.logits[k]) / scale;
      ASSERT_TRUE(std::isfinite(rel)) << "request " << i << " step " << k;
      EXPECT_LE(rel, tol) << "request " << i << " step " << k;
      // Without TP (and so without DCP) no partial sum changes order: bits must match.
      if (layout.tp == 1) {
        EXPECT_EQ(par[i].logits[k], ref.logits[k]) << "request " << i << " step " << k;
      }
      worst = std::max(worst, rel);
    }
  }
  std::printf("  [%s tp=%d dp=%d ep=%d dcp=%d] worst relative logit error %.2e\n", preset.c_str(),
              layout.tp, layout.dp, layout.ep, layout.dcp, worst);
}

// Two requests in one DP replica, 4-token prompts then 16 greedy tokens.
std::vector<Request> two_requests() {
  return {{prompt_of(1, 4), 0, 0, 20}, {prompt_of(101, 4), 0, 0, 20}};
}

TEST(Parallel, TensorParallelMatchesSingleRank) {
  for (int tp : {2, 4}) expect_matches_single("tiny", {tp, 1, false, 1}, two_requests());
  expect_matches_single("tiny-k3.1", {2, 1, false, 1}, two_requests());  // DSA replicated
  expect_matches_single("tiny-kimi-linear", {2, 1, false, 1}, two_requests());
}

TEST(Parallel, ExpertParallelMatchesSingleRank) {
  for (int n : {2, 4}) expect_matches_single("tiny", {n, 1, true, 1}, two_requests());
  expect_matches_single("tiny-kimi-linear", {4, 1, true, 1}, two_requests());
}

TEST(Parallel, DataParallelAttentionWithExpertParallelMoeMatchesSingleRank) {
  // Replica 1 joins late and finishes early: it runs dummy steps (zero rows) in lockstep.
  const std::vector<Request> reqs = {
      {prompt_of(31, 4), 0, 0, 20}, {prompt_of(32, 3), 0, 0, 12}, {prompt_of(33, 5), 1, 5, 10}};
  expect_matches_single("tiny", {1, 2, true, 1}, reqs);
  // DP x TP with EP over all four ranks (TP groups inside the DP replicas).
  expect_matches_single("tiny", {2, 2, true, 1}, reqs);
}

TEST(Parallel, DecodeContextParallelMatchesSingleRank) {
  for (int n : {2, 4}) expect_matches_single("tiny", {n, 1, false, n}, two_requests());
}

// In pure fp32 (activations and every state) there is no bf16 rounding to absorb or amplify the
// summation-order change: the difference stays near fp32 rounding level through the model.
constexpr double kFp32LogitRelTol = 5e-5;  // worst seen 7.7e-6

TEST(Parallel, Fp32NumericsMatchSingleRankClosely) {
  Precision fp32;
  fp32.num.bf16_activations = false;
  fp32.dt = {DType::F32, DType::F32, cpu::LatentFormat::F32};
  expect_matches_single("tiny", {4, 1, false, 1}, two_requests(), fp32, kFp32LogitRelTol);
  expect_matches_single("tiny", {4, 1, true, 4}, two_requests(), fp32, kFp32LogitRelTol);
  expect_matches_single("tiny", {2, 2, true, 2}, two_requests(), fp32, kFp32LogitRelTol);
}

TEST(Parallel, DecodeContextParallelShardsTheLatentCacheByToken) {
  const LoadedModel& m = tiny_model("tiny");
  const int n = 4, T = 7;
  const ParallelCpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32}, {n, 1, false, n});
  parallel::ParallelState s = b.new_state();
  std::vector<float> logits(static_cast<size_t>(m.config.vocab_size));
  for (int64_t t : prompt_of(5, T)) b.step({&s}, {t}, logits.data());
  const size_t row = static_cast<size_t>(m.config.kv_lora_rank + m.config.qk_rope_head_dim);
  for (int l = 0; l < m.config.num_hidden_layers; ++l) {
    if (m.config.layer_kind(l) != LayerKind::MLA) continue;
    for (int j = 0; j < n; ++j)  // tokens t = j, j + n, ...: ceil((T - j) / n) rows on rank j
      EXPECT_EQ(s.shards[static_cast<size_t>(j)].mla[static_cast<size_t>(l)].latent.size(),
                static_cast<size_t>((T - j + n - 1) / n) * row)
          << "layer " << l << " rank " << j;
  }
}

TEST(Parallel, LayoutsTheModelCannotTakeAreRefusedClearly) {
  const LoadedModel& m = tiny_model("tiny");
  auto message = [&](const ParallelLayout& l) {
    try {
      ParallelCpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32}, l);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({3, 1, false, 1})
                .find("num_attention_heads = 4 is not divisible by tensor_parallel_size = 3"),
            std::string::npos);
  EXPECT_NE(message({1, 3, true, 1}).find("num_experts = 16 is not divisible"), std::string::npos);
  EXPECT_NE(message({2, 1, false, 4}).find("decode_context_parallel_size"), std::string::npos);
  const LoadedModel& dsa = tiny_model("tiny-k3.1");
  EXPECT_THROW(
      ParallelCpuBackbone(dsa.config, dsa.weights, {DType::BF16, DType::F32}, {2, 1, false, 2}),
      Error);
}

// TP slices of the routed experts' down projection: whole 32-column blocks stay MXFP4 (the GPU
// reads MXFP4 or bf16 only), a straddling slice becomes exact fp32; the values are the same.
TEST(Parallel, ColumnSlicesOfMxfp4ExpertsKeepWholeBlocksPacked) {
  const LoadedModel& m = tiny_model("tiny");
  for (const int tp : {2, 4}) {
    const parallel::RankWeights rw(m.config, m.weights, {tp, 1, false, 1}, tp - 1);
    for (size_t l = 0; l < m.weights.layers.size(); ++l) {
      const LayerWeights& full = m.weights.layers[l];
      if (!full.moe) continue;
      const WeightMatrix& w2 = full.moe_w.experts[3].w2;
      const WeightMatrix& part = rw.weights().layers[l].moe_w.experts[3].w2;
      ASSERT_EQ(w2.format, WeightFormat::MXFP4);
      const int64_t n = w2.cols / tp, first = (tp - 1) * n;
      ASSERT_EQ(part.cols, n);
      EXPECT_EQ(part.format, n % 32 == 0 ? WeightFormat::MXFP4 : WeightFormat::F32) << tp;
      std::vector<float> a(static_cast<size_t>(w2.cols)), b(static_cast<size_t>(n));
      for (int64_t r = 0; r < w2.rows; ++r) {
        w2.row_to_float(r, a.data());
        part.row_to_float(r, b.data());
        ASSERT_TRUE(std::equal(b.begin(), b.end(), a.begin() + first))
            << "tp " << tp << " row " << r;
      }
    }
  }
}

// `k3 generate --tp / --ep / --dcp / --dp` runs the multi-rank backbone: same greedy ids.
TEST(Parallel, GenerateCommandRunsTheParallelBackbone) {
  const LoadedModel& m = tiny_model("tiny");
  const std::string base = std::string(K3_BINARY) + " generate --model " + m.dir +
                           " --prompt-ids 5,17,300,42 --max-tokens 12 --show-ids --ignore-eos"
                           " --device cpu";
  auto ids = [](const std::string& out) {  // the ids: a line's leading digits and spaces
    std::istringstream in(out);            // (stderr may follow on the same line)
    std::string line;
    while (std::getline(in, line))
      if (!line.empty() && std::isdigit(static_cast<unsigned char>(line[0])))
        return line.substr(0, line.find_first_not_of("0123456789 "));
    return std::string();
  };
  const auto single = test::run_command(base);
  ASSERT_EQ(single.status, 0) << single.output;
  ASSERT_FALSE(ids(single.output).empty()) << single.output;
  for (const char* flags : {" --tp 2 --ep --dcp 2", " --dp 2 --ep"}) {
    const auto par = test::run_command(base + flags);
    ASSERT_EQ(par.status, 0) << flags << "\n" << par.output;
    EXPECT_NE(par.output.find("CPU ranks"), std::string::npos) << par.output;
    EXPECT_EQ(ids(par.output), ids(single.output)) << flags;
  }
  const auto bad = test::run_command(base + " --tp 3");
  EXPECT_EQ(bad.status, 1) << bad.output;
  EXPECT_NE(bad.output.find("not divisible by tensor_parallel_size = 3"), std::string::npos)
      << bad.output;
}

}  // namespace
}  // namespace k3

namespace k3::parallel {
namespace {

// The serving engine's multi-rank StepBackend (k3 serve --tensor-parallel-size ...): prefill
// chunks and decode rows of several requests, spread over the DP replicas, give the single-rank
// CPU backend's logits within kLogitRelTol.
TEST(ParallelStepBackend, MatchesTheCpuBackend) {
  const LoadedModel& m = tiny_model("tiny");
  DeployConfig d;
  d.max_model_len = 64;
  ParallelLayout layout;
  layout.tp = 2;
  layout.dp = 2;
  layout.ep = true;
  auto par = make_parallel_cpu_backend(LoadedModel::load(m.dir), d, layout);
  auto ref = serve::make_cpu_backend(LoadedModel::load(m.dir), d, false, 1);
  const size_t V = static_cast<size_t>(m.config.vocab_size);
  std::vector<std::unique_ptr<serve::SlotState>> ps, rs;
  std::vector<std::vector<int64_t>> prompts = {{5, 9, 2, 7}, {11, 3}, {8, 8, 1, 4, 6}};
  for (size_t i = 0; i < prompts.size(); ++i) {
    ps.push_back(par->new_state());
    rs.push_back(ref->new_state());
  }
  std::vector<float> pl(V * prompts.size()), rl(V * prompts.size());
  const auto run = [&](const std::vector<std::vector<int64_t>>& toks) {
    std::vector<serve::StepRow> prow, rrow;
    for (size_t i = 0; i < toks.size(); ++i) {
      prow.push_back({ps[i].get(), toks[i], pl.data() + i * V});
      rrow.push_back({rs[i].get(), toks[i], rl.data() + i * V});
    }
    par->forward(prow);
    ref->forward(rrow);
    for (size_t i = 0; i < toks.size(); ++i) {
      EXPECT_EQ(ps[i]->position(), rs[i]->position());
      double worst = 0, scale = 0;
      for (size_t v = 0; v < V; ++v) {
        scale = std::max(scale, std::fabs(static_cast<double>(rl[i * V + v])));
        worst = std::max(worst, std::fabs(static_cast<double>(pl[i * V + v]) - rl[i * V + v]));
      }
      EXPECT_LE(worst, kLogitRelTol * scale) << "request " << i;
    }
  };
  run(prompts);  // prefill rows of different lengths
  for (int64_t t = 0; t < 4; ++t) run({{t + 1}, {t + 20}, {t + 40}});
  ps[1]->reset();
  rs[1]->reset();
  EXPECT_EQ(ps[1]->position(), 0);
  run({{3, 1, 4}, {1, 5}, {9}});  // request 1 restarts in its reset slot
}

}  // namespace
}  // namespace k3::parallel
