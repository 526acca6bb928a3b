// The target distribution p that speculative sampling accepts against: the request's sampling
// pipeline (src/cpu/sampling.cpp: temperature -> top-k -> softmax -> top-p -> renormalise) as
// a full probability vector instead of one draw.
#pragma once

#include <cstdint>
#include <vector>

#include "core/rng.h"
#include "cpu/sampling.h"

namespace k3::spec {

// logits: [vocab] fp32. Returns [vocab] probabilities summing to 1; zero outside the kept set.
// Greedy (temperature 0): one-hot on cpu::argmax (lowest id on ties).
std::vector<double> target_probs(const float* logits, int64_t vocab,
                                 const cpu::SamplingParams& params);

// One draw from probs[vocab] (need not be normalised; total mass > 0) by inverse CDF in id
// order, from a uniform u in [0, 1). Never returns a zero-probability id.
int64_t draw_from(const std::vector<double>& probs, double u);

}  // namespace k3::spec
