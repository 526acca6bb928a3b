// Autoregressive generation over the CPU backbone: prefill the prompt, then sample one token
// per step until max_new_tokens or an end-of-sequence token.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cpu/backbone.h"
#include "cpu/sampling.h"

namespace k3::cpu {

struct GenerateRequest {
  std::vector<int64_t> prompt;
  int max_new_tokens = 32;
  SamplingParams sampling;
  bool ignore_eos = false;
};

struct GenerateResult {
  std::vector<int64_t> tokens;  // generated tokens (the eos token included when it ended the run)
  std::string finish_reason;    // "stop" (eos) | "length"
  double prefill_seconds = 0, decode_seconds = 0;
};

GenerateResult generate(const CpuBackbone& model, const GenerateRequest& req,
                        const std::function<void(int64_t token)>& on_token = {});

// The loop every executor shares (CPU reference, multi-rank, any StepBackend): checks the request
// against the context, calls prefill(prompt, logits) once, then samples with the request's seeded
// Sampler, emits, stops on eos (unless ignore_eos) or max_new_tokens, and calls step(token,
// logits) for the next one. logits: [vocab] fp32.
using PrefillFn = std::function<void(const std::vector<int64_t>& prompt, float* logits)>;
using StepFn = std::function<void(int64_t token, float* logits)>;
GenerateResult generate_loop(const GenerateRequest& req, int64_t vocab,
                             const std::vector<int64_t>& eos_ids, int64_t max_context,
                             const PrefillFn& prefill, const StepFn& step,
                             const std::function<void(int64_t token)>& on_token);

}  // namespace k3::cpu
