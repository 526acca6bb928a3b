// The draft-model drafter: greedy speculative output with it equals plain greedy output (tiny
// and tiny-k3.1, 64 tokens; also through the serving engine), its proposals do not depend on how
// the target's hidden states were reported (chained draft entries leave no trace), sampled
// drafts come with their distributions, and a draft that does not fit the target is refused.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>

#include "cpu/backbone.h"
#include "cpu/generate.h"
#include "serve/engine.h"
#include "spec/draft_model.h"
#include "spec/spec_generate.h"
#include "spec_test_models.h"

namespace k3 {
namespace {

using namespace std::chrono_literals;

// One synthetic draft per target preset for the whole binary.
const spec::DraftModel& draft_for(const std::string& preset) {
  static std::map<std::string, std::unique_ptr<spec::DraftModel>> cache;
  auto& slot = cache[preset];
  if (!slot) {
    const auto dir = test::temp_dir("draft_" + preset);
    const ModelConfig& target = test::spec_model(preset).config;
    spec::synthesize_draft_checkpoint(target, dir.string(), 11);
    slot = spec::DraftModel::load(dir.string(), target);
  }
  return *slot;
}

class SpecDraft : public ::testing::TestWithParam<const char*> {};

TEST_P(SpecDraft, GreedyOutputEqualsPlainGreedy) {
  const LoadedModel& m = test::spec_model(GetParam());
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  cpu::GenerateRequest req;
  req.prompt = test::repetitive_prompt(21, 4, 3);
  req.max_new_tokens = 64;
  req.ignore_eos = true;
  const cpu::GenerateResult plain = cpu::generate(b, req);
  spec::DraftModelDrafter d(draft_for(GetParam()), req.sampling);
  const spec::SpecGenerateResult s = spec::speculative_generate(b, req, d, 2);
  EXPECT_EQ(s.result.tokens, plain.tokens);
  // The draft model always has a guess: every step drafts (at most 2), emitting at most 3.
  EXPECT_LE(s.stats.draft_tokens, 2 * s.stats.steps);
  EXPECT_GE(3 * s.stats.steps, 63);
}

INSTANTIATE_TEST_SUITE_P(Presets, SpecDraft, ::testing::Values("tiny", "tiny-k3.1"));

// Target hidden states of tokens[0, n) ([n][hidden]).
std::vector<float> target_hidden(const cpu::CpuBackbone& b, const std::vector<int64_t>& toks) {
  const auto H = static_cast<size_t>(b.config().hidden_size);
  cpu::DecodeState st = b.new_state();
  std::vector<float> logits(static_cast<size_t>(b.config().vocab_size)), out(toks.size() * H);
  for (size_t i = 0; i < toks.size(); ++i)
    b.step_hidden(st, toks[i], logits.data(), out.data() + i * H);
  return out;
}

TEST(SpecDraftDrafter, ProposalsDoNotDependOnHowHiddenStatesArrive) {
  const LoadedModel& m = test::spec_model("tiny");
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  const spec::DraftModel& dm = draft_for("tiny");
  const auto H = static_cast<size_t>(m.config.hidden_size);
  const uint64_t seed = test::test_seed();
  SCOPED_TRACE(test::seed_trace(seed));
  Rng r(seed);
  std::vector<int64_t> ctx;  // consumed tokens + the last sampled one
  for (int i = 0; i < 14; ++i)
    ctx.push_back(static_cast<int64_t>(r.next_u64() % static_cast<uint64_t>(m.config.vocab_size)));
  const std::vector<float> hid = target_hidden(b, ctx);  // [14][H]
  // Incremental: 8 consumed, propose (chains 3 entries, then drops them), 5 more, propose.
  spec::DraftModelDrafter inc(dm, {});
  inc.observe(hid.data(), 8);
  const auto first = inc.propose(std::span(ctx).first(9), 3);
  EXPECT_EQ(first.tokens.size(), 3u);
  EXPECT_TRUE(first.probs.empty());  // greedy drafts carry no distribution
  inc.observe(hid.data() + 8 * H, 5);
  const auto a = inc.propose(ctx, 3);
  // Fresh: all 13 hidden states at once.
  spec::DraftModelDrafter fresh(dm, {});
  fresh.observe(hid.data(), 13);
  const auto c = fresh.propose(ctx, 3);
  EXPECT_EQ(a.tokens, c.tokens);
  // Reporting fewer hidden states than consumed tokens is a caller bug, caught.
  spec::DraftModelDrafter short_of(dm, {});
  short_of.observe(hid.data(), 12);
  EXPECT_THROW(short_of.propose(ctx, 3), Error);
}

TEST(SpecDraftDrafter, SampledDraftsComeWithTheirDistributions) {
  const LoadedModel& m = test::spec_model("tiny");
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  const std::vector<int64_t> ctx = test::repetitive_prompt(5, 3, 3);
  const std::vector<float> hid = target_hidden(b, ctx);
  spec::DraftModelDrafter d(draft_for("tiny"), {0.9f, 40, 0.9f, 3});
  d.observe(hid.data(), static_cast<int64_t>(ctx.size()) - 1);
  const auto p = d.propose(ctx, 3);
  ASSERT_EQ(p.tokens.size(), 3u);
  ASSERT_EQ(p.probs.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    double sum = 0;
    for (double q : p.probs[i]) sum += q;
    EXPECT_NEAR(sum, 1.0, 1e-9);
    EXPECT_GT(p.probs[i][static_cast<size_t>(p.tokens[i])], 0.0);
  }
}

TEST(SpecDraftDrafter, RefusesADraftThatDoesNotFitTheTarget) {
  const auto dir = test::temp_dir("draft_misfit");
  const ModelConfig& target = test::spec_model("tiny").config;
  spec::synthesize_draft_checkpoint(target, dir.string(), 2);
  ModelConfig other = target;
  other.vocab_size += 1;
  EXPECT_THROW(spec::DraftModel::load(dir.string(), other), Error);
  std::filesystem::remove(dir / spec::kDraftHeadFile);
  EXPECT_THROW(spec::DraftModel::load(dir.string(), target), Error);
  // The target itself (with KDA layers) is not a draft.
  EXPECT_THROW(spec::DraftModel::load(test::spec_model("tiny").dir, target), Error);
}

// ---- the serving engine ----

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

std::vector<std::string> serve_texts(std::shared_ptr<const spec::DraftModel> draft) {
  serve::Metrics metrics;
  serve::EngineOptions eo;
  eo.max_num_seqs = 2;
  eo.max_num_batched_tokens = 8;  // prompts arrive in chunks: hidden states of every chunk count
  if (draft) {
    eo.speculative.method = "draft_model";
    eo.speculative.model = "(test)";
    eo.speculative.num_speculative_tokens = 2;
    eo.draft_model = std::move(draft);
  }
  serve::Engine engine(
      serve::make_cpu_backend(LoadedModel::load(test::spec_model("tiny").dir), {}, false, 2),
      std::make_shared<IdCodec>(), eo, metrics);
  std::vector<std::shared_ptr<serve::RequestStream>> streams;
  for (int i = 0; i < 3; ++i) {
    serve::GenerationRequest r;
    r.prompt = test::repetitive_prompt(30 + static_cast<uint64_t>(i), 3 + i, 3);
    r.max_tokens = 12;
    r.ignore_eos = true;
    if (i == 2) r.sampling = {0.8f, 0, 1.0f, 5};  // sampled alongside greedy: no interference
    streams.push_back(engine.submit(r));
  }
  std::vector<std::string> out;
  for (auto& s : streams) {
    std::string text;
    for (int k = 0; k < 3000; ++k) {
      serve::StreamEvent ev;
      if (!s->next(ev, 10ms)) continue;
      text += ev.text;
      if (ev.finished) {
        text += "|" + ev.finish_reason;
        break;
      }
    }
    out.push_back(text);
  }
  return out;
}

TEST(SpecDraftServe, GreedyTextEqualsPlainServing) {
  const ModelConfig& target = test::spec_model("tiny").config;
  const auto dir = test::temp_dir("draft_serve");
  spec::synthesize_draft_checkpoint(target, dir.string(), 11);
  std::shared_ptr<const spec::DraftModel> draft = spec::DraftModel::load(dir.string(), target);
  const auto plain = serve_texts(nullptr);
  const auto spec = serve_texts(draft);
  ASSERT_EQ(plain.size(), 3u);
  EXPECT_EQ(spec[0], plain[0]);
  EXPECT_EQ(spec[1], plain[1]);
  EXPECT_EQ(spec[2].substr(spec[2].size() - 7), "|length");  // sampled: same length, own draws
}

}  // namespace
}  // namespace k3
