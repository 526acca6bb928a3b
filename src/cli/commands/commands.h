// The k3 subcommands. Each registers itself on the CLI11 app; errors are k3::Error and are
// reported by run_cli as "error: ..." with exit status 1 (2 for usage errors).
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace k3::cli {

void register_generate(CLI::App& app);
void register_synth(CLI::App& app);
void register_inspect(CLI::App& app);
void register_serve(CLI::App& app);
void register_diff(CLI::App& app);  // diff_command.cpp (the CUDA runner: diff_hook.h)

// Directory of the built-in tiny model, synthesized on first use ($K3_CACHE_DIR, else
// $XDG_CACHE_HOME/k3, else ~/.cache/k3).
std::string builtin_tiny_model_dir();

// GPUs visible to this build, one line each. The CUDA layer installs the probe from main(),
// so the engine library itself never links the CUDA runtime.
using GpuProbe = std::vector<std::string> (*)();
void set_gpu_probe(GpuProbe probe);
std::vector<std::string> probe_gpus();
// "cpu" or "cuda" for --device auto | cpu | cuda (auto: the GPU when this build has the CUDA
// backend and one is visible); an impossible request is a k3::Error.
std::string choose_device(const std::string& want);
// True in a follower process of a multi-process run (K3_WORLD_SIZE > 1, K3_RANK != 0): it runs
// serve::run_cuda_follower instead of the command's own work.
bool follower_process();

int run_cli(int argc, char** argv);

}  // namespace k3::cli
