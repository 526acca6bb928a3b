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

}  // namespace k3::cpu
