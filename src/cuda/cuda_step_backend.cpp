#include "cuda/cuda_step_backend.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "core/error.h"
#include "cpu/latent_format.h"
#include "cuda/backbone.h"
#include "cuda/cuda_draft.h"
#include "cuda/rank_group.h"
#include "model/loaded_model.h"
#include "parallel/layout.h"
#include "parallel/tcp_bootstrap.h"
#include "runtime/deploy_config.h"

namespace k3::cuda {
namespace {

constexpr int kMaxStepRows = 64;

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

// The backbone options of a deployment: slots (max_num_seqs), context, cache dtypes, rows per
// step and, for latency_specialized, the capture sizes.
CudaBackboneOptions backbone_options(const ModelConfig& cfg, const DeployConfig& d) {
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
  // Rows per step count tokens: a prefill chunk or a verify's q positions are a run of rows
  // of one slot, so even one request fills a step.
  o.max_rows = kMaxStepRows;
  // latency_specialized: the specialized step, captured per size at load. A capture size
  // counts rows = requests x q (vLLM's cudagraph_capture_sizes).
  if (const auto dc = specialized_decode_config(cfg, d)) {
    for (const int s : dc->capture_sizes) {
      const int rows = std::min(s, o.max_rows);
      if (o.capture_sizes.empty() || rows > o.capture_sizes.back()) o.capture_sizes.push_back(rows);
    }
  }
  return o;
}

// The ranks of a multi-rank deployment: each replica holds ceil(max_num_seqs / dp) slots.
RankedOptions ranked_options(const ModelConfig& cfg, const DeployConfig& d) {
  RankedOptions ro;
  ro.layout = parallel::layout_of(d);
  parallel::validate_layout(ro.layout, cfg);
  ro.backbone = backbone_options(cfg, d);
  ro.backbone.pool.slots = (d.max_num_seqs + ro.layout.dp - 1) / ro.layout.dp;
  return ro;
}

// The executor of a deployment: the whole model on this GPU, or the ranks of its layout (as
// threads of this process, or, under a multi-process launch, this process leading the others,
// which run run_cuda_follower). boot receives the bootstrap a led group needs.
std::unique_ptr<StepExecutor> make_executor(const ModelConfig& cfg, const ModelWeights& w,
                                            const DeployConfig& d,
                                            std::unique_ptr<parallel::TcpBootstrap>& boot) {
  if (!parallel::layout_of(d).multi_rank())
    return std::make_unique<CudaBackbone>(cfg, w, backbone_options(cfg, d));
  const RankedOptions ro = ranked_options(cfg, d);
  const parallel::BootstrapConfig bc = parallel::BootstrapConfig::from_env();
  if (bc.world <= 1) return std::make_unique<RankedBackbone>(cfg, w, ro);
  boot = std::make_unique<parallel::TcpBootstrap>(bc);
  return std::make_unique<RankedBackbone>(cfg, w, ro, *boot, parse_rank_comm(""));
}

// Request slots in the order new requests take them: under DP, alternating replicas.
int slot_for(int i, int dp, int per_replica) {
  return (i % dp) * per_replica + i / dp;
}

class CudaBackend final : public serve::StepBackend {
 public:
  CudaBackend(std::unique_ptr<LoadedModel> model, const DeployConfig& d)
      : model_(std::move(model)) {
    backbone_ = make_executor(model_->config, model_->weights, d, boot_);
    // A verify of q tokens keeps q - 1 KDA copies per slot; reserved before the graphs are
    // captured (growing them later drops the graphs).
    const int q = 1 + std::max(0, d.speculative_config.num_speculative_tokens);
    if (q > 1) backbone_->reserve_snapshots(q - 1);
    // draft_model speculation drafts on this GPU (the specialized drafter with
    // latency_specialized), beside the target.
    if (d.speculative_config.num_speculative_tokens > 0 &&
        d.speculative_config.method == "draft_model")
      draft_ = std::make_unique<CudaDraftModel>(
          spec::DraftModel::load(d.speculative_config.model, model_->config), d.max_num_seqs,
          backbone_->max_context(), specialized_decode_config(model_->config, d).has_value());
    const int dp = d.data_parallel_size, per = backbone_->slots() / dp;
    for (int i = d.max_num_seqs - 1; i >= 0; --i) free_->free.push_back(slot_for(i, dp, per));
    verify_start_.assign(static_cast<size_t>(backbone_->slots()), 0);
    verify_q_.assign(static_cast<size_t>(backbone_->slots()), 0);
  }

  const ModelConfig& config() const override { return model_->config; }
  int64_t vocab_size() const override { return model_->config.vocab_size; }
  int64_t max_context() const override { return backbone_->max_context(); }

  std::unique_ptr<serve::SlotState> new_state() const override {
    K3_CHECK(!free_->free.empty(), "the CUDA backend's ", verify_q_.size(),
             " slots are all in use (max_num_seqs)");
    const int s = free_->free.back();
    free_->free.pop_back();
    reset(s);
    return std::make_unique<CudaSlot>(const_cast<CudaBackend*>(this), free_, s);
  }

  // Each row's tokens run as a run of rows of its slot, packed into steps of at most max_rows
  // tokens; the logits after a row's last token (and the hidden states of all) are copied out.
  void forward(std::span<const serve::StepRow> rows) override {
    std::vector<Row> rs;
    for (const auto& r : rows)
      rs.push_back({slot_of(r.state), r.tokens, r.logits, r.hidden, /*all_logits=*/false});
    run(rs, /*verify=*/false);
  }

  // Speculative verify: a row's q tokens are one run in one step (both paths), so the q
  // positions cost about one step, not q; the logits after every token are copied out and the
  // KDA state after each of the first q - 1 is kept in the slot's snapshots, so commit()
  // restores the accepted prefix's state without recomputing it.
  bool supports_verify() const override { return true; }
  void verify(std::span<const serve::VerifyRow> rows) override {
    std::vector<Row> rs;
    add_verify_rows(rows, rs);
    run(rs, /*verify=*/true);
  }
  // Decode rows join the verify runs in one step (a decode row is a run of one: no snapshot);
  // prefill chunks run in steps of their own first (stock path, no snapshots).
  void step(std::span<const serve::StepRow> rows,
            std::span<const serve::VerifyRow> vrows) override {
    if (vrows.empty()) {
      forward(rows);
      return;
    }
    std::vector<Row> joint, prefill;
    for (const auto& r : rows)
      (r.tokens.size() > 1 ? prefill : joint)
          .push_back({slot_of(r.state), r.tokens, r.logits, r.hidden, /*all_logits=*/false});
    if (!prefill.empty()) run(prefill, /*verify=*/false);
    add_verify_rows(vrows, joint);
    run(joint, /*verify=*/true);
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

  std::unique_ptr<spec::Drafter> make_drafter(const SpeculativeConfig& cfg,
                                              const cpu::SamplingParams& sampling) override {
    if (!draft_ || cfg.method != "draft_model") return nullptr;
    return draft_->make_drafter(sampling);
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
    float* hidden;  // [tokens][hidden] or null
    bool all_logits;
  };
  // Part of a row in one step: tokens [first, first + count), at step rows [at, at + count).
  struct Piece {
    const Row* row;
    size_t first, count;
    int64_t at;
  };
  // Appends the verify rows to rs, remembering each slot's start and q for commit() and
  // reserving the KDA snapshots the longest needs.
  void add_verify_rows(std::span<const serve::VerifyRow> rows, std::vector<Row>& rs) {
    size_t q_max = 0;
    for (const auto& r : rows) {
      K3_CHECK(!r.tokens.empty(), "a verify row needs at least one token");
      K3_CHECK(static_cast<int>(r.tokens.size()) <= backbone_->max_rows(), "a verify of ",
               r.tokens.size(), " tokens exceeds the ", backbone_->max_rows(), " rows of one step");
      const int s = slot_of(r.state);
      rs.push_back({s, r.tokens, r.logits, r.hidden, /*all_logits=*/true});
      q_max = std::max(q_max, r.tokens.size());
      verify_start_[static_cast<size_t>(s)] = backbone_->position(s);
      verify_q_[static_cast<size_t>(s)] = static_cast<int64_t>(r.tokens.size());
    }
    if (q_max > 1) backbone_->reserve_snapshots(static_cast<int>(q_max) - 1);
  }
  // One routing decision per step: a decode-only step (decode rows of one token, or verify
  // runs) whose row count has a specialized graph runs the specialized path; prefill, mixed and
  // wider steps run the stock one. Both share every state tensor.
  StepPath path_of(const std::vector<Piece>& pieces, int64_t step_rows, bool verify) const {
    if (!backbone_->specialized_ready() || step_rows > backbone_->max_capture_rows())
      return StepPath::Stock;
    if (!verify)
      for (const Piece& p : pieces)
        if (p.row->tokens.size() > 1) return StepPath::Stock;  // a prefill chunk
    return StepPath::Specialized;
  }
  static int slot_of(serve::SlotState* state) {
    auto* s = dynamic_cast<CudaSlot*>(state);
    K3_CHECK(s != nullptr, "CUDA backend: a state from another backend");
    return s->slot();
  }
  // Packs the rows' tokens into steps: a verify run stays whole (its snapshots index its
  // tokens), a prefill row is cut where the step is full and continues in the next one.
  void run(const std::vector<Row>& rows, bool verify) {
    const int64_t V = vocab_size(), H = model_->config.hidden_size;
    const int64_t budget = backbone_->max_rows();
    std::vector<size_t> fed(rows.size(), 0);
    std::vector<int32_t> slots, toks;
    std::vector<Piece> pieces;
    std::vector<float> hidden;
    std::vector<int64_t> want_rows;  // step rows whose logits are copied out, to want_out
    std::vector<float*> want_out;
    for (;;) {
      slots.clear();
      toks.clear();
      pieces.clear();
      want_rows.clear();
      want_out.clear();
      for (size_t i = 0; i < rows.size(); ++i) {
        const size_t left = rows[i].tokens.size() - fed[i];
        const int64_t room = budget - static_cast<int64_t>(slots.size());
        if (left == 0 || room == 0 || (verify && static_cast<int64_t>(left) > room)) continue;
        const size_t take = std::min<size_t>(left, static_cast<size_t>(room));
        pieces.push_back({&rows[i], fed[i], take, static_cast<int64_t>(slots.size())});
        for (size_t t = fed[i]; t < fed[i] + take; ++t) {
          slots.push_back(rows[i].slot);
          toks.push_back(static_cast<int32_t>(rows[i].tokens[t]));
        }
        fed[i] += take;
      }
      if (slots.empty()) return;
      const int64_t n = static_cast<int64_t>(slots.size());
      backbone_->step(slots, toks, path_of(pieces, n, verify), /*keep_kda_states=*/verify);
      bool any_hidden = false;
      for (const Piece& p : pieces) {
        const Row& r = *p.row;
        any_hidden |= r.hidden != nullptr;
        if (!r.logits) continue;
        for (size_t j = 0; j < p.count; ++j) {
          const size_t t = p.first + j;
          if (r.all_logits) {
            want_rows.push_back(p.at + static_cast<int64_t>(j));
            want_out.push_back(r.logits + t * static_cast<size_t>(V));
          } else if (t + 1 == r.tokens.size()) {
            want_rows.push_back(p.at + static_cast<int64_t>(j));
            want_out.push_back(r.logits);
          }
        }
      }
      // A prefill chunk that does not end its prompt wants nothing: no wait, the next step is
      // enqueued behind it.
      if (!want_rows.empty()) backbone_->logits_rows_to_host(want_rows, want_out);
      if (!any_hidden) continue;
      hidden.resize(static_cast<size_t>(n * H));
      backbone_->hidden_to_host(n, hidden.data());
      for (const Piece& p : pieces)
        if (p.row->hidden)
          std::copy_n(hidden.data() + p.at * H, p.count * static_cast<size_t>(H),
                      p.row->hidden + p.first * static_cast<size_t>(H));
    }
  }

  std::unique_ptr<LoadedModel> model_;
  std::unique_ptr<parallel::TcpBootstrap> boot_;  // a multi-process group this process leads
  std::unique_ptr<StepExecutor> backbone_;
  std::unique_ptr<CudaDraftModel> draft_;  // draft_model speculation on this GPU
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

void run_cuda_follower(std::unique_ptr<LoadedModel> model, const DeployConfig& deploy) {
  K3_CHECK(model != nullptr, "run_cuda_follower: no model");
  const RankedOptions ro = ranked_options(model->config, deploy);
  parallel::TcpBootstrap boot(parallel::BootstrapConfig::from_env());
  follow_rank(model->config, model->weights, ro, boot, parse_rank_comm(""));
}

}  // namespace k3::cuda
