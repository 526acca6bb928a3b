#include "cuda/cuda_step_backend.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "core/error.h"
#include "cpu/latent_format.h"
#include "cuda/backbone.h"
#include "model/loaded_model.h"
#include "runtime/deploy_config.h"

namespace k3::cuda {
namespace {

class CudaBackend;

// Slots no state holds; shared with the states, so a state may outlive the backend.
struct FreeSlots {
  std::vector<int> free;
};

class CudaSlot final : public serve::SlotState {
 public:
  CudaSlot(CudaBackend* owner, std::shared_ptr<FreeSlots> pool, int slot)
      : owner_(owner), pool_(std::move(pool)), slot_(slot) {}
  ~CudaSlot() override { pool_->free.push_back(slot_); }
  void reset() override;
  int64_t position() const override;
  int slot() const { return slot_; }

 private:
  CudaBackend* owner_;
  std::shared_ptr<FreeSlots> pool_;
  int slot_;
};

class CudaBackend final : public serve::StepBackend {
 public:
  CudaBackend(std::unique_ptr<LoadedModel> model, const DeployConfig& d) : model_(std::move(model)) {
    const ModelConfig& cfg = model_->config;
    const KdaDtypes kd = kda_dtypes(cfg, d);
    K3_CHECK(kd.conv == DType::BF16, "the CUDA KDA kernel keeps its conv state in bfloat16; "
             "mamba_cache_dtype asks for ", dtype_name(kd.conv));
    CudaBackboneOptions o;
    o.pool.slots = d.max_num_seqs;
    o.pool.max_context = d.max_model_len > 0 ? d.max_model_len : cfg.max_position_embeddings;
    o.pool.recurrent = kd.recurrent;
    o.pool.latent = cpu::latent_format_of(d.kv_cache_dtype);
    o.max_rows = std::min(d.max_num_seqs, 64);
    backbone_ = std::make_unique<CudaBackbone>(cfg, model_->weights, o);
    for (int s = d.max_num_seqs - 1; s >= 0; --s) free_->free.push_back(s);
  }

  const ModelConfig& config() const override { return model_->config; }
  int64_t vocab_size() const override { return model_->config.vocab_size; }
  int64_t max_context() const override { return backbone_->pool().max_context(); }

  std::unique_ptr<serve::SlotState> new_state() const override {
    K3_CHECK(!free_->free.empty(), "the CUDA backend's ", backbone_->pool().slots(),
             " slots are all in use (max_num_seqs)");
    const int s = free_->free.back();
    free_->free.pop_back();
    backbone_->reset_slot(s);
    return std::make_unique<CudaSlot>(const_cast<CudaBackend*>(this), free_, s);
  }

  // Position t of every row that has a t-th token runs as one batched step (in groups of at
  // most max_rows); logits of a row's last token are copied out.
  void forward(std::span<const serve::StepRow> rows) override {
    size_t longest = 0;
    for (const auto& r : rows) {
      K3_CHECK(dynamic_cast<CudaSlot*>(r.state) != nullptr, "CUDA backend: a state from another backend");
      longest = std::max(longest, r.tokens.size());
    }
    const int64_t V = vocab_size();
    std::vector<int32_t> slots, toks;
    std::vector<const serve::StepRow*> members;
    std::vector<float> logits;
    for (size_t t = 0; t < longest; ++t) {
      for (size_t i = 0; i < rows.size();) {
        slots.clear();
        toks.clear();
        members.clear();
        for (; i < rows.size() && static_cast<int>(slots.size()) < backbone_->max_rows(); ++i) {
          const serve::StepRow& r = rows[i];
          if (t >= r.tokens.size()) continue;
          slots.push_back(static_cast<CudaSlot*>(r.state)->slot());
          toks.push_back(static_cast<int32_t>(r.tokens[t]));
          members.push_back(&r);
        }
        if (slots.empty()) continue;
        backbone_->step(slots, toks);
        bool any_logits = false;
        for (const auto* r : members) any_logits |= r->logits && t + 1 == r->tokens.size();
        if (!any_logits) continue;
        logits.resize(static_cast<size_t>(V) * members.size());
        backbone_->logits_to_host(static_cast<int64_t>(members.size()), logits.data());
        for (size_t m = 0; m < members.size(); ++m)
          if (members[m]->logits && t + 1 == members[m]->tokens.size())
            std::copy_n(logits.data() + m * V, V, members[m]->logits);
      }
    }
  }

  void reset(int slot) { backbone_->reset_slot(slot); }
  int64_t position(int slot) const { return backbone_->position(slot); }

 private:
  std::unique_ptr<LoadedModel> model_;
  std::unique_ptr<CudaBackbone> backbone_;
  std::shared_ptr<FreeSlots> free_ = std::make_shared<FreeSlots>();
};

void CudaSlot::reset() {
  owner_->reset(slot_);
}
int64_t CudaSlot::position() const {
  return owner_->position(slot_);
}

}  // namespace

std::unique_ptr<serve::StepBackend> make_cuda_step_backend(std::unique_ptr<LoadedModel> model,
                                                           const DeployConfig& deploy) {
  K3_CHECK(model != nullptr, "make_cuda_step_backend: no model");
  return std::make_unique<CudaBackend>(std::move(model), deploy);
}

}  // namespace k3::cuda
