// `k3 diff` where it cannot run: without a GPU (or in a build without CUDA) it says so clearly
// and exits 1 before touching any model; bad options are usage errors (2). The diff itself is
// tested on the GPU (tests/gpu/test_cuda_diff.cu).
#include <gtest/gtest.h>

#include <string>

#include "run_command.h"
#include "test_util.h"

namespace {

k3::test::CommandResult run_k3(const std::string& args) {
  // No visible GPU even on a GPU host; a private cache so nothing is synthesized elsewhere.
  const std::string env =
      "CUDA_VISIBLE_DEVICES= K3_CACHE_DIR=" + k3::test::temp_dir("cli_diff_cache").string();
  return k3::test::run_command(env + " " + std::string(K3_BINARY) + " " + args);
}

bool has(const k3::test::CommandResult& r, const std::string& s) {
  return r.output.find(s) != std::string::npos;
}

TEST(CliDiff, WithoutAGpuGivesAClearError) {
  for (const std::string args :
       {"diff", "diff --model tiny-kimi-linear --steps 4", "diff --measured-plans --steps 4"}) {
    const auto r = run_k3(args);
    EXPECT_EQ(r.status, 1) << args << ": " << r.output;
    EXPECT_TRUE(has(r, "k3 diff needs a CUDA GPU")) << args << ": " << r.output;
    EXPECT_FALSE(has(r, "synthesizing")) << args << ": the GPU is checked before the model";
  }
}

TEST(CliDiff, BadOptionsAreUsageErrors) {
  EXPECT_EQ(run_k3("diff --steps 0").status, 2);
  EXPECT_EQ(run_k3("diff --tolerance -1").status, 2);
  EXPECT_EQ(run_k3("diff --frobnicate").status, 2);
  const auto h = run_k3("diff --help");
  EXPECT_EQ(h.status, 0) << h.output;
  for (const char* opt : {"--model", "--steps", "--prompt", "--tolerance", "--measured-plans"})
    EXPECT_TRUE(has(h, opt)) << opt << " missing from:\n" << h.output;
}

}  // namespace
