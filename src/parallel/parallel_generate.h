// Generation over the multi-rank CPU backbone: one request on DP replica 0 (the other replicas
// run dummy steps), the same loop and stop rules as cpu::generate.
#pragma once

#include <functional>

#include "cpu/generate.h"
#include "parallel/parallel_backbone.h"

namespace k3::parallel {

cpu::GenerateResult generate(const ParallelCpuBackbone& model, const cpu::GenerateRequest& req,
                             const std::function<void(int64_t token)>& on_token = {});

}  // namespace k3::parallel
