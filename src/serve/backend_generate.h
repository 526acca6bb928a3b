// Generation over any StepBackend (the CUDA executor in `k3 generate --device cuda`): the same
// loop as cpu::generate (prefill, then sample one token per step until max_new_tokens or eos),
// sampling on the host with the request's seeded Sampler, so a (seed, logits) pair gives the
// same token on every backend.
#pragma once

#include <functional>

#include "cpu/generate.h"
#include "serve/step_backend.h"

namespace k3::serve {

cpu::GenerateResult generate_on(StepBackend& backend, const cpu::GenerateRequest& req,
                                const std::function<void(int64_t token)>& on_token = {});

}  // namespace k3::serve
