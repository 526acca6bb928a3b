// The verify step on the CPU reference: its q logit rows equal token-by-token decoding, and
// after committing any accepted prefix (0..n drafts) the decode state is bit-identical to the
// state after decoding only those tokens (KDA recurrent + conv state, MLA latent and DSA
// index-key caches, position), so decoding continues identically.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "cpu/backbone.h"
#include "spec/verify_cpu.h"
#include "spec_test_models.h"

namespace k3 {
namespace {

std::vector<float> load(const cpu::StateBuffer& b) {
  std::vector<float> v(b.size());
  if (b.size() > 0) b.load(v.data());
  return v;
}

// Bitwise equality of two float vectors (NaN-safe, -0 != +0).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), 4 * a.size()) == 0;
}

void expect_same_state(const cpu::DecodeState& a, const cpu::DecodeState& b, int accepted) {
  SCOPED_TRACE("accepted " + std::to_string(accepted));
  ASSERT_EQ(a.position, b.position);
  ASSERT_EQ(a.kda.size(), b.kda.size());
  for (size_t l = 0; l < a.kda.size(); ++l) {
    EXPECT_TRUE(same_bits(load(a.kda[l].recurrent), load(b.kda[l].recurrent))) << "layer " << l;
    EXPECT_TRUE(same_bits(load(a.kda[l].conv), load(b.kda[l].conv))) << "layer " << l;
    EXPECT_TRUE(same_bits(a.mla[l].latent, b.mla[l].latent)) << "layer " << l;
    EXPECT_EQ(a.mla[l].index_keys, b.mla[l].index_keys) << "layer " << l;
    EXPECT_TRUE(same_bits(a.mla[l].index_scales, b.mla[l].index_scales)) << "layer " << l;
  }
}

class SpecState : public ::testing::TestWithParam<const char*> {};

TEST_P(SpecState, CommitEqualsDecodingOnlyTheAcceptedTokens) {
  const LoadedModel& m = test::spec_model(GetParam());
  // bf16 recurrent state too, so a snapshot must carry exactly the rounded stored values.
  for (const cpu::StateDtypes dt :
       {cpu::StateDtypes{DType::BF16, DType::F32}, cpu::StateDtypes{DType::F16, DType::BF16}}) {
    const cpu::CpuBackbone b(m.config, m.weights, dt);
    const uint64_t seed = test::test_seed();
    SCOPED_TRACE(test::seed_trace(seed));
    Rng r(seed);
    const auto vocab = static_cast<size_t>(m.config.vocab_size);
    constexpr int kDrafts = 4;
    std::vector<int64_t> prompt, rows;  // rows: last sampled token + kDrafts drafts
    for (int i = 0; i < 11; ++i) prompt.push_back(static_cast<int64_t>(r.next_u64() % vocab));
    for (int i = 0; i <= kDrafts; ++i) rows.push_back(static_cast<int64_t>(r.next_u64() % vocab));
    const int64_t probe = static_cast<int64_t>(r.next_u64() % vocab);  // decoded after commit

    cpu::DecodeState base = b.new_state();
    b.prefill(base, prompt);
    // Token-by-token reference: the state and logits after each row.
    std::vector<cpu::DecodeState> ref;
    std::vector<std::vector<float>> ref_logits;
    cpu::DecodeState walk = base;
    for (int64_t t : rows) {
      std::vector<float> l(vocab);
      b.step(walk, t, l.data());
      ref.push_back(walk);
      ref_logits.push_back(l);
    }
    spec::VerifyScratch scratch;
    for (int a = 0; a <= kDrafts; ++a) {
      cpu::DecodeState st = base;
      std::vector<float> logits(rows.size() * vocab, std::nanf(""));  // [q][vocab]
      spec::cpu_verify(b, st, rows, logits.data(), scratch);          // scratch reused across a
      for (size_t i = 0; i < rows.size(); ++i)
        ASSERT_TRUE(same_bits({logits.begin() + i * vocab, logits.begin() + (i + 1) * vocab},
                              ref_logits[i]))
            << "row " << i;
      spec::cpu_commit(st, scratch, 1 + a);
      expect_same_state(st, ref[static_cast<size_t>(a)], a);
      // And decoding goes on from there exactly as without speculation.
      cpu::DecodeState after_ref = ref[static_cast<size_t>(a)];
      std::vector<float> l1(vocab), l2(vocab);
      b.step(st, probe, l1.data());
      b.step(after_ref, probe, l2.data());
      EXPECT_TRUE(same_bits(l1, l2)) << "accepted " << a;
      expect_same_state(st, after_ref, a);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, SpecState, ::testing::Values("tiny", "tiny-k3.1"));

TEST(SpecCommit, RefusesWhatNoVerifyStepProduced) {
  const LoadedModel& m = test::spec_model("tiny");
  const cpu::CpuBackbone b(m.config, m.weights, {DType::BF16, DType::F32});
  cpu::DecodeState st = b.new_state();
  b.prefill(st, {1, 2, 3});
  spec::VerifyScratch sc;
  std::vector<float> logits(2 * static_cast<size_t>(m.config.vocab_size));
  const std::vector<int64_t> rows = {4, 5};
  spec::cpu_verify(b, st, rows, logits.data(), sc);
  EXPECT_THROW(spec::cpu_commit(st, sc, 0), Error);
  EXPECT_THROW(spec::cpu_commit(st, sc, 3), Error);
  EXPECT_THROW(st.truncate(st.position + 1), Error);
  spec::cpu_commit(st, sc, 1);
  EXPECT_EQ(st.position, 4);
}

}  // namespace
}  // namespace k3
