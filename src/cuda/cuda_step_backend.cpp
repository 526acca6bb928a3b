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
  CudaBackend(std::unique_ptr<LoadedModel> model, const DeployConfig& d)
      : model_(std::move(model)) {
    const ModelConfig& cfg = model_->config;
    const KdaDtypes kd = kda_dtypes(cfg, d);
    K3_CHECK(kd.conv == DType::BF16,
             "the CUDA KDA kernel keeps its conv state in bfloat16; "
             "mamba_cache_dtype asks for ",
             dtype_name(kd.conv));
    CudaBackboneOptions o;
    o.pool.slots = d.max_num_seqs;
    o.pool.max_context = d.max_model_len > 0 ? d.max_model_len : cfg.max_position_embeddings;
    o.pool.recurrent = kd.recurrent;
    o.pool.latent = cpu::latent_format_of(d.kv_cache_dtype);
    o.max_rows = std::min(d.max_num_seqs, 64);
    // latency_specialized: the specialized step, captured per size at load. A capture size
    // counts rows = requests x q; a verify of q tokens runs as q steps of its requests here, so
    // the graph of size s serves s / q requests.
    if (const auto dc = specialized_decode_config(cfg, d)) {
      K3_CHECK(dc->dcp == 1,
               "the CUDA backend runs one rank: decode_context_parallel_size must be 1, got ",
               dc->dcp);
      for (const int s : dc->capture_sizes) {
        const int requests = std::min(s / dc->q, o.max_rows);
        if (requests >= 1 && (o.capture_sizes.empty() || requests > o.capture_sizes.back()))
          o.capture_sizes.push_back(requests);
      }
    }
    backbone_ = std::make_unique<CudaBackbone>(cfg, model_->weights, o);
    for (int s = d.max_num_seqs - 1; s >= 0; --s) free_->free.push_back(s);
    verify_start_.assign(static_cast<size_t>(d.max_num_seqs), 0);
    verify_q_.assign(static_cast<size_t>(d.max_num_seqs), 0);
  }

  const ModelConfig& config() const override { return model_->config; }
  int64_t vocab_size() const override { return model_->config.vocab_size; }
  int64_t max_context() const override { return backbone_->pool().max_context(); }

  std::unique_ptr<serve::SlotState> new_state() const override {
    K3_CHECK(!free_->free.empty(), "the CUDA backend's ", backbone_->pool().slots(),
             " slots are all in use (max_num_seqs)");
    const int s = free_->free.back();
    free_->free.pop_back();
    reset(s);
    return std::make_unique<CudaSlot>(const_cast<CudaBackend*>(this), free_, s);
  }

  // Position t of every row that has a t-th token runs as one batched step (in groups of at
  // most max_rows); logits of a row's last token are copied out.
  void forward(std::span<const serve::StepRow> rows) override {
    std::vector<Row> rs;
    for (const auto& r : rows) {
      K3_CHECK(r.hidden == nullptr,
               "the CUDA backend does not export hidden states (draft-model "
               "speculation runs on the CPU backend)");
      rs.push_back({slot_of(r.state), r.tokens, r.logits, /*all_logits=*/false});
    }
    run(rs, /*snapshots=*/false);
  }

  // Speculative verify (stock path): the q tokens of each row run as q batched steps; the logits
  // after every token are copied out and each row's KDA state is kept after each of its first
  // q - 1 tokens, so commit() restores the accepted prefix's state without recomputing it.
  bool supports_verify() const override { return true; }
  void verify(std::span<const serve::VerifyRow> rows) override {
    std::vector<Row> rs;
    size_t q_max = 0;
    for (const auto& r : rows) {
      K3_CHECK(r.hidden == nullptr,
               "the CUDA backend does not export hidden states (draft-model "
               "speculation runs on the CPU backend)");
      K3_CHECK(!r.tokens.empty(), "a verify row needs at least one token");
      const int s = slot_of(r.state);
      rs.push_back({s, r.tokens, r.logits, /*all_logits=*/true});
      q_max = std::max(q_max, r.tokens.size());
      verify_start_[static_cast<size_t>(s)] = backbone_->position(s);
      verify_q_[static_cast<size_t>(s)] = static_cast<int64_t>(r.tokens.size());
    }
    if (q_max > 1) backbone_->reserve_snapshots(static_cast<int>(q_max) - 1);
    run(rs, /*snapshots=*/true);
  }
  void commit(serve::SlotState& state, int64_t consumed) override {
    const int s = slot_of(&state);
    const int64_t q = verify_q_[static_cast<size_t>(s)];
    K3_CHECK(q > 0, "commit without a verify step on this slot");
    K3_CHECK(consumed >= 1 && consumed <= q, "commit of ", consumed, " tokens after a verify of ",
             q);
    if (consumed < q) {
      backbone_->restore_kda(s, static_cast<int>(consumed) - 1);
      backbone_->set_position(s, verify_start_[static_cast<size_t>(s)] + consumed);
    }
    verify_q_[static_cast<size_t>(s)] = 0;
  }

  // A slot starts empty: no KDA state, position 0, and no verify left to commit (a request
  // cancelled between verify and commit must not hand its snapshot to the next one).
  void reset(int slot) const {
    backbone_->reset_slot(slot);
    verify_q_[static_cast<size_t>(slot)] = 0;
  }
  int64_t position(int slot) const { return backbone_->position(slot); }

 private:
  struct Row {
    int slot;
    std::span<const int64_t> tokens;
    float* logits;  // [tokens][vocab] (all_logits) or [vocab] after the last token, or null
    bool all_logits;
  };
  // One routing decision per step: a decode-only step (every row one token: a decode row or a
  // position of a verify) whose row count has a specialized graph runs the specialized path;
  // prefill, mixed and wider steps run the stock one. Both share every state tensor.
  StepPath path_of(const std::vector<Row>& rows, size_t step_rows) const {
    if (!backbone_->specialized_ready() ||
        static_cast<int>(step_rows) > backbone_->max_capture_rows())
      return StepPath::Stock;
    for (const Row& r : rows)
      if (r.tokens.size() > 1 && !r.all_logits) return StepPath::Stock;  // a prefill chunk
    return StepPath::Specialized;
  }
  static int slot_of(serve::SlotState* state) {
    auto* s = dynamic_cast<CudaSlot*>(state);
    K3_CHECK(s != nullptr, "CUDA backend: a state from another backend");
    return s->slot();
  }
  void run(const std::vector<Row>& rows, bool snapshots) {
    size_t longest = 0;
    for (const auto& r : rows) longest = std::max(longest, r.tokens.size());
    const int64_t V = vocab_size();
    std::vector<int32_t> slots, toks;
    std::vector<const Row*> members;
    std::vector<float> logits;
    for (size_t t = 0; t < longest; ++t) {
      for (size_t i = 0; i < rows.size();) {
        slots.clear();
        toks.clear();
        members.clear();
        for (; i < rows.size() && static_cast<int>(slots.size()) < backbone_->max_rows(); ++i) {
          if (t >= rows[i].tokens.size()) continue;
          slots.push_back(rows[i].slot);
          toks.push_back(static_cast<int32_t>(rows[i].tokens[t]));
          members.push_back(&rows[i]);
        }
        if (slots.empty()) continue;
        backbone_->step(slots, toks, path_of(rows, slots.size()));
        const auto wants = [&](const Row* r) {
          return r->logits && (r->all_logits || t + 1 == r->tokens.size());
        };
        bool any = false;
        for (const Row* r : members) {
          any |= wants(r);
          if (snapshots && t + 1 < r->tokens.size())
            backbone_->save_kda(r->slot, static_cast<int>(t));
        }
        if (!any) continue;
        logits.resize(static_cast<size_t>(V) * members.size());
        backbone_->logits_to_host(static_cast<int64_t>(members.size()), logits.data());
        for (size_t m = 0; m < members.size(); ++m)
          if (wants(members[m]))
            std::copy_n(logits.data() + m * V, V,
                        members[m]->logits + (members[m]->all_logits ? t * V : 0));
      }
    }
  }

  std::unique_ptr<LoadedModel> model_;
  std::unique_ptr<CudaBackbone> backbone_;
  std::vector<int64_t> verify_start_;      // [slots] position before the last verify
  mutable std::vector<int64_t> verify_q_;  // [slots] tokens of the last verify, 0 after commit
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
