// `k3 generate --speculative-config` as a user runs it: the same greedy ids as without, the
// acceptance summary on stderr, and clear errors for what cannot run.
#include <gtest/gtest.h>

#include <string>

#include "run_command.h"
#include "spec_test_models.h"

namespace {

using k3::test::CommandResult;

CommandResult generate(const std::string& model, const std::string& args) {
  return k3::test::run_command(std::string(K3_BINARY) + " generate --model " + model + " " + args);
}

// The generated ids: the first line that is not a "k3:" summary, cut where stderr's summary
// (interleaved, since stdout is not a terminal) begins.
std::string ids_line(const std::string& out) {
  for (size_t at = 0, nl; (nl = out.find('\n', at)) != std::string::npos; at = nl + 1) {
    std::string line = out.substr(at, nl - at);
    if (line.empty() || line.rfind("k3:", 0) == 0) continue;
    line = line.substr(0, line.find("k3:"));
    while (!line.empty() && line.back() == ' ') line.pop_back();
    return line;
  }
  return {};
}

TEST(SpecCli, GenerateWithSpeculationPrintsTheSameIdsAndTheAcceptance) {
  const std::string model = k3::test::spec_model("tiny").dir;
  const std::string base = "--prompt-ids 5,9,23,7,5,9,23,7 --max-tokens 12 --show-ids --ignore-eos";
  const CommandResult plain = generate(model, base);
  ASSERT_EQ(plain.status, 0) << plain.output;
  const CommandResult spec = generate(
      model, base + R"( --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}')");
  ASSERT_EQ(spec.status, 0) << spec.output;
  EXPECT_FALSE(ids_line(plain.output).empty()) << plain.output;
  EXPECT_EQ(ids_line(spec.output), ids_line(plain.output));
  EXPECT_NE(spec.output.find("k3: speculative ngram: "), std::string::npos) << spec.output;
  EXPECT_NE(spec.output.find("mean acceptance length"), std::string::npos) << spec.output;

  const CommandResult bad =
      generate(model, base + R"( --speculative-config '{"method": "draft_model", )"
                             R"("num_speculative_tokens": 2, "model": "/nonexistent"}')");
  EXPECT_EQ(bad.status, 1) << bad.output;
  EXPECT_NE(bad.output.find("/nonexistent"), std::string::npos) << bad.output;
  const CommandResult json = generate(model, base + " --speculative-config '{oops'");
  EXPECT_EQ(json.status, 1);
  EXPECT_NE(json.output.find("--speculative-config is not valid JSON"), std::string::npos);
}

}  // namespace
