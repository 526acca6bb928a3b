// The serving engine's StepBackend over the CUDA step: generation against the backbone driven
// directly, slot management, chunked prefill, speculative verify + commit, and the engine with
// n-gram speculation.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backbone_test_util.h"
#include "core/numeric.h"
#include "core/rng.h"
#include "cuda/backbone.h"
#include "cuda/cuda_draft.h"
#include "cuda/cuda_step_backend.h"
#include "model/loaded_model.h"
#include "runtime/deploy_config.h"
#include "serve/backend_generate.h"
#include "serve/engine.h"
#include "serve/metrics.h"
#include "serve/text_codec.h"
#include "spec/draft_model.h"
#include "spec/drafter.h"
#include "spec/spec_generate.h"
#include "spec_test_models.h"
#include "test_util.h"

namespace k3 {
namespace {

// The CUDA backend over a fresh mapping of m: seqs slots of len tokens; with spec_tokens > 0 an
// n-gram speculative config (its KDA snapshots reserved at load).
std::unique_ptr<serve::StepBackend> cuda_backend(const LoadedModel& m, int seqs, int64_t len,
                                                 int spec_tokens = 0) {
  DeployConfig d;
  d.max_num_seqs = seqs;
  d.max_model_len = len;
  if (spec_tokens > 0) {
    d.speculative_config.method = "ngram";
    d.speculative_config.num_speculative_tokens = spec_tokens;
  }
  return cuda::make_cuda_step_backend(LoadedModel::load(m.dir), d);
}

// The serving engine's StepBackend over the CUDA step: generate_on (prefill as one multi-token
// row, then one token per forward) gives the tokens of the backbone driven directly, and slots
// are handed out up to max_num_seqs and come back when their state is dropped.
TEST(CudaStepBackend, GenerateEqualsBackboneAndManagesSlots) {
  const LoadedModel& m = tiny_model("tiny-kimi-linear");
  auto backend = cuda_backend(m, 2, 128);
  cpu::GenerateRequest req;
  req.prompt = random_prompt(m.config, 31, 6);
  req.max_new_tokens = 16;
  req.ignore_eos = true;
  const cpu::GenerateResult res = serve::generate_on(*backend, req);
  ASSERT_EQ(res.tokens.size(), 16u);

  cuda::CudaBackbone direct(m.config, m.weights, options(1, true, 128));
  std::vector<int64_t> want;
  int32_t next = 0;
  for (size_t i = 0; i < req.prompt.size() + 15; ++i) {
    const int32_t slot = 0;
    const int32_t tok = i < req.prompt.size() ? static_cast<int32_t>(req.prompt[i]) : next;
    direct.step({&slot, 1}, {&tok, 1});
    direct.greedy(1, &next);
    if (i + 1 >= req.prompt.size()) want.push_back(next);
  }
  EXPECT_EQ(res.tokens, want);

  auto a = backend->new_state();
  auto b = backend->new_state();
  EXPECT_THROW(backend->new_state(), Error) << "only max_num_seqs slots";
  b.reset();
  auto c = backend->new_state();  // b's slot, reset
  EXPECT_EQ(c->position(), 0);
}

}  // namespace
}  // namespace k3

namespace k3 {
namespace {

// Speculative verify on the CUDA backend: the q tokens run as one step (a run of rows of the
// slot), and their logit rows equal the logits of feeding the same tokens one by one (to the
// batched-rows bound: the q-row GEMMs run other plans); after commit(consumed) the slot
// continues as if only the first `consumed` tokens had been fed (KDA state restored from the
// snapshot the verify kept, caches cut by position), for every acceptance length; hidden states
// come back for every token. With batch-invariant plans all of it holds bit for bit.
void check_verify(const char* preset, bool exact) {
  {
    SCOPED_TRACE(std::string(preset) + (exact ? " batch-invariant" : ""));
    const BatchInvariantScope invariant(exact);
    const LoadedModel& m = tiny_model(preset);
    auto spec = cuda_backend(m, 1, 64, 3);
    auto plain = cuda_backend(m, 1, 64, 3);
    const size_t V = static_cast<size_t>(m.config.vocab_size);
    const size_t H = static_cast<size_t>(m.config.hidden_size);
    const std::vector<int64_t> prompt = random_prompt(m.config, 41, 5);
    const std::vector<int64_t> draft = random_prompt(m.config, 42, 4);  // q = 4
    const int64_t next = draft[0] ^ 1;  // the token after the accepted prefix
    for (int64_t consumed = 1; consumed <= 4; ++consumed) {
      SCOPED_TRACE("consumed " + std::to_string(consumed));
      auto a = spec->new_state();
      auto b = plain->new_state();
      std::vector<float> la(V), lb(V), verify_logits(4 * V), step_logits(V);
      std::vector<float> verify_hidden(4 * H, NAN), step_hidden(H);
      const serve::StepRow pa{a.get(), prompt, la.data()}, pb{b.get(), prompt, lb.data()};
      spec->forward({&pa, 1});
      plain->forward({&pb, 1});
      ASSERT_EQ(la, lb);
      const serve::VerifyRow v{a.get(), draft, verify_logits.data(), verify_hidden.data()};
      spec->verify({&v, 1});
      EXPECT_EQ(a->position(), static_cast<int64_t>(prompt.size() + 4));
      for (int64_t i = 0; i < consumed; ++i) {
        const serve::StepRow s{
            b.get(), {&draft[static_cast<size_t>(i)], 1}, step_logits.data(), step_hidden.data()};
        plain->forward({&s, 1});
        expect_rows_match({verify_logits.begin() + i * V, verify_logits.begin() + (i + 1) * V},
                          step_logits, exact, "verify row " + std::to_string(i));
        const std::vector<float> vh(verify_hidden.begin() + i * H,
                                    verify_hidden.begin() + (i + 1) * H);
        if (exact)
          EXPECT_EQ(vh, step_hidden) << "hidden row " << i;
        else
          EXPECT_LE(rel_l2(vh, step_hidden), kLogitRel) << "hidden row " << i;
      }
      spec->commit(*a, consumed);
      EXPECT_EQ(a->position(), b->position());
      const serve::StepRow na{a.get(), {&next, 1}, la.data()}, nb{b.get(), {&next, 1}, lb.data()};
      spec->forward({&na, 1});
      plain->forward({&nb, 1});
      expect_rows_match(la, lb, exact, "after committing");
    }
  }
}

TEST(CudaStepBackend, VerifyThenCommitEqualsDecodingOnlyTheAcceptedTokens) {
  for (const char* preset : {"tiny", "tiny-k3.1"}) check_verify(preset, false);
}
TEST(CudaStepBackend, BatchInvariantVerifyIsBitIdentical) {
  for (const char* preset : {"tiny", "tiny-k3.1"}) check_verify(preset, true);
}

// Speculative generation on the CUDA backend (`k3 generate --device cuda` with a speculative
// config): with the n-gram drafter and with a draft model (on the CPU, reading the GPU target's
// hidden states) the greedy tokens equal plain greedy decoding on the same backend, bit for bit
// with batch-invariant plans; drafts do get accepted.
TEST(CudaStepBackend, SpeculativeGenerateEqualsPlainGreedy) {
  const BatchInvariantScope invariant(true);
  const LoadedModel& m = tiny_model("tiny");
  auto backend = cuda_backend(m, 2, 256, 3);
  cpu::GenerateRequest req;
  req.prompt = test::repetitive_prompt(7, 4, 4);
  req.max_new_tokens = 40;
  req.ignore_eos = true;
  const cpu::GenerateResult plain = serve::generate_on(*backend, req);
  spec::NgramDrafter ngram(1, 4);
  const spec::SpecGenerateResult a = serve::speculative_generate_on(*backend, req, ngram, 3);
  EXPECT_EQ(a.result.tokens, plain.tokens) << "n-gram drafter";
  EXPECT_GT(a.stats.draft_tokens, 0);
  const auto dir = test::temp_dir("gpu_draft_tiny");
  spec::synthesize_draft_checkpoint(m.config, dir.string(), 11);
  const auto draft = spec::DraftModel::load(dir.string(), m.config);
  spec::DraftModelDrafter dm(*draft, req.sampling);
  const spec::SpecGenerateResult b = serve::speculative_generate_on(*backend, req, dm, 3);
  EXPECT_EQ(b.result.tokens, plain.tokens) << "draft model";
  EXPECT_GT(b.stats.steps, 0);
}

// The draft model on the GPU (the CUDA backend's own drafter for draft_model speculation): its
// fused input and dense MLA steps give the CPU draft's logits entry by entry within the bf16
// noise floor's absolute bound (2% mean rel L2, the other GPU tests' standard), and speculative
// generation with it gives plain greedy's tokens bit for bit under batch-invariant plans, with
// the stock and with the specialized (captured single-row) draft step.
TEST(CudaStepBackend, GpuDraftModelDraftsAsTheCpuDraft) {
  const BatchInvariantScope invariant(true);
  const LoadedModel& m = tiny_model("tiny");
  const auto dir = test::temp_dir("gpu_draft_on_gpu");
  spec::synthesize_draft_checkpoint(m.config, dir.string(), 11);
  const auto cpu_draft = spec::DraftModel::load(dir.string(), m.config);
  cuda::CudaDraftModel gpu(spec::DraftModel::load(dir.string(), m.config), 1, 256, false);
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng rng(seed);
  const size_t H = static_cast<size_t>(m.config.hidden_size);
  const size_t V = static_cast<size_t>(m.config.vocab_size);
  cpu::DecodeState st = cpu_draft->backbone().new_state();
  std::vector<float> in(H), want(V), got(V), hid(H);
  const std::vector<int64_t> toks = random_prompt(m.config, seed, 12);
  double dist = 0;
  for (size_t i = 0; i < toks.size(); ++i) {
    std::vector<float> h = test::random_normal(rng, H);  // a target hidden state: bf16 values
    for (float& v : h) v = round_bf16(v);
    cpu_draft->fuse(toks[i], h.data(), in.data());
    cpu_draft->backbone().step_hidden(st, 0, want.data(), hid.data(), in.data());
    const int32_t slot = 0, tok = static_cast<int32_t>(toks[i]);
    gpu.backbone().step_fused({&slot, 1}, {&tok, 1}, h.data());
    gpu.backbone().logits_to_host(1, got.data());
    for (float v : got) ASSERT_TRUE(std::isfinite(v)) << "entry " << i;
    dist += rel_l2(got, want);
  }
  std::printf("  GPU draft vs CPU draft: logits rel L2 %.2e mean over %zu entries\n",
              dist / toks.size(), toks.size());
  EXPECT_LE(dist / toks.size(), 0.02);

  cpu::GenerateRequest req;
  req.prompt = test::repetitive_prompt(7, 4, 4);
  req.max_new_tokens = 32;
  req.ignore_eos = true;
  for (const bool specialized : {false, true}) {
    SCOPED_TRACE(specialized ? "latency_specialized" : "auto");
    DeployConfig d;
    d.max_num_seqs = 2;
    d.max_model_len = 256;
    d.decode_backend = specialized ? DecodeBackend::LatencySpecialized : DecodeBackend::Auto;
    d.speculative_config.method = "draft_model";
    d.speculative_config.model = dir.string();
    d.speculative_config.num_speculative_tokens = 3;
    auto backend = cuda::make_cuda_step_backend(LoadedModel::load(m.dir), d);
    const cpu::GenerateResult plain = serve::generate_on(*backend, req);
    const auto drafter = backend->make_drafter(d.speculative_config, req.sampling);
    ASSERT_NE(drafter, nullptr) << "the CUDA backend drafts on the GPU";
    const spec::SpecGenerateResult r = serve::speculative_generate_on(*backend, req, *drafter, 3);
    EXPECT_EQ(r.result.tokens, plain.tokens);
    EXPECT_GT(r.stats.steps, 0);
  }
}

// One engine step of a verify row and a decode row (StepBackend::step) runs them as one
// backbone step and gives what forward then verify give (bit for bit with batch-invariant
// plans), leaving both slots at the same positions.
TEST(CudaStepBackend, JointStepEqualsForwardThenVerify) {
  const BatchInvariantScope invariant(true);
  const LoadedModel& m = tiny_model("tiny");
  const size_t V = static_cast<size_t>(m.config.vocab_size);
  const std::vector<int64_t> p0 = random_prompt(m.config, 51, 5),
                             p1 = random_prompt(m.config, 52, 7);
  const std::vector<int64_t> draft = random_prompt(m.config, 53, 4);
  const int64_t tok = 11;
  std::vector<std::vector<float>> out;
  std::vector<int64_t> positions;
  for (const bool joint : {true, false}) {
    auto backend = cuda_backend(m, 2, 64, 3);
    auto a = backend->new_state();
    auto b = backend->new_state();
    std::vector<float> la(V), lb(V), vl(4 * V), dl(V);
    const serve::StepRow pa{a.get(), p0, la.data()}, pb{b.get(), p1, lb.data()};
    const std::vector<serve::StepRow> prompts = {pa, pb};
    backend->forward(prompts);
    const serve::VerifyRow v{a.get(), draft, vl.data()};
    const serve::StepRow d{b.get(), {&tok, 1}, dl.data()};
    if (joint) {
      backend->step({&d, 1}, {&v, 1});
    } else {
      backend->forward({&d, 1});
      backend->verify({&v, 1});
    }
    out.push_back(vl);
    out.push_back(dl);
    positions.push_back(a->position());
    positions.push_back(b->position());
  }
  EXPECT_EQ(out[0], out[2]) << "verify rows";
  EXPECT_EQ(out[1], out[3]) << "decode row";
  EXPECT_EQ(positions[0], positions[2]);
  EXPECT_EQ(positions[1], positions[3]);
}

// A prompt longer than a step's rows is cut into chunks (runs of up to 64 rows), and its
// logits equal those of feeding it one token per step, bit for bit under batch-invariant
// plans. (Without them the one-row steps take the GEMV, which sums K in another order than the
// runs' tilings: over 150 tokens the random tiny model amplifies that rounding to ~0.6 rel L2,
// so the chaotic trajectory, not the chunking, would be measured.)
TEST(CudaStepBackend, ChunkedPrefillEqualsTokenByToken) {
  const BatchInvariantScope invariant(true);
  const LoadedModel& m = tiny_model("tiny");
  auto backend = cuda_backend(m, 2, 256);
  const size_t V = static_cast<size_t>(m.config.vocab_size);
  const std::vector<int64_t> prompt = random_prompt(m.config, 43, 150);  // 64 + 64 + 22
  auto a = backend->new_state();
  std::vector<float> la(V), lb(V);
  const serve::StepRow pa{a.get(), prompt, la.data()};
  backend->forward({&pa, 1});
  EXPECT_EQ(a->position(), 150);
  auto b = backend->new_state();
  for (const int64_t t : prompt) {
    const serve::StepRow s{b.get(), {&t, 1}, lb.data()};
    backend->forward({&s, 1});
  }
  expect_rows_match(la, lb, /*exact=*/true, "last prompt token");
}

}  // namespace
}  // namespace k3

namespace k3 {
namespace {

// The serving engine with n-gram speculation on the CUDA backend streams the same greedy text as
// without it.
std::string engine_text(const LoadedModel& m, const std::vector<int64_t>& prompt, int max_tokens,
                        const SpeculativeConfig& spec, std::string* metrics_text) {
  DeployConfig dc;
  dc.max_num_seqs = 1;
  dc.max_model_len = 256;
  serve::Metrics metrics;
  serve::EngineOptions eo;
  eo.max_num_seqs = 1;
  eo.max_num_batched_tokens = 16;
  eo.speculative = spec;
  serve::Engine engine(cuda::make_cuda_step_backend(LoadedModel::load(m.dir), dc),
                       serve::TextCodec::load(m.dir), eo, metrics);
  serve::GenerationRequest r;
  r.prompt = prompt;
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  auto stream = engine.submit(r);
  std::string text;
  for (int i = 0; i < 3000; ++i) {
    serve::StreamEvent ev;
    if (!stream->next(ev, std::chrono::milliseconds(10))) continue;
    text += ev.text;
    if (ev.finished) {
      if (metrics_text) *metrics_text = metrics.render();
      return text + "|" + ev.finish_reason;
    }
  }
  ADD_FAILURE() << "the request did not finish";
  return {};
}

// The verify's q rows are one step, so the greedy text is the same bit for bit with
// batch-invariant plans (the default plans agree to rounding: a near-tie may go either way).
TEST(CudaStepBackend, NgramSpeculationInTheEngineGivesTheSameGreedyText) {
  const BatchInvariantScope invariant(true);
  const LoadedModel& m = tiny_model("tiny");
  const std::vector<int64_t> prompt = test::repetitive_prompt(7, 4, 4);
  const std::string plain = engine_text(m, prompt, 32, {}, nullptr);
  SpeculativeConfig sc;
  sc.method = "ngram";
  sc.num_speculative_tokens = 3;
  std::string metrics;
  EXPECT_EQ(engine_text(m, prompt, 32, sc, &metrics), plain);
  EXPECT_EQ(metrics.find("k3_spec_decode_num_draft_tokens_total 0\n"), std::string::npos)
      << "the n-gram drafter proposed nothing on a repetitive prompt: " << metrics;
}

}  // namespace
}  // namespace k3
