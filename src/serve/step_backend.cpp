#include "serve/step_backend.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.h"
#include "cpu/backbone.h"
#include "model/loaded_model.h"
#include "runtime/deploy_config.h"

namespace k3::serve {
namespace {

class CpuSlot final : public SlotState {
 public:
  explicit CpuSlot(cpu::DecodeState s) : state(std::move(s)) {}
  void reset() override { state.reset(); }
  int64_t position() const override { return state.position; }
  cpu::DecodeState state;
};

class CpuBackend final : public StepBackend {
 public:
  CpuBackend(std::unique_ptr<LoadedModel> model, const DeployConfig& d, bool fp32, int threads)
      : model_(std::move(model)), threads_(std::max(1, threads)) {
    const KdaDtypes kd = kda_dtypes(model_->config, d);
    cpu::Numerics num;
    num.bf16_activations = !fp32;
    backbone_ = std::make_unique<cpu::CpuBackbone>(model_->config, model_->weights,
                                                   cpu::StateDtypes{kd.conv, kd.recurrent}, num,
                                                   d.max_model_len);
  }
  const ModelConfig& config() const override { return model_->config; }
  int64_t vocab_size() const override { return model_->config.vocab_size; }
  int64_t max_context() const override { return backbone_->max_context(); }
  std::unique_ptr<SlotState> new_state() const override {
    return std::make_unique<CpuSlot>(backbone_->new_state());
  }
  // Rows are independent (own state, own logits; the backbone and weights are read-only), so
  // they run in parallel, each worker taking the next row. Results do not depend on the split.
  void forward(std::span<const StepRow> rows) override {
    const size_t workers = std::min(static_cast<size_t>(threads_), rows.size());
    std::atomic<size_t> next{0};
    std::exception_ptr error;
    std::mutex error_mu;
    const auto work = [&] {
      std::vector<float> scratch(static_cast<size_t>(vocab_size()));  // logits nobody reads
      try {
        for (size_t i = next++; i < rows.size(); i = next++) run(rows[i], scratch.data());
      } catch (...) {
        std::lock_guard lock(error_mu);
        if (!error) error = std::current_exception();
      }
    };
    std::vector<std::thread> pool;
    for (size_t t = 1; t < workers; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    if (error) std::rethrow_exception(error);
  }

 private:
  void run(const StepRow& r, float* scratch) const {
    auto* slot = dynamic_cast<CpuSlot*>(r.state);
    K3_CHECK(slot != nullptr, "CPU backend: a state from another backend");
    for (size_t i = 0; i < r.tokens.size(); ++i) {
      const bool last = i + 1 == r.tokens.size();
      backbone_->step(slot->state, r.tokens[i], last && r.logits ? r.logits : scratch);
    }
  }

  std::unique_ptr<LoadedModel> model_;
  std::unique_ptr<cpu::CpuBackbone> backbone_;
  int threads_;
};

}  // namespace

std::unique_ptr<StepBackend> make_cpu_backend(std::unique_ptr<LoadedModel> model,
                                              const DeployConfig& deploy, bool fp32, int threads) {
  K3_CHECK(model != nullptr, "make_cpu_backend: no model");
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuBackend>(std::move(model), deploy, fp32, threads);
}

}  // namespace k3::serve
