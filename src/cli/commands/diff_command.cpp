// `k3 diff`: the per-layer report of the specialized decode step against the stock one
// (cuda/step_diff.h), through the runner CUDA builds install (diff_hook.h). Exit status 0 when
// every rel L2 is within --tolerance and the teacher-forced argmax agrees on every step.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands/commands.h"
#include "cli/commands/diff_hook.h"
#include "core/error.h"
#include "model/loaded_model.h"
#include "synth/presets.h"
#include "synth/synthesize.h"
#include "text/tokenizer.h"

namespace k3::cli {
namespace {

namespace fs = std::filesystem;

StepDiffRunner g_runner = nullptr;

struct DiffOpts {
  std::string model, prompt = "The Kimi K3 model";
  StepDiffArgs args;
};

// A tiny preset synthesized for this run only, removed afterwards.
struct ScratchModel {
  fs::path dir;
  ~ScratchModel() {
    std::error_code ec;
    if (!dir.empty()) fs::remove_all(dir, ec);
  }
};

// --model: a checkpoint directory; empty or "tiny": the built-in tiny model (as `k3 generate`);
// another tiny-* preset name: synthesized (seed 1) into a scratch directory.
std::string resolve_model(const std::string& m, ScratchModel& scratch) {
  if (m.empty()) return builtin_tiny_model_dir();
  if (fs::is_directory(m)) return m;
  if (m == "tiny") return builtin_tiny_model_dir();
  const std::vector<std::string> names = synth_preset_names();
  std::string tiny;
  for (const auto& n : names)
    if (n.rfind("tiny", 0) == 0) tiny += (tiny.empty() ? "" : ", ") + n;
  K3_CHECK(m.rfind("tiny", 0) == 0 && std::find(names.begin(), names.end(), m) != names.end(),
           "--model \"", m, "\" is neither a checkpoint directory nor a tiny preset (", tiny, ")");
  scratch.dir = fs::temp_directory_path() / ("k3-diff-" + m + "." + std::to_string(getpid()));
  std::fprintf(stderr, "k3: synthesizing preset %s into %s\n", m.c_str(), scratch.dir.c_str());
  SynthOptions so;
  so.seed = 1;
  synthesize_checkpoint(synth_preset(m), scratch.dir.string(), so);
  return scratch.dir.string();
}

void run_diff(DiffOpts& o) {
  // The GPU comes first: nothing is synthesized or loaded for a run that cannot happen.
  K3_CHECK(g_runner,
           "k3 diff needs a CUDA GPU: this build has no CUDA backend (nvcc was not found at "
           "configure time)");
  const std::vector<std::string> gpus = probe_gpus();
  K3_CHECK(!gpus.empty(), "k3 diff needs a CUDA GPU: none is visible");
  for (const auto& g : gpus) std::fprintf(stderr, "k3: found GPU %s\n", g.c_str());

  ScratchModel scratch;
  const std::string dir = resolve_model(o.model, scratch);
  const auto model = LoadedModel::load(dir);
  const ModelConfig& cfg = model->config;
  // The prompt is tokenized as `k3 generate` does: special-token strings allowed, BOS first.
  const auto tok = Tokenizer::load(dir);
  std::vector<int64_t> ids = tok->encode(o.prompt, /*allow_special=*/true);
  if (cfg.bos_token_id >= 0) ids.insert(ids.begin(), cfg.bos_token_id);
  K3_CHECK(!ids.empty(), "--prompt gives no tokens");
  o.args.prompt.clear();
  for (const int64_t id : ids) {
    K3_CHECK(id >= 0 && id < cfg.vocab_size, "prompt token ", id,
             " is outside the model's vocabulary [0, ", cfg.vocab_size, ")");
    o.args.prompt.push_back(static_cast<int32_t>(id));
  }
  std::fprintf(stderr, "k3: model %s (%d layers), prompt %zu tokens\n", dir.c_str(),
               cfg.num_hidden_layers, o.args.prompt.size());
  const bool ok = g_runner(*model, o.args, std::cout);
  std::cout.flush();
  K3_CHECK(ok, "k3 diff: the specialized step differs from the stock step (tolerance ",
           o.args.tolerance, "; see the report above)");
}

}  // namespace

void set_step_diff_runner(StepDiffRunner runner) {
  g_runner = runner;
}

void register_diff(CLI::App& app) {
  auto o = std::make_shared<DiffOpts>();
  CLI::App* sub = app.add_subcommand(
      "diff", "per-layer diff of the specialized vs the stock CUDA decode step (needs a GPU)");
  sub->add_option("--model", o->model,
                  "checkpoint directory or tiny preset name (default: the built-in tiny model)");
  sub->add_option("--prompt", o->prompt, "prompt text (special-token strings allowed)")
      ->capture_default_str();
  sub->add_option("--steps", o->args.steps, "generated tokens after the prompt")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--tolerance", o->args.tolerance, "bound on every rel L2 (sublayers, logits)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  sub->add_flag("--verbose", o->args.verbose, "per-step logits distances and the greedy tokens");
  sub->add_flag("--measured-plans", o->args.measured_plans,
                "GEMM plans timed on the GPU, as the engine picks them (default: the planner's "
                "model picks, so the report does not depend on timings)");
  sub->callback([o] { run_diff(*o); });
}

}  // namespace k3::cli
