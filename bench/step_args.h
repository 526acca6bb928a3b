// k3_bench_step's command line (bench_step.cu says what each flag does).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace k3::bench {

// The flags, defaults as documented in bench_step.cu.
struct StepArgs {
  int layers = 8, tp = 16, ep = 16, replays = 20, template_layers = 8;
  int flip_repeats = 1;  // timings of each flip, each between two of the defaults
  bool dsa = false, profile = true, tuning = true, trace = false, flips = true;
  std::vector<std::string> paths = {"stock", "specialized"};
  std::vector<int> batches = {1, 8, 64};
  std::vector<int64_t> contexts = {1024, 32768};
  std::vector<int> verify_q = {2, 4, 8};  // speculative verify rows at batch 1 (empty: none)
  std::string dir;
  std::string flips_matching;  // empty: every flip
};

// Throws k3::Error on an unknown flag.
StepArgs parse_step_args(int argc, char** argv);

}  // namespace k3::bench
