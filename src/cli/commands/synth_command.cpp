#include <cstdio>
#include <filesystem>

#include "cli/commands/commands.h"
#include "core/error.h"
#include "core/progress.h"
#include "spec/draft_model.h"
#include "synth/presets.h"
#include "synth/synthesize.h"

namespace k3::cli {

void register_synth(CLI::App& app) {
  struct Opts {
    std::string preset = "tiny", out;
    uint64_t seed = 0;
    int layers = 0, experts = 0, threads = 0;
    double shard_gb = 5.0;
    bool force = false, no_progress = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand("synth", "write a synthetic checkpoint with the real layout");
  std::string presets;
  for (const auto& n : synth_preset_names()) presets += (presets.empty() ? "" : ", ") + n;
  sub->add_option("--preset", o->preset, "model shape: " + presets)->capture_default_str();
  sub->add_option("--out", o->out, "output directory")->required();
  sub->add_option("--seed", o->seed, "random seed")->capture_default_str();
  sub->add_option("--layers", o->layers, "override num_hidden_layers (K3 layer schedule)");
  sub->add_option("--experts", o->experts, "override num_experts");
  sub->add_option("--shard-size-gb", o->shard_gb, "max shard size in GB")->capture_default_str();
  sub->add_option("--threads", o->threads, "worker threads (0: all cores)");
  sub->add_flag("--force", o->force, "write into a non-empty directory");
  sub->add_flag("--no-progress", o->no_progress, "no progress bar");
  sub->callback([o] {
    PresetOverrides ov;
    if (o->layers) ov.num_hidden_layers = o->layers;
    if (o->experts) ov.num_experts = o->experts;
    const ModelConfig cfg = apply_overrides(synth_preset(o->preset), ov);
    namespace fs = std::filesystem;
    K3_CHECK(o->force || !fs::exists(o->out) || fs::is_empty(o->out), "output directory ", o->out,
             " is not empty (use --force)");
    K3_CHECK(o->shard_gb > 0, "--shard-size-gb must be positive");
    const uint64_t bytes = checkpoint_bytes(cfg);
    std::fprintf(stderr, "synth: preset %s, %d layers, %d experts, %.3f GB -> %s\n",
                 o->preset.c_str(), cfg.num_hidden_layers, cfg.num_experts, bytes / 1e9,
                 o->out.c_str());
    SynthOptions so;
    so.seed = o->seed;
    so.max_shard_bytes = static_cast<uint64_t>(o->shard_gb * 1e9);
    so.progress = !o->no_progress && stderr_is_tty();
    so.threads = o->threads;
    synthesize_checkpoint(cfg, o->out, so);
    if (o->preset == "tiny-draft") spec::synthesize_draft_head(cfg, o->out, o->seed);
  });
}

}  // namespace k3::cli
