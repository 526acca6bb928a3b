// Speculative decoding end to end on the CPU reference: with the n-gram drafter, greedy output
// is identical to non-speculative greedy output (tiny and tiny-k3.1, 64 tokens, a repetitive
// prompt so drafts get accepted), stop conditions hold inside an accepted run, sampled runs are
// reproducible, and the serving engine with a speculative config streams the same greedy
// tokens as without; the loop over a StepBackend equals the loop over the backbone.
#include <gtest/gtest.h>

#include <chrono>

#include "cpu/backbone.h"
#include "cpu/generate.h"
#include "serve/backend_generate.h"
#include "serve/engine.h"
#include "spec/drafter.h"
#include "spec/spec_generate.h"
#include "spec_test_models.h"

namespace k3 {
namespace {

using namespace std::chrono_literals;

constexpr int kTokens = 64;

cpu::GenerateRequest greedy_request(const std::vector<int64_t>& prompt, int n, bool ignore_eos) {
  cpu::GenerateRequest r;
  r.prompt = prompt;
  r.max_new_tokens = n;
  r.ignore_eos = ignore_eos;
  return r;
}

class SpecGenerate : public ::testing::TestWithParam<const char*> {};

TEST_P(SpecGenerate, NgramGreedyEqualsPlainGreedy) {
  const LoadedModel& m = test::spec_model(GetParam());
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  const test::AcceptingCase c = test::accepting_case(b, GetParam(), kTokens);
  ASSERT_GT(c.first_accept, 0);
  const cpu::GenerateRequest req = greedy_request(c.prompt, kTokens, true);
  for (int n : {1, 3}) {
    spec::NgramDrafter d(1, 4);
    std::vector<int64_t> streamed;
    const spec::SpecGenerateResult s =
        spec::speculative_generate(b, req, d, n, [&](int64_t t) { streamed.push_back(t); });
    EXPECT_EQ(s.result.tokens, c.plain.tokens) << "n " << n;
    EXPECT_EQ(streamed, c.plain.tokens);
    EXPECT_EQ(s.result.finish_reason, "length");
    EXPECT_GT(s.stats.accepted, 0) << "n " << n;
    EXPECT_LE(s.stats.accepted, s.stats.draft_tokens);
    EXPECT_LE(s.stats.draft_tokens, s.stats.steps * n);
  }
}

TEST_P(SpecGenerate, StopConditionsHoldInsideAnAcceptedRun) {
  const LoadedModel& m = test::spec_model(GetParam());
  const cpu::CpuBackbone plain_b(m.config, m.weights, {DType::BF16, DType::F32});
  const test::AcceptingCase c = test::accepting_case(plain_b, GetParam(), kTokens);
  ASSERT_GT(c.first_accept, 0);
  const std::vector<int64_t>& plain = c.plain.tokens;
  const auto first = [&](int len) {
    return std::vector<int64_t>(plain.begin(), plain.begin() + len);
  };
  // max_new_tokens ending exactly at, and inside, the first accepted run.
  for (int len : {1, c.first_accept, c.first_accept + 1}) {
    spec::NgramDrafter d(1, 4);
    const auto r = spec::speculative_generate(plain_b, greedy_request(c.prompt, len, true), d, 3);
    EXPECT_EQ(r.result.tokens, first(len)) << "max_new_tokens " << len;
    EXPECT_EQ(r.result.finish_reason, "length");
  }
  // The accepted draft token as eos: the run ends right there, as the plain run does. (The
  // first occurrence of that token may come earlier; the plain run is the reference.)
  ModelConfig cfg = m.config;
  cfg.eos_token_ids = {plain[static_cast<size_t>(c.first_accept)]};
  const cpu::CpuBackbone b(cfg, m.weights, {DType::BF16, DType::F32});
  const cpu::GenerateResult ref = cpu::generate(b, greedy_request(c.prompt, kTokens, false));
  ASSERT_EQ(ref.finish_reason, "stop");
  spec::NgramDrafter d(1, 4);
  const auto s = spec::speculative_generate(b, greedy_request(c.prompt, kTokens, false), d, 3);
  EXPECT_EQ(s.result.tokens, ref.tokens);
  EXPECT_EQ(s.result.finish_reason, "stop");
}

// The same loop over a StepBackend's verify / commit (what `k3 generate --device cuda` runs):
// on the CPU backend it gives the tokens and acceptance counts of the backbone loop.
TEST_P(SpecGenerate, OverAStepBackendEqualsTheBackboneLoop) {
  const LoadedModel& m = test::spec_model(GetParam());
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  const test::AcceptingCase c = test::accepting_case(b, GetParam(), kTokens);
  const cpu::GenerateRequest req = greedy_request(c.prompt, kTokens, true);
  spec::NgramDrafter d1(1, 4), d2(1, 4);
  const spec::SpecGenerateResult want = spec::speculative_generate(b, req, d1, 3);
  DeployConfig dc;
  dc.max_num_seqs = 1;
  auto backend = serve::make_cpu_backend(LoadedModel::load(m.dir), dc, false, 1);
  const spec::SpecGenerateResult got = serve::speculative_generate_on(*backend, req, d2, 3);
  EXPECT_EQ(got.result.tokens, c.plain.tokens);
  EXPECT_EQ(got.result.tokens, want.result.tokens);
  EXPECT_EQ(got.stats.accepted, want.stats.accepted);
  EXPECT_EQ(got.stats.steps, want.stats.steps);
}

INSTANTIATE_TEST_SUITE_P(Presets, SpecGenerate, ::testing::Values("tiny", "tiny-k3.1"));

TEST(SpecGenerateSampled, SeededRunsAreReproducible) {
  const LoadedModel& m = test::spec_model("tiny");
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  cpu::GenerateRequest req = greedy_request(test::repetitive_prompt(5, 4, 4), 16, true);
  req.sampling = {0.8f, 20, 0.95f, 77};
  spec::NgramDrafter d1(1, 3), d2(1, 3);
  const auto a = spec::speculative_generate(b, req, d1, 3);
  const auto c = spec::speculative_generate(b, req, d2, 3);
  EXPECT_EQ(a.result.tokens, c.result.tokens);
  EXPECT_EQ(a.result.tokens.size(), 16u);
}

// ---- the serving engine over the CPU backend ----

// Token id -> "<id> ", so the streamed text names the generated ids exactly.
class IdCodec final : public serve::TextCodec {
 public:
  std::vector<int64_t> encode(std::string_view, bool) const override { return {}; }
  std::unique_ptr<serve::TokenStream> stream() const override {
    struct S final : serve::TokenStream {
      std::string push(int64_t id) override { return std::to_string(id) + " "; }
      std::string flush() override { return {}; }
    };
    return std::make_unique<S>();
  }
  std::optional<int64_t> special_id(std::string_view) const override { return std::nullopt; }
  std::string name() const override { return "ids"; }
};

serve::StreamEvent run_to_end(serve::RequestStream& s) {
  std::string text;
  for (int i = 0; i < 3000; ++i) {
    serve::StreamEvent ev;
    if (!s.next(ev, 10ms)) continue;
    text += ev.text;
    if (ev.finished) {
      ev.text = text;
      return ev;
    }
  }
  ADD_FAILURE() << "the request did not finish";
  return {};
}

// Greedy requests through an engine with two slots (a third request reuses one):
// "<text>|<finish_reason>" of each.
std::vector<std::string> serve_texts(const std::vector<std::vector<int64_t>>& prompts,
                                     int max_tokens, const SpeculativeConfig& spec,
                                     const std::vector<std::string>& stop,
                                     std::string* metrics_text) {
  const LoadedModel& src = test::spec_model("tiny");
  auto model = LoadedModel::load(src.dir);
  DeployConfig dc;
  serve::Metrics metrics;
  serve::EngineOptions eo;
  eo.max_num_seqs = 2;
  eo.max_num_batched_tokens = 16;
  eo.speculative = spec;
  serve::Engine engine(serve::make_cpu_backend(std::move(model), dc, false, 2),
                       std::make_shared<IdCodec>(), eo, metrics);
  std::vector<std::shared_ptr<serve::RequestStream>> streams;
  for (const auto& p : prompts) {
    serve::GenerationRequest r;
    r.prompt = p;
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    r.stop = stop;
    streams.push_back(engine.submit(r));
  }
  std::vector<std::string> out;
  for (auto& s : streams) {
    const serve::StreamEvent ev = run_to_end(*s);
    out.push_back(ev.text + "|" + ev.finish_reason);
  }
  if (metrics_text) *metrics_text = metrics.render();
  return out;
}

TEST(SpecServe, NgramSpeculationStreamsTheSameGreedyText) {
  const LoadedModel& m = test::spec_model("tiny");
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  const test::AcceptingCase c = test::accepting_case(b, "tiny", kTokens);
  ASSERT_GT(c.first_accept, 0);
  // The accepting prompt, a plain one, and the accepting one again (in the reused slot).
  const std::vector<std::vector<int64_t>> prompts = {c.prompt, test::repetitive_prompt(99, 3, 3),
                                                     c.prompt};
  const int max_tokens = c.first_accept + 4;
  const auto plain = serve_texts(prompts, max_tokens, {}, {}, nullptr);
  SpeculativeConfig sc;
  sc.method = "ngram";
  sc.num_speculative_tokens = 3;
  std::string metrics;
  const auto spec = serve_texts(prompts, max_tokens, sc, {}, &metrics);
  EXPECT_EQ(spec, plain);
  ASSERT_EQ(plain[0].substr(plain[0].size() - 7), "|length");
  EXPECT_NE(metrics.find("k3_spec_decode_num_draft_tokens_total"), std::string::npos);
  EXPECT_EQ(metrics.find("k3_spec_decode_num_accepted_tokens_total 0\n"), std::string::npos)
      << metrics;  // something was accepted
  // A stop string made of the accepted token's text ends the request inside the accepted run,
  // at the same place with and without speculation.
  const std::vector<std::string> stop = {
      " " + std::to_string(c.plain.tokens[static_cast<size_t>(c.first_accept)]) + " "};
  const auto plain_stop = serve_texts(prompts, max_tokens, {}, stop, nullptr);
  EXPECT_EQ(plain_stop[0].substr(plain_stop[0].size() - 5), "|stop");
  EXPECT_EQ(serve_texts(prompts, max_tokens, sc, stop, nullptr), plain_stop);
}

TEST(SpecServe, EngineRefusesAnUnknownDrafter) {
  const LoadedModel& src = test::spec_model("tiny");
  serve::Metrics metrics;
  serve::EngineOptions eo;
  eo.max_num_seqs = 1;
  eo.speculative.method = "eagle";
  eo.speculative.num_speculative_tokens = 2;
  EXPECT_THROW(serve::Engine(serve::make_cpu_backend(LoadedModel::load(src.dir), {}, false, 1),
                             std::make_shared<IdCodec>(), eo, metrics),
               Error);
}

// A backend without a verify step keeps the interface's default refusal.
class NoVerifyBackend final : public serve::StepBackend {
 public:
  NoVerifyBackend() { cfg_.vocab_size = 8; }
  const ModelConfig& config() const override { return cfg_; }
  int64_t vocab_size() const override { return 8; }
  int64_t max_context() const override { return 64; }
  std::unique_ptr<serve::SlotState> new_state() const override { return nullptr; }
  void forward(std::span<const serve::StepRow>) override {}

 private:
  ModelConfig cfg_;
};

TEST(SpecServe, BackendsWithoutVerifyRefuseClearly) {
  NoVerifyBackend b;
  EXPECT_FALSE(b.supports_verify());
  try {
    b.verify({});
    ADD_FAILURE() << "verify did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not supported by this backend"), std::string::npos);
  }
  serve::Metrics metrics;
  serve::EngineOptions eo;
  eo.max_num_seqs = 1;
  eo.speculative.method = "ngram";
  eo.speculative.num_speculative_tokens = 2;
  EXPECT_THROW(
      serve::Engine(std::make_unique<NoVerifyBackend>(), std::make_shared<IdCodec>(), eo, metrics),
      Error);
}

}  // namespace
}  // namespace k3
