// The verify step on the CPU reference: a request consumes q = 1 + n tokens (its last sampled
// token, then n drafts) in order and yields q logit rows. The KDA state after each row but the
// last is kept, so committing an accepted prefix restores that snapshot and truncates the MLA /
// DSA caches: the state then equals the state after decoding exactly the accepted tokens,
// without recomputing anything.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cpu/backbone.h"
#include "cpu/decode_state.h"

namespace k3::spec {

// Per-request memory of the last verify step (reused across steps; buffers keep their size).
struct VerifyScratch {
  int64_t start = 0;                    // state.position before the verify step
  int64_t rows = 0;                     // q of the last verify step
  std::vector<cpu::KdaSnapshot> snaps;  // [q - 1]: KDA state after rows 0 .. q - 2
};

// tokens: [q] (q >= 1); logits: [q][vocab] fp32; hidden (optional): [q][hidden] fp32, the
// final-normed hidden state after each token (what a draft model reads).
void cpu_verify(const cpu::CpuBackbone& model, cpu::DecodeState& state,
                std::span<const int64_t> tokens, float* logits, VerifyScratch& scratch,
                float* hidden = nullptr);

// Keeps the first `consumed` tokens of the last verify step (1 <= consumed <= q): the last sampled
// token plus the accepted drafts.
void cpu_commit(cpu::DecodeState& state, const VerifyScratch& scratch, int64_t consumed);

}  // namespace k3::spec
