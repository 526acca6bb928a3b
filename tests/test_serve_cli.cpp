// `k3 serve` refuses, with a clear message and exit status 1, what this build cannot serve;
// on SIGTERM it shuts down cleanly (exit 0).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include "run_command.h"
#include "test_util.h"

namespace {

using Run = k3::test::CommandResult;

Run serve(const std::string& args) {
  const std::string env = "K3_CACHE_DIR=" + k3::test::temp_dir("serve_cli").string();
  return k3::test::run_command(env + " timeout -s TERM 20 " + K3_BINARY + " serve " + args);
}

void expect_refusal(const std::string& args, const std::string& message) {
  const Run r = serve(args);
  EXPECT_EQ(r.status, 1) << args << "\n" << r.output;
  EXPECT_NE(r.output.find(message), std::string::npos) << args << "\n" << r.output;
}

TEST(ServeCli, RefusesWhatThisBuildCannotServe) {
  expect_refusal(R"(--speculative-config '{"method": "ngram", "num_speculative_tokens": 2, )"
                 R"("prompt_lookup_min": 3, "prompt_lookup_max": 2}')",
                 "prompt_lookup_min/prompt_lookup_max must satisfy");
  expect_refusal(R"(--additional-config '{"decode_backend": "latency_specialized"}')",
                 "latency_specialized");
  expect_refusal(R"(--additional-config '{"nonsense": 1}')", "nonsense");
  expect_refusal("--additional-config '{oops'", "--additional-config is not valid JSON");
  expect_refusal(R"(--additional-config '{"max_num_seqs": 4}' --max-num-seqs 8)", "contradicts");
  expect_refusal("--max-model-len 100000000", "max_model_len");
  EXPECT_EQ(serve("--port 70000").status, 2);  // a usage error
}

TEST(ServeCli, StopsCleanlyOnSigterm) {
  // Started in the background, sent SIGTERM once it listens; `wait` gives its exit status.
  const auto dir = k3::test::temp_dir("serve_term");
  const std::string log = (dir.parent_path() / (dir.filename().string() + ".log")).string();
  const std::string cmd =
      "K3_CACHE_DIR=" + dir.string() + " " + K3_BINARY + " serve --port 0 >" + log +
      " 2>&1 & pid=$!; for i in $(seq 300); do grep -q listening " + log +
      " && break; sleep 0.1; done; kill -TERM $pid; wait $pid; echo rc=$?; cat " + log;
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  pclose(p);
  EXPECT_NE(out.find("rc=0"), std::string::npos) << out;
  EXPECT_NE(out.find("listening on http://127.0.0.1:"), std::string::npos) << out;
  EXPECT_NE(out.find("shutting down"), std::string::npos) << out;
}

}  // namespace
