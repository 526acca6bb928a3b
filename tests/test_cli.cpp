// The k3 binary as a user runs it: the README's generate command on the built-in tiny model,
// synth + inspect, and clear errors for bad input.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

#include "run_command.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;

using CliRun = k3::test::CommandResult;

CliRun run(const std::string& args, const std::string& env = "") {
  return k3::test::run_command(env + " " + std::string(K3_BINARY) + " " + args);
}

std::string temp(const std::string& name) {
  return k3::test::temp_dir("cli_" + name).string();
}

bool has(const CliRun& r, const std::string& s) {
  return r.output.find(s) != std::string::npos;
}

TEST(Cli, GenerateWithTheBuiltinTinyModel) {
  const std::string env = "K3_CACHE_DIR=" + temp("cache");
  const CliRun a = run("generate --max-tokens 8 --show-ids --ignore-eos", env);
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_TRUE(has(a, "synthesizing the built-in tiny model")) << a.output;
  EXPECT_TRUE(has(a, "8 tokens (length)")) << a.output;
  const CliRun b = run("generate --max-tokens 8 --show-ids --ignore-eos", env);
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_FALSE(has(b, "synthesizing")) << b.output;
  // Same greedy tokens from the cached model (the ids line is the first stdout line).
  auto ids = [](const std::string& out) {
    const size_t end = out.find(" \n");
    const size_t begin = out.rfind('\n', end == std::string::npos ? 0 : end);
    return out.substr(begin == std::string::npos ? 0 : begin + 1, end - begin);
  };
  EXPECT_EQ(ids(a.output), ids(b.output));
  const CliRun t = run("generate --max-tokens 4 --prompt hello --temperature 0.8 --seed 7", env);
  EXPECT_EQ(t.status, 0) << t.output;
}

TEST(Cli, SynthThenInspect) {
  const std::string dir = temp("synth");
  const CliRun s =
      run("synth --preset tiny-k3.1 --out " + dir + " --seed 3 --shard-size-gb 0.0002");
  ASSERT_EQ(s.status, 0) << s.output;
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  size_t shards = 0;
  for (const auto& e : fs::directory_iterator(dir))
    shards += e.path().extension() == ".safetensors";
  EXPECT_GE(shards, 2u) << "expected several shards of <= 200 KB";
  const CliRun i = run("inspect " + dir);
  ASSERT_EQ(i.status, 0) << i.output;
  EXPECT_TRUE(has(i, "6 KDA + 3 MLA (DSA indexer)")) << i.output;
  EXPECT_TRUE(has(i, "routed_experts")) << i.output;
  EXPECT_TRUE(has(i, "missing: 0")) << i.output;
  const CliRun again = run("synth --preset tiny --out " + dir);
  EXPECT_EQ(again.status, 1);
  EXPECT_TRUE(has(again, "is not empty (use --force)")) << again.output;
  // Generating from the synthesized K3.1 checkpoint exercises the DSA path end to end.
  const CliRun g = run("generate --model " + dir + " --max-tokens 4 --ignore-eos");
  EXPECT_EQ(g.status, 0) << g.output;
}

TEST(Cli, BadInputGetsAClearError) {
  const std::string env = "K3_CACHE_DIR=" + temp("cache_err");
  const CliRun b = run("generate --decode-backend fast", env);
  EXPECT_EQ(b.status, 1);
  EXPECT_TRUE(has(b, "Supported decode_backend values are auto/latency_specialized")) << b.output;
  const CliRun m = run("generate --model /nonexistent/k3");
  EXPECT_EQ(m.status, 1);
  EXPECT_TRUE(has(m, "/nonexistent/k3")) << m.output;
  const CliRun p = run("generate --prompt-ids 1,x,3", env);
  EXPECT_EQ(p.status, 1);
  EXPECT_TRUE(has(p, "token id \"x\"")) << p.output;
  const CliRun u = run("synth --preset huge --out " + temp("huge"));
  EXPECT_EQ(u.status, 1);
  EXPECT_TRUE(has(u, "unknown synth preset \"huge\"")) << u.output;
  EXPECT_EQ(run("frobnicate").status, 2);  // usage error
  const CliRun i = run("inspect " + temp("empty_dir"));
  EXPECT_EQ(i.status, 1) << i.output;
}

}  // namespace
