// Generation over any StepBackend (the CUDA executor in `k3 generate --device cuda`): the same
// loop as cpu::generate (prefill, then sample one token per step until max_new_tokens or eos),
// sampling on the host with the request's seeded Sampler, so a (seed, logits) pair gives the
// same token on every backend. Speculative generation runs the same way over the backend's
// verify step.
#pragma once

#include <functional>

#include "cpu/generate.h"
#include "serve/step_backend.h"
#include "spec/spec_generate.h"

namespace k3::serve {

cpu::GenerateResult generate_on(StepBackend& backend, const cpu::GenerateRequest& req,
                                const std::function<void(int64_t token)>& on_token = {});

// spec::speculative_generate with the backend's verify / commit (k3::Error when the backend has
// no verify step).
spec::SpecGenerateResult speculative_generate_on(
    StepBackend& backend, const cpu::GenerateRequest& req, spec::Drafter& drafter,
    int num_speculative_tokens, const std::function<void(int64_t token)>& on_token = {});

}  // namespace k3::serve
