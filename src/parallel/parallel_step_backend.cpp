#include "parallel/parallel_step_backend.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cpu/latent_format.h"
#include "model/loaded_model.h"
#include "parallel/parallel_backbone.h"
#include "runtime/deploy_config.h"

namespace k3::parallel {
namespace {

class ParallelSlot final : public serve::SlotState {
 public:
  explicit ParallelSlot(ParallelState s) : state(std::move(s)) {}
  void reset() override {
    for (auto& shard : state.shards) shard.reset();
  }
  int64_t position() const override { return state.position(); }
  ParallelState state;
};

class ParallelBackend final : public serve::StepBackend {
 public:
  ParallelBackend(std::unique_ptr<LoadedModel> model, const DeployConfig& d,
                  const ParallelLayout& layout)
      : model_(std::move(model)) {
    const KdaDtypes kd = kda_dtypes(model_->config, d);
    backbone_ = std::make_unique<ParallelCpuBackbone>(
        model_->config, model_->weights,
        cpu::StateDtypes{kd.conv, kd.recurrent, cpu::latent_format_of(d.kv_cache_dtype)}, layout,
        cpu::Numerics{}, d.max_model_len);
  }
  const ModelConfig& config() const override { return model_->config; }
  int64_t vocab_size() const override { return model_->config.vocab_size; }
  int64_t max_context() const override { return backbone_->max_context(); }
  std::unique_ptr<serve::SlotState> new_state() const override {
    const int dp = backbone_->layout().dp;
    return std::make_unique<ParallelSlot>(backbone_->new_state(next_replica_++ % dp));
  }
  void forward(std::span<const serve::StepRow> rows) override {
    size_t longest = 0;
    for (const auto& r : rows) {
      K3_CHECK(dynamic_cast<ParallelSlot*>(r.state) != nullptr,
               "multi-rank backend: a state from another backend");
      K3_CHECK(r.hidden == nullptr, "the multi-rank backend does not export hidden states");
      longest = std::max(longest, r.tokens.size());
    }
    const auto V = static_cast<size_t>(vocab_size());
    std::vector<ParallelState*> states;
    std::vector<int64_t> tokens;
    std::vector<const serve::StepRow*> members;
    std::vector<float> logits;
    for (size_t t = 0; t < longest; ++t) {
      states.clear();
      tokens.clear();
      members.clear();
      for (const auto& r : rows) {
        if (t >= r.tokens.size()) continue;
        states.push_back(&static_cast<ParallelSlot*>(r.state)->state);
        tokens.push_back(r.tokens[t]);
        members.push_back(&r);
      }
      logits.resize(V * members.size());
      backbone_->step(states, tokens, logits.data());
      for (size_t m = 0; m < members.size(); ++m)
        if (members[m]->logits && t + 1 == members[m]->tokens.size())
          std::copy_n(logits.data() + m * V, V, members[m]->logits);
    }
  }

 private:
  std::unique_ptr<LoadedModel> model_;
  std::unique_ptr<ParallelCpuBackbone> backbone_;
  mutable int next_replica_ = 0;  // DP replica of the next request (round robin)
};

}  // namespace

std::unique_ptr<serve::StepBackend> make_parallel_cpu_backend(std::unique_ptr<LoadedModel> model,
                                                              const DeployConfig& deploy,
                                                              const ParallelLayout& layout) {
  K3_CHECK(model != nullptr, "make_parallel_cpu_backend: no model");
  validate_layout(layout, model->config);
  return std::make_unique<ParallelBackend>(std::move(model), deploy, layout);
}

}  // namespace k3::parallel
