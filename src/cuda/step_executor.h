// What the serving backend (cuda_step_backend.cpp) drives: a decode-step executor over request
// slots. CudaBackbone is one (the whole model on this GPU); RankedBackbone (rank_group.h) is the
// ranks of a multi-rank layout behind the same calls, so serving, generation and speculative
// verify run on either.
#pragma once

#include <cstdint>
#include <span>

namespace k3::cuda {

// Which executor runs a step. Both read and write the same state and boundary tensors, so they
// interleave freely step by step.
enum class StepPath {
  Stock,        // decode_backend = auto: one kernel per op (backbone.cu, backbone_layers.cu)
  Specialized,  // latency_specialized: fused providers, PDL-chained graphs (backbone_fused.cu)
};

class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual int slots() const = 0;               // request slots
  virtual int64_t max_context() const = 0;     // tokens per slot
  virtual int max_rows() const = 0;            // rows per step
  virtual bool specialized_ready() const = 0;  // latency_specialized steps can run
  virtual int max_capture_rows() const = 0;    // the largest specialized step (0: none)

  // Zeroes a slot for a new request (ordered before the next step).
  virtual void reset_slot(int slot) = 0;
  virtual int64_t position(int slot) const = 0;  // tokens the slot has consumed
  // Speculative verify: KDA state copies per slot (grow only), restore one, move a position back.
  virtual void reserve_snapshots(int n) = 0;
  virtual void restore_kda(int slot, int index) = 0;
  virtual void set_position(int slot, int64_t position) = 0;

  // One step, asynchronous: row r feeds tokens[r] into slot slots[r]; the rows of one slot are
  // consecutive (a run: the request's next tokens in order). keep_kda_states: each run's KDA
  // state after its row t < run - 1 is kept as snapshot t of its slot.
  virtual void step(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                    StepPath path = StepPath::Stock, bool keep_kda_states = false) = 0;
  // Waits for the step and copies the logits of step row rows[i] to out[i] ([vocab] fp32 each).
  virtual void logits_rows_to_host(std::span<const int64_t> rows, std::span<float* const> out) = 0;
  // Waits for the step and copies the rows' final-normed hidden states ([rows][hidden] fp32).
  virtual void hidden_to_host(int64_t rows, float* out) = 0;
};

// The checks every step's rows get, before anything is enqueued: 1..max_rows rows, a token per
// row within the vocabulary, slots within [0, positions.size()), a slot's rows consecutive (one
// run per slot per step) and each run within max_context after positions[slot]. Returns the
// longest run, a padding slot's excluded (it keeps no snapshots). k3::Error names the problem.
int64_t check_step_rows(std::span<const int32_t> slots, std::span<const int32_t> tokens,
                        int max_rows, int64_t vocab, std::span<const int64_t> positions,
                        int64_t max_context, int padding_slot = -1);

}  // namespace k3::cuda
