// `k3 diff`'s hook into the CUDA layer: the specialized vs stock per-layer diff
// (cuda/step_diff.h) runs on the GPU, but the CLI lives in the CUDA-free engine library. So
// binaries built with CUDA install the runner from main() (src/cli/main.cpp), as they do the
// CUDA step backend; without it `k3 diff` says it needs a CUDA GPU.
#pragma once

#include <cstdint>
#include <ostream>
#include <vector>

namespace k3 {
struct LoadedModel;
}

namespace k3::cli {

// Default per-sublayer (and logits) rel L2 bound. The two paths launch the same GEMMs and mix +
// norm kernel, so they are expected bit-identical (all zeros); the bound is what a summation
// order change would cost, should one come back: ~1e-3 typical on bf16 boundaries, amplified
// ~25x over the random tiny K3 model's 9 layers (measured up to 2.1e-2 on its last sublayer
// when the paths' GEMMs differed, against a bf16 noise floor of ~0.3: the fp32 CPU reference's
// distance from the bf16 one).
constexpr double kDefaultStepDiffTolerance = 5e-2;

struct StepDiffArgs {
  int steps = 64;               // generated tokens (after the teacher-forced prompt)
  std::vector<int32_t> prompt;  // token ids, at least one
  double tolerance = kDefaultStepDiffTolerance;
  bool verbose = false;  // per-step lines as well as the table
  // GEMM plans measured on the GPU (as the engine runs) instead of the planner's model picks.
  // Off by default, so the report does not depend on timings. The two paths launch the same
  // GEMMs, so either way each shape runs one plan in both and they agree bit for bit (both
  // modes were bit-identical on the three tiny presets: bench/RESULTS.md, fourteenth stop).
  bool measured_plans = false;
};

// Prints the report to out; true when it is within tolerance (the exit status 0 of `k3 diff`).
using StepDiffRunner = bool (*)(const LoadedModel& model, const StepDiffArgs& args,
                                std::ostream& out);
void set_step_diff_runner(StepDiffRunner runner);

}  // namespace k3::cli
