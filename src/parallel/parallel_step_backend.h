// The serving engine's StepBackend over the multi-rank CPU backbone (`k3 serve
// --tensor-parallel-size N ...` on the CPU): requests are spread over the DP replicas round
// robin, and a forward call runs its rows' tokens position by position, each position one
// lockstep step of every rank.
#pragma once

#include <memory>

#include "parallel/layout.h"
#include "serve/step_backend.h"

namespace k3::parallel {

std::unique_ptr<serve::StepBackend> make_parallel_cpu_backend(std::unique_ptr<LoadedModel> model,
                                                              const DeployConfig& deploy,
                                                              const ParallelLayout& layout);

}  // namespace k3::parallel
