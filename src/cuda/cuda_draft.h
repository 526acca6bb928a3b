// The draft-model drafter on the GPU (speculative_config method draft_model with the CUDA
// backend): the draft's dense MLA body runs as a CudaBackbone whose layer-0 input is the draft
// head's fusion (FusedInputWeights), one slot per request. A drafter follows the CPU
// DraftModelDrafter (spec/draft_model.h) entry for entry: the target's new hidden states feed
// the real entries (one run of rows per step), the chained entries run one row per step, and
// are dropped afterwards by moving the slot's position back (a dense MLA draft has no KDA state,
// so its cache past the position is dead). With latency_specialized the chained single-row step
// runs the specialized path, captured as a graph.
#pragma once

#include <memory>
#include <vector>

#include "cpu/sampling.h"
#include "cuda/backbone.h"
#include "spec/draft_model.h"
#include "spec/drafter.h"

namespace k3::cuda {

class CudaDraftModel {
 public:
  // slots: requests drafting at once; max_context: the target's context (chained entries are
  // cut to it); specialized: capture the single-row step as a specialized graph.
  CudaDraftModel(std::unique_ptr<spec::DraftModel> model, int slots, int64_t max_context,
                 bool specialized);
  ~CudaDraftModel();
  CudaDraftModel(const CudaDraftModel&) = delete;
  CudaDraftModel& operator=(const CudaDraftModel&) = delete;

  // A drafter on a free slot (k3::Error when every slot drafts); the slot returns when the
  // drafter is destroyed.
  std::unique_ptr<spec::Drafter> make_drafter(const cpu::SamplingParams& sampling);

  const spec::DraftModel& model() const { return *model_; }
  CudaBackbone& backbone() { return *bb_; }

 private:
  friend class CudaDraftDrafter;
  std::unique_ptr<spec::DraftModel> model_;
  std::unique_ptr<CudaBackbone> bb_;
  // Slots no drafter holds; shared with the drafters, which may outlive the model (they touch
  // it only to give their slot back).
  std::shared_ptr<std::vector<int>> free_ = std::make_shared<std::vector<int>>();
};

}  // namespace k3::cuda
