// What the serving engine needs from an executor: per-request decode states and one batched
// forward step. The CPU reference implements it today; the CUDA executor plugs in behind the
// same interface (one launch for the whole batch instead of a loop).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace k3 {
struct DeployConfig;
struct LoadedModel;
struct ModelConfig;
struct SpeculativeConfig;
}  // namespace k3

namespace k3::cpu {
struct SamplingParams;
}  // namespace k3::cpu
namespace k3::spec {
class Drafter;
}  // namespace k3::spec

namespace k3::serve {

// One request's decode state (KV / latent caches, KDA recurrent state) in a backend's format.
class SlotState {
 public:
  virtual ~SlotState() = default;
  // Back to an empty context, keeping allocations: a slot is reused by the next request.
  virtual void reset() = 0;
  virtual int64_t position() const = 0;  // tokens consumed so far
};

// One row of a step: feed `tokens` in order into `state`; when `logits` is set, write the
// logits after the last token there ([vocab] fp32). Prefill rows carry a chunk of the prompt,
// decode rows the one token sampled last step.
struct StepRow {
  SlotState* state = nullptr;
  std::span<const int64_t> tokens;
  float* logits = nullptr;
  // Optional ([tokens][hidden] fp32): the final-normed hidden state after each token, which a
  // speculative draft model reads. Backends without it refuse draft-model speculation.
  float* hidden = nullptr;
};

// One request's speculative verify step: feed `tokens` (q = 1 + drafts: the last sampled token,
// then the drafts) in order into `state` and write the logits after every token to `logits`
// ([q][vocab] fp32). The backend keeps what it needs to commit an accepted prefix afterwards.
struct VerifyRow {
  SlotState* state = nullptr;
  std::span<const int64_t> tokens;
  float* logits = nullptr;
  float* hidden = nullptr;  // optional [q][hidden] fp32, as StepRow::hidden
};

class StepBackend {
 public:
  virtual ~StepBackend() = default;
  virtual const ModelConfig& config() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_context() const = 0;  // tokens per request the states hold
  virtual std::unique_ptr<SlotState> new_state() const = 0;
  // Runs every row. An exception means the states of all rows in this call are undefined.
  virtual void forward(std::span<const StepRow> rows) = 0;

  // Speculative decoding. Backends without it keep these defaults: supports_verify() false, and
  // verify / commit raise k3::Error "speculative decoding is not supported by this backend".
  virtual bool supports_verify() const { return false; }
  // Runs every verify row (as forward: an exception leaves the rows' states undefined).
  virtual void verify(std::span<const VerifyRow> rows);
  // One engine step: the plain rows and the verify rows (each may be empty). The default runs
  // forward(rows) then verify(vrows); a batched executor runs them as one step where it can.
  virtual void step(std::span<const StepRow> rows, std::span<const VerifyRow> vrows);
  // After verify: keep the first `consumed` tokens of the state's last verify row (1 <= consumed
  // <= q); the state then equals the state after exactly those tokens.
  virtual void commit(SlotState& state, int64_t consumed);
  // A drafter of the backend's own for one request (the draft model on the GPU beside a CUDA
  // target), or null, the default: the caller then makes the generic one (spec::make_drafter).
  virtual std::unique_ptr<spec::Drafter> make_drafter(const SpeculativeConfig& cfg,
                                                      const cpu::SamplingParams& sampling);
};

// The CPU reference backbone; owns the model (the backbone holds references into it). State
// dtypes and the context limit come from the deployment, validated by the caller (as in
// `k3 generate`). fp32: pure fp32 activations instead of bf16 rounding at boundaries.
// threads: rows of a step run in parallel on this many threads (0: one per core).
std::unique_ptr<StepBackend> make_cpu_backend(std::unique_ptr<LoadedModel> model,
                                              const DeployConfig& deploy, bool fp32 = false,
                                              int threads = 0);

// The CUDA executor (decode_backend auto on the GPU). Binaries built with CUDA register its
// factory at start-up (src/cli/main.cpp); the engine library itself does not link CUDA.
using BackendFactory = std::unique_ptr<StepBackend> (*)(std::unique_ptr<LoadedModel> model,
                                                        const DeployConfig& deploy);
void set_cuda_backend_factory(BackendFactory factory);
bool have_cuda_backend();
// Raises k3::Error when this binary has no CUDA backend.
std::unique_ptr<StepBackend> make_cuda_backend(std::unique_ptr<LoadedModel> model,
                                               const DeployConfig& deploy);

// Multi-process CUDA runs (one process per GPU): rank 0's CUDA backend leads; every other rank
// runs the follower, registered beside the factory, until rank 0 stops.
using FollowerRunner = void (*)(std::unique_ptr<LoadedModel> model, const DeployConfig& deploy);
void set_cuda_follower(FollowerRunner runner);
// Raises k3::Error when this binary has no CUDA backend.
void run_cuda_follower(std::unique_ptr<LoadedModel> model, const DeployConfig& deploy);

}  // namespace k3::serve
