#include "cuda/cuda_draft.h"

#include <algorithm>
#include <span>

#include "core/error.h"
#include "core/rng.h"

namespace k3::cuda {

// One request's drafter (the CPU DraftModelDrafter's entries and order, steps on the GPU).
class CudaDraftDrafter final : public spec::Drafter {
 public:
  CudaDraftDrafter(CudaDraftModel& owner, int slot, const cpu::SamplingParams& sampling)
      : free_(owner.free_),
        bb_(*owner.bb_),
        slot_(slot),
        sampling_(sampling),
        rng_(sampling.seed ^ 0xd2af7ull),
        H_(owner.model_->hidden_size()),
        V_(owner.model_->vocab_size()),
        logits_(static_cast<size_t>(V_)),
        hidden_(static_cast<size_t>(H_)) {
    bb_.reset_slot(slot_);
  }
  ~CudaDraftDrafter() override { free_->push_back(slot_); }

  bool needs_hidden() const override { return true; }
  void observe(const float* hidden, int64_t n) override {
    pending_.insert(pending_.end(), hidden, hidden + n * H_);  // [n][H]
    observed_ += n;
  }

  spec::DraftTokens propose(std::span<const int64_t> ctx, int n) override {
    const int64_t consumed = static_cast<int64_t>(ctx.size()) - 1;  // the last is not consumed
    K3_CHECK(observed_ == consumed, "draft model: ", observed_,
             " target hidden states reported for ", consumed, " consumed tokens");
    if (consumed >= bb_.max_context()) {  // past the draft's context: no more drafts
      pending_.clear();
      return {};
    }
    // Real entries (x[i+1], h[i]) for every target token not fed yet, as runs of rows.
    const int64_t first = bb_.position(slot_);
    for (int64_t i = first; i < consumed;) {
      const int64_t k = std::min<int64_t>(consumed - i, bb_.max_rows());
      std::vector<int32_t> slots(static_cast<size_t>(k), slot_), toks;
      for (int64_t j = 0; j < k; ++j) toks.push_back(static_cast<int32_t>(ctx[i + j + 1]));
      run(slots, toks, pending_.data() + (i - first) * H_);
      i += k;
    }
    pending_.clear();
    spec::DraftTokens d;
    n = static_cast<int>(std::min<int64_t>(n, bb_.max_context() - bb_.position(slot_)));
    if (n <= 0 || bb_.position(slot_) == 0) return d;
    // Chained entries: the draft's own hidden state stands in for the target's.
    std::vector<float> logits = logits_, hidden = hidden_;
    int64_t tok = spec::pick_draft_token(logits.data(), V_, sampling_, rng_, d);
    for (int k = 1; k < n; ++k) {
      const int32_t s = slot_, t = static_cast<int32_t>(tok);
      run({&s, 1}, {&t, 1}, hidden.data(), &logits, &hidden);
      tok = spec::pick_draft_token(logits.data(), V_, sampling_, rng_, d);
    }
    bb_.set_position(slot_, consumed);  // drop the chained entries
    return d;
  }

 private:
  // One step of rows (a run of this slot); the logits and hidden state after its last row go
  // to logits / hidden (default: the drafter's state after the real entries).
  void run(std::span<const int32_t> slots, std::span<const int32_t> toks, const float* in,
           std::vector<float>* logits = nullptr, std::vector<float>* hidden = nullptr) {
    const int64_t k = static_cast<int64_t>(slots.size());
    const StepPath path = bb_.specialized_ready() && k <= bb_.max_capture_rows()
                              ? StepPath::Specialized
                              : StepPath::Stock;
    bb_.step_fused(slots, toks, in, path);
    float* out = (logits ? *logits : logits_).data();
    const int64_t last = k - 1;
    bb_.logits_rows_to_host({&last, 1}, {&out, 1});
    std::vector<float> all(static_cast<size_t>(k * H_));
    bb_.hidden_to_host(k, all.data());
    std::copy(all.end() - H_, all.end(), (hidden ? *hidden : hidden_).begin());
  }

  std::shared_ptr<std::vector<int>> free_;
  CudaBackbone& bb_;
  int slot_;
  cpu::SamplingParams sampling_;
  Rng rng_;
  int64_t H_, V_;
  int64_t observed_ = 0;        // target hidden states reported so far
  std::vector<float> pending_;  // [observed - fed][H]: not yet fed
  std::vector<float> logits_;   // [V] after the last real entry
  std::vector<float> hidden_;   // [H] draft output hidden after the last real entry
};

CudaDraftModel::CudaDraftModel(std::unique_ptr<spec::DraftModel> model, int slots,
                               int64_t max_context, bool specialized)
    : model_(std::move(model)) {
  K3_CHECK(model_ != nullptr && slots >= 1, "CudaDraftModel: a model and at least one slot");
  const ModelConfig& c = model_->body().config;
  CudaBackboneOptions o;
  o.max_rows = 64;
  o.pool.slots = slots;
  o.pool.max_context = std::min<int64_t>(max_context, c.max_position_embeddings);
  o.fused_input.eh_proj = &model_->eh_proj();
  o.fused_input.enorm = &model_->enorm();
  o.fused_input.hnorm = &model_->hnorm();
  if (specialized) o.capture_sizes = {1};
  bb_ = std::make_unique<CudaBackbone>(c, model_->body().weights, o);
  for (int s = slots - 1; s >= 0; --s) free_->push_back(s);
}

CudaDraftModel::~CudaDraftModel() = default;

std::unique_ptr<spec::Drafter> CudaDraftModel::make_drafter(const cpu::SamplingParams& sampling) {
  K3_CHECK(!free_->empty(), "the GPU draft model's ", bb_->slots(),
           " slots all draft (max_num_seqs)");
  const int s = free_->back();
  free_->pop_back();
  return std::make_unique<CudaDraftDrafter>(*this, s, sampling);
}

}  // namespace k3::cuda
