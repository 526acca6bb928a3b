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
#include "spec/drafter.h"
#include "spec/verify_cpu.h"

namespace k3::serve {
namespace {

class CpuSlot final : public SlotState {
 public:
  explicit CpuSlot(cpu::DecodeState s) : state(std::move(s)) {}
  void reset() override {
    state.reset();
    verify.rows = 0;  // the snapshots keep their buffers for the next request
  }
  int64_t position() const override { return state.position; }
  cpu::DecodeState state;
  spec::VerifyScratch verify;  // KDA snapshots of the last verify step
};

CpuSlot& cpu_slot(SlotState* s) {
  auto* slot = dynamic_cast<CpuSlot*>(s);
  K3_CHECK(slot != nullptr, "CPU backend: a state from another backend");
  return *slot;
}

// Runs fn(i, scratch) for i in [0, n) on up to `threads` threads, each taking the next index;
// scratch is a per-thread [vocab] buffer. Rethrows the first exception after all threads end.
template <typename Fn>
void parallel_rows(size_t n, int threads, int64_t vocab, const Fn& fn) {
  const size_t workers = std::min(static_cast<size_t>(threads), n);
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  const auto work = [&] {
    std::vector<float> scratch(static_cast<size_t>(vocab));  // logits nobody reads
    try {
      for (size_t i = next++; i < n; i = next++) fn(i, scratch.data());
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

class CpuBackend final : public StepBackend {
 public:
  CpuBackend(std::unique_ptr<LoadedModel> model, const DeployConfig& d, bool fp32, int threads)
      : model_(std::move(model)), threads_(std::max(1, threads)) {
    const KdaDtypes kd = kda_dtypes(model_->config, d);
    cpu::Numerics num;
    num.bf16_activations = !fp32;
    const cpu::StateDtypes dt{kd.conv, kd.recurrent, cpu::latent_format_of(d.kv_cache_dtype)};
    backbone_ = std::make_unique<cpu::CpuBackbone>(model_->config, model_->weights, dt, num,
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
    parallel_rows(rows.size(), threads_, vocab_size(),
                  [&](size_t i, float* scratch) { run(rows[i], scratch); });
  }
  bool supports_verify() const override { return true; }
  void verify(std::span<const VerifyRow> rows) override {
    parallel_rows(rows.size(), threads_, vocab_size(), [&](size_t i, float*) {
      CpuSlot& slot = cpu_slot(rows[i].state);
      spec::cpu_verify(*backbone_, slot.state, rows[i].tokens, rows[i].logits, slot.verify,
                       rows[i].hidden);
    });
  }
  void commit(SlotState& state, int64_t consumed) override {
    CpuSlot& slot = cpu_slot(&state);
    spec::cpu_commit(slot.state, slot.verify, consumed);
  }

 private:
  void run(const StepRow& r, float* scratch) const {
    CpuSlot& slot = cpu_slot(r.state);
    const auto H = static_cast<size_t>(model_->config.hidden_size);
    for (size_t i = 0; i < r.tokens.size(); ++i) {
      const bool last = i + 1 == r.tokens.size();
      backbone_->step_hidden(slot.state, r.tokens[i], last && r.logits ? r.logits : scratch,
                             r.hidden ? r.hidden + i * H : nullptr);
    }
  }

  std::unique_ptr<LoadedModel> model_;
  std::unique_ptr<cpu::CpuBackbone> backbone_;
  int threads_;
};

}  // namespace

void StepBackend::step(std::span<const StepRow> rows, std::span<const VerifyRow> vrows) {
  if (!rows.empty()) forward(rows);
  if (!vrows.empty()) verify(vrows);
}

void StepBackend::verify(std::span<const VerifyRow>) {
  fail("speculative decoding is not supported by this backend");
}

void StepBackend::commit(SlotState&, int64_t) {
  fail("speculative decoding is not supported by this backend");
}

std::unique_ptr<spec::Drafter> StepBackend::make_drafter(const SpeculativeConfig&,
                                                         const cpu::SamplingParams&) {
  return nullptr;
}

std::unique_ptr<StepBackend> make_cpu_backend(std::unique_ptr<LoadedModel> model,
                                              const DeployConfig& deploy, bool fp32, int threads) {
  K3_CHECK(model != nullptr, "make_cpu_backend: no model");
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuBackend>(std::move(model), deploy, fp32, threads);
}

namespace {
BackendFactory g_cuda_factory = nullptr;
FollowerRunner g_cuda_follower = nullptr;
}  // namespace

void set_cuda_follower(FollowerRunner runner) {
  g_cuda_follower = runner;
}
void run_cuda_follower(std::unique_ptr<LoadedModel> model, const DeployConfig& deploy) {
  K3_CHECK(g_cuda_follower != nullptr,
           "this build of k3 has no CUDA backend (nvcc was not found at configure time); a "
           "multi-process rank needs it");
  g_cuda_follower(std::move(model), deploy);
}

void set_cuda_backend_factory(BackendFactory factory) {
  g_cuda_factory = factory;
}
bool have_cuda_backend() {
  return g_cuda_factory != nullptr;
}
std::unique_ptr<StepBackend> make_cuda_backend(std::unique_ptr<LoadedModel> model,
                                               const DeployConfig& deploy) {
  K3_CHECK(g_cuda_factory != nullptr,
           "this build of k3 has no CUDA backend (nvcc was not found "
           "at configure time); use --device cpu");
  return g_cuda_factory(std::move(model), deploy);
}

}  // namespace k3::serve
